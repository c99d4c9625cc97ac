"""``from_pretrained(directory) -> (model, params)``: one call for a Hugging Face model directory or an
ftitan run directory.

>>> import ftitan as ft
>>> model, params = ft.models.from_pretrained("Qwen3-0.6B/", dtype=torch.bfloat16)   # doctest: +SKIP
>>> model, params = ft.models.from_pretrained("runs/llama3-debug")                    # doctest: +SKIP
>>> ft.infer.generate(model, params, [[1, 2, 3]], max_new_tokens=8)                   # doctest: +SKIP

- An HF directory is ``config.json`` (with ``model_type``) and ``model.safetensors`` (or a sharded
  index): what transformers' ``save_pretrained`` and :func:`~ftitan.models.save_hf` write. Read by
  :func:`~ftitan.models.load_hf`; the family comes from ``model_type``.
- A run directory is what ``ftitan train`` writes: its ``config.json`` (the run's config) and
  ``checkpoints/``. Read by ``ftitan.train.trainer.load_run``, as ``ftitan generate --run`` does:
  the newest valid checkpoint's params.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ftitan import tree
from ftitan.models import hf, registry
from ftitan.models.base import Model

__all__ = ["from_pretrained"]

RUN_CHECKPOINTS = "checkpoints"  # the run directory's checkpoint folder (ftitan.train.trainer)


def from_pretrained(
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    layout: Any = None,
) -> tuple[Model, tree.Tree]:
    """``(model, params)`` from an HF model directory or an ftitan run directory (see the module docstring).

    ``dtype`` (a ``torch.dtype`` or its name, e.g. ``"bfloat16"``; default: as stored) converts the
    floating-point leaves to what ``model.init(dtype=dtype)`` gives (leaves a family keeps in float32
    stay float32); ``device`` (default: the CPU, or the layout's) is where the params go.

    ``layout`` (a ``parallel.Layout``; default: none, full tensors): this rank's params as DTensors,
    as ``parallel.shard_params`` places them (its pipeline stage only under ``pp > 1``). An HF
    directory is then streamed (:func:`~ftitan.models.hf.load_hf_sharded`: each rank reads only its
    blocks); so is a single-process load onto an accelerator (no full checkpoint on the device
    first). A run directory is read whole, then placed.
    """
    d = Path(directory)
    dtype = _dtype(dtype)
    if not d.is_dir():
        raise FileNotFoundError(f"from_pretrained: {d} is not a directory")
    config = _read_config(d)
    if config is not None and "model_type" in config:
        if layout is None and (device is None or torch.device(device).type == "cpu"):
            cfg, params = hf.load_hf(d, dtype=dtype, device=device)  # CPU: views of the mapped files
        else:
            cfg, params = hf.load_hf_sharded(d, layout, dtype=dtype, device=device)
        return registry.model_for(cfg), params
    if config is not None and "model" in config and "recipe" in config:
        from ftitan.train.trainer import load_run  # the trainer imports data/optim: only for a run

        _, model, params, _, _ = load_run(d)
        if layout is None:
            return model, hf.cast_params(model, params, dtype=dtype, device=device)
        return model, _place(model, hf.cast_params(model, params, dtype=dtype), layout, device)
    raise ValueError(
        f"from_pretrained: {d} is neither an HF model directory (config.json with model_type, and "
        f"{hf.WEIGHTS_FILE}: what save_pretrained or ft.models.save_hf write) nor an ftitan run directory "
        f"(config.json of the run and {RUN_CHECKPOINTS}/: what `ftitan train` writes)"
    )


def _place(model: Model, params: tree.Tree, layout: Any, device: torch.device | str | None) -> tree.Tree:
    """Full ``params`` as this rank's DTensors under ``layout`` (its stage under ``pp > 1``), on ``device``."""
    from ftitan import parallel
    from ftitan.parallel.init import layout_device, local_plan, place_local

    if not isinstance(layout, parallel.Layout):
        layout = parallel.Layout(layout)
    device = layout_device(layout, device)
    axes = model.param_axes
    if layout.sizes["pp"] > 1:
        params, axes = parallel.stage_params(params, model, layout), parallel.stage_params(axes, model, layout)
    shardings, blocks = local_plan(params, axes, layout)

    def block(path: str, x: torch.Tensor) -> torch.Tensor:  # only this rank's block moves to the device
        return x[tuple(slice(lo, hi) for lo, hi in blocks[path])].to(device).contiguous()

    return place_local(tree.map_with_path(block, params), shardings, params, layout)


def _read_config(d: Path) -> dict[str, Any] | None:
    """``d/config.json`` as a dict, ``None`` without one."""
    path = d / hf.CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"from_pretrained: {path} is not valid JSON ({e})") from e
    return config if isinstance(config, dict) else None


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a ``torch.dtype`` (its name accepted: ``"bfloat16"``, ``"torch.float16"``)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"from_pretrained: dtype={dtype!r} is not a floating-point torch dtype; e.g. 'bfloat16'")
    return found
