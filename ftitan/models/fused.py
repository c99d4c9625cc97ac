"""Fused projections: ``[wq; wk; wv] -> wqkv`` and ``[w1; w3] -> w13``, one matmul each.

The decoder functions read either layout (``decoder.attention`` reads ``wqkv``, ``nn.swiglu`` reads
``w13``), so fusing is a pure transform of the params tree, not a second model:

- for inference (``ftitan.infer.fuse_projections``): a decode step is a handful of skinny matmuls
  per layer; stacking the ones that read the same input makes fewer and wider ones, as inference
  engines do;
- for training (a model config's ``fuse_projections=True``, ``--model.fuse-projections``): the model's
  ``init`` stacks the leaves it drew (the same values as the unfused init), so the step runs one
  wider GEMM where it ran three (q, k, v) or two (gate, up), forward and backward. AdamW is
  elementwise, so a fused run follows the unfused one to float32 rounding (the GEMMs sum in another
  order). FSDP, DDP, cp and pp split, copy or stage the stacked leaves like any other (their logical axes,
  :data:`FUSED_AXES`, keep the ``embed`` dim FSDP splits); tensor parallelism is refused (its head splits
  do not follow the stacked rows), and so are, by ``ftitan.config``, optimizers that read a whole matrix
  (Muon) and LoRA's targets. Checkpoints in HF's format keep HF's separate names (:func:`fuse_weight_maps`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ftitan import tree

__all__ = ["FUSED", "FUSED_AXES", "fuse_axes", "fuse_projections", "fuse_weight_maps", "fused_init", "fused_slices"]

# fused leaf -> the leaves it stacks along the output dimension, in order
FUSED: dict[str, tuple[str, ...]] = {"wqkv": ("wq", "wk", "wv"), "w13": ("w1", "w3")}
# the fused leaves' logical axes: their rows mix heads (or gate and up), so no parallel rule splits them
FUSED_AXES: dict[str, tuple[str, str]] = {"wqkv": ("fused_qkv", "embed"), "w13": ("fused_mlp", "embed")}


def _fusable(node: Mapping[str, Any], parts: tuple[str, ...]) -> bool:
    leaves = [node.get(k) for k in parts]
    return all(isinstance(x, torch.Tensor) and x.dim() == 2 for x in leaves) and len(
        {x.shape[1] for x in leaves}) == 1  # fmt: skip


def _fuse(node: Any, fusable: Callable[[Mapping[str, Any], tuple[str, ...]], bool],
          join: Callable[[str, list[Any]], Any]) -> Any:  # fmt: skip
    if not isinstance(node, Mapping):
        return node
    out = {k: _fuse(v, fusable, join) for k, v in node.items()}
    for fused, parts in FUSED.items():
        if fusable(out, parts):
            out[fused] = join(fused, [out.pop(k) for k in parts])
    return out


def fuse_projections(params: tree.Tree) -> tree.Tree:
    """``params`` with every ``{wq, wk, wv}`` (2-D, same input width) stacked into ``wqkv`` and every
    ``{w1, w3}`` into ``w13`` (dense SwiGLUs; MoE experts are 3-D and stay). Pure (new tensors);
    already fused trees come back unchanged."""
    return _fuse(params, _fusable, lambda _, parts: torch.cat(parts))


def fuse_axes(axes: tree.Tree) -> tree.Tree:
    """A ``param_axes`` tree (logical-axis tuples) shaped like :func:`fuse_projections`' output."""

    def fusable(node: Mapping[str, Any], parts: tuple[str, ...]) -> bool:
        return all(isinstance(node.get(k), tuple) and len(node[k]) == 2 for k in parts)

    return _fuse(axes, fusable, lambda fused, _: FUSED_AXES[fused])


def fused_init(init: Callable[..., tree.Tree]) -> Callable[..., tree.Tree]:
    """``init(key, **kw)`` followed by :func:`fuse_projections`: the unfused init's values, stacked."""

    def fused(key: torch.Tensor, **kwargs: Any) -> tree.Tree:
        return fuse_projections(init(key, **kwargs))

    return fused


def fused_slices(params: tree.Tree) -> dict[str, tuple[str, int, int]]:
    """For an unfused ``params`` tree: ``{leaf path: (fused path, first row, end row)}`` of each leaf
    :func:`fuse_projections` stacks, e.g. ``"layers.0.attn.wk" -> ("layers.0.attn.wqkv", 256, 320)``."""
    slices: dict[str, tuple[str, int, int]] = {}

    def visit(node: Any, prefix: str) -> None:
        if not isinstance(node, Mapping):
            return
        for fused, parts in FUSED.items():
            if _fusable(node, parts):
                row = 0
                for k in parts:
                    slices[prefix + k] = (prefix + fused, row, row + node[k].shape[0])
                    row += node[k].shape[0]
        for k, v in node.items():
            visit(v, f"{prefix}{k}.")

    visit(params, "")
    return slices


def fuse_weight_maps(maps: Sequence[Any], unfused: tree.Tree) -> list[Any]:
    """An HF name table (``hf.WeightMap`` per unfused leaf) for the fused tree: each fused leaf maps to its
    parts' checkpoint names, split into them on export and stacked on import (shapes checked, naming
    the tensor). ``unfused``: the unfused params, or their shapes-only init (``device="meta"``)."""
    from ftitan.models.hf import WeightMap  # hf imports the families, which import this module

    slices = fused_slices(unfused)
    by_path = {m.path: m for m in maps}
    groups: dict[str, list[tuple[int, int, Any]]] = {}
    for path, (fused, start, end) in slices.items():
        m = by_path[path]
        if len(m.names) != 1 or m.to_hf is not None or m.from_hf is not None:
            raise ValueError(f"{path}: fusing needs a plain rename to one checkpoint name, got {m.names}")
        groups.setdefault(fused, []).append((start, end, m))
    out = [m for m in maps if m.path not in slices]
    for fused, parts in groups.items():
        parts.sort(key=lambda p: p[0])
        names = tuple(m.names[0] for _, _, m in parts)
        rows = [end - start for start, end, _ in parts]

        def split(t: torch.Tensor, rows: list[int] = rows) -> Sequence[torch.Tensor]:
            return t.split(rows)

        def join(ts: Sequence[torch.Tensor], rows: list[int] = rows, names: tuple[str, ...] = names,
                 fused: str = fused) -> torch.Tensor:  # fmt: skip
            for name, t, n in zip(names, ts, rows, strict=True):
                if t.dim() != 2 or t.shape[0] != n:
                    raise ValueError(f"{fused} (from {name}): checkpoint shape {tuple(t.shape)}, config expects "
                                     f"{n} rows")  # fmt: skip
            return torch.cat(tuple(ts))

        out.append(WeightMap(path=fused, names=names, to_hf=split, from_hf=join))
    return out
