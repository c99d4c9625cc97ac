"""Streaming HF loading: each rank reads only its blocks of a checkpoint, straight into its params.

:func:`ftitan.models.hf.load_hf_sharded` is the entry point. It opens the
safetensors files (``model.safetensors``, or the shards an
``model.safetensors.index.json`` lists) and reads every leaf with
``safe_open(...).get_slice(name)[block]``: under a ``parallel.Layout`` the
block is this rank's (its rows / columns under its placements, its pipeline
stage only), without one the whole leaf. A stacked MoE leaf (per-expert hub
tensors, or transformers 5's fused ``experts.gate_up_proj`` /
``experts.down_proj``) is allocated once, at its local size, and each of
this rank's experts is copied into its row: the experts are never held
twice. On the CPU the slices are views of the memory-mapped file, so each
leaf costs one allocation, in its final dtype (``copy_`` casts as ``.to``
does).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs
import torch
from safetensors import safe_open

from ftitan import random, tree
from ftitan.models import hf

__all__ = ["Checkpoint", "load_sharded"]

Block = Sequence[tuple[int, int]]


@attrs.frozen
class TensorView:
    """A hub-named tensor as stored: ``tensor`` in ``file``, or one expert's rows of a fused tensor."""

    file: str  # safetensors file name in the directory
    tensor: str  # the stored tensor's name
    shape: tuple[int, ...]  # the hub tensor's shape (one expert's, for a fused tensor)
    expert: int | None = None  # fused: this expert's index along the stored tensor's dim 0
    offset: int = 0  # fused gate_up_proj: the first row of this part (0: gate, F: up)


class Checkpoint:
    """An HF directory's safetensors: headers read up front, tensor data read by block on demand.

    Use as a context manager (the files stay open inside it).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.files = _weight_files(self.directory)  # stored tensor name -> file name
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(self.directory / file, framework="pt"))
        return self._handles[file]

    def _slice(self, file: str, name: str) -> Any:
        return self._handle(file).get_slice(name)

    def views(self) -> dict[str, TensorView]:
        """Every tensor under its hub name: fused experts (transformers 5) as per-expert views."""
        out: dict[str, TensorView] = {}
        for name, file in self.files.items():
            shape = tuple(self._slice(file, name).get_shape())
            m = hf._FUSED.fullmatch(name)
            if m is None:
                out[name] = TensorView(file, name, shape)
                continue
            if len(shape) != 3 or (m["proj"] == "gate_up_proj" and shape[1] % 2):
                raise ValueError(
                    f"{name}: shape {shape}; transformers 5 fused experts are (E, 2F, D) gate_up_proj and "
                    f"(E, D, F) down_proj tensors"
                )
            if m["proj"] == "gate_up_proj":  # gate rows first, as transformers' forward chunks them
                f = shape[1] // 2
                parts = {"gate_proj": 0, "up_proj": f}
                per = (f, shape[2])
            else:
                parts, per = {"down_proj": 0}, shape[1:]
            for proj, offset in parts.items():
                for e in range(shape[0]):
                    out[f"{m['pre']}.{e}.{proj}.weight"] = TensorView(file, name, per, e, offset)
        return out

    def dtype(self, view: TensorView) -> torch.dtype:
        """The stored dtype (read off an empty slice: no data)."""
        sl = self._slice(view.file, view.tensor)
        return sl[0:0].dtype if sl.get_shape() else self.read(view, ()).dtype

    def read(self, view: TensorView, block: Block) -> torch.Tensor:
        """``block`` (leading dims, the rest whole) of the hub tensor ``view``: a view of the mapped file
        on the CPU, only that block's bytes touched."""
        if not view.shape:  # a 0-d tensor (fused experts are 3-D: never one)
            return self._handle(view.file).get_tensor(view.tensor)
        sl = self._slice(view.file, view.tensor)
        spans = [(int(lo), int(hi)) for lo, hi in block] + [(0, d) for d in view.shape[len(block) :]]
        (lo, hi), rest = spans[0], spans[1:]
        index = ([] if view.expert is None else [view.expert]) + [slice(view.offset + lo, view.offset + hi)]
        return sl[tuple(index + [slice(a, b) for a, b in rest])]


def _weight_files(directory: Path) -> dict[str, str]:
    """Stored tensor name -> safetensors file (one file, or an index's shards)."""
    single, index = directory / hf.WEIGHTS_FILE, directory / hf.WEIGHTS_INDEX_FILE
    if single.exists():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), hf.WEIGHTS_FILE)
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        absent = sorted({f for f in weight_map.values() if not (directory / f).exists()})
        if absent:
            raise FileNotFoundError(f"{index}: lists shard files that are not in {directory}: {', '.join(absent)}")
        return dict(weight_map)
    raise FileNotFoundError(f"{directory}: neither {hf.WEIGHTS_FILE} nor {hf.WEIGHTS_INDEX_FILE} found")


def _target_dtype(stored: torch.dtype, like: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    # as hf.from_hf casts: a floating leaf takes init(dtype=dtype)'s dtype, so float32-kept leaves stay float32
    return like.dtype if dtype is not None and stored.is_floating_point else stored


def _shape_error(path: str, names: Sequence[str], got: Sequence[int], want: Sequence[int]) -> ValueError:
    return ValueError(
        f"{path} (from {', '.join(names)}): checkpoint shape {tuple(got)}, config expects {tuple(want)}"
    )


def load_leaf(
    ckpt: Checkpoint,
    views: Mapping[str, TensorView],
    m: hf.WeightMap,
    like: torch.Tensor,
    block: Block | None,
    *,
    dtype: torch.dtype | None,
    device: torch.device,
) -> torch.Tensor:
    """``block`` (``None``: all) of the leaf ``m.path`` (``like``: its meta init), read into one new tensor."""
    block = tuple(block) if block is not None else tuple((0, d) for d in like.shape)
    out_shape = tuple(hi - lo for lo, hi in block)
    tensors = [views[n] for n in m.names]
    if m.from_hf is None:  # a rename: the leaf is the stored tensor
        (v,) = tensors
        if v.shape != tuple(like.shape):
            raise _shape_error(m.path, m.names, v.shape, like.shape)
        out = torch.empty(out_shape, dtype=_target_dtype(ckpt.dtype(v), like, dtype), device=device)
        return out.copy_(ckpt.read(v, block))
    if m.stack is not None:  # per-expert tensors: each copied into its row of the one output
        for name, v in zip(m.names, tensors, strict=True):
            if v.shape != m.stack:
                raise ValueError(
                    f"{m.path} (from {name}): checkpoint shape {v.shape}, config expects {m.stack} per expert"
                )
        if (len(tensors), *m.stack) != tuple(like.shape):
            raise _shape_error(m.path, m.names, (len(tensors), *m.stack), like.shape)
        stored = functools.reduce(torch.promote_types, (ckpt.dtype(v) for v in tensors))
        out = torch.empty(out_shape, dtype=_target_dtype(stored, like, dtype), device=device)
        (e0, e1), rest = block[0], block[1:]
        for row, e in enumerate(range(e0, e1)):
            out[row].copy_(ckpt.read(tensors[e], rest))
        return out
    if m.rows is not None:  # a row permutation: the block's rows, read as runs of consecutive stored rows
        (v,) = tensors
        flat = math.prod(v.shape[1:]) == math.prod(like.shape[1:]) and v.shape[1:] != tuple(like.shape[1:])
        if v.shape[0] != len(m.rows) or not (flat or v.shape[1:] == tuple(like.shape[1:])):
            raise _shape_error(m.path, m.names, v.shape, like.shape)
        (r0, r1), rest = block[0], block[1:]
        if flat:  # rows stored in another shape (a Conv1d's (1, K)): whole rows, reshaped
            if any((lo, hi) != (0, d) for (lo, hi), d in zip(rest, like.shape[1:], strict=True)):
                raise ValueError(f"{m.path}: a block {block} that splits the rows of {m.names[0]} {v.shape}")
            rest = ()
        want, parts, start = m.rows[r0:r1], [], 0
        for i in range(1, len(want) + 1):
            if i == len(want) or want[i] != want[i - 1] + 1:
                parts.append(ckpt.read(v, ((want[start], want[i - 1] + 1), *rest)).reshape(-1, *out_shape[1:]))
                start = i
        out = torch.empty(out_shape, dtype=_target_dtype(ckpt.dtype(v), like, dtype), device=device)
        return out.copy_(torch.cat(parts)) if parts else out
    # another join (none of the built-in families has one): the whole stored tensors, joined, then the block
    x = m.from_hf(tuple(ckpt.read(v, ()) for v in tensors))
    if tuple(x.shape) != tuple(like.shape):
        raise _shape_error(m.path, m.names, x.shape, like.shape)
    out = torch.empty(out_shape, dtype=_target_dtype(x.dtype, like, dtype), device=device)
    return out.copy_(x[tuple(slice(lo, hi) for lo, hi in block)])


def read_config(directory: Path) -> Any:
    """The ftitan config of an HF directory's ``config.json``."""
    path = directory / hf.CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory}: no {hf.CONFIG_FILE}; is this an HF model directory?")
    return hf.config_from_hf(json.loads(path.read_text()))


def load_sharded(
    directory: str | Path,
    layout: Any = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[Any, tree.Tree]:
    """``(cfg, params)``; see :func:`ftitan.models.hf.load_hf_sharded`."""
    d = Path(directory)
    cfg = read_config(d)
    family = hf.family_of(cfg)
    model = family.model(cfg)
    expected = model.init(random.key(0), dtype=dtype or torch.float32, device="meta")
    maps = {m.path: m for m in hf._table(family, cfg, tree.paths(expected))}
    like, blocks, place = expected, {}, None
    if layout is None:
        device = torch.device("cpu" if device is None else device)
    else:
        from ftitan import parallel  # the parallel package imports the train step: only when asked
        from ftitan.parallel import init as pinit

        if not isinstance(layout, parallel.Layout):
            layout = parallel.Layout(layout)
        device = pinit.layout_device(layout, device)
        staged = layout.sizes["pp"] > 1
        like = parallel.stage_params(expected, model, layout) if staged else expected
        axes = parallel.stage_params(model.param_axes, model, layout) if staged else model.param_axes
        shardings, blocks = pinit.local_plan(like, axes, layout)
        place = functools.partial(pinit.place_local, shardings=shardings, like=like, layout=layout)
    paths, leaves, treedef = tree.flatten_with_paths(like)
    with Checkpoint(d) as ckpt:
        views = hf.text_decoder(ckpt.views())  # a multimodal checkpoint: its text decoder
        hf.check_names(family, cfg, list(maps.values()), {n: v.shape for n, v in views.items()})
        out = [load_leaf(ckpt, views, maps[p], x, blocks.get(p), dtype=dtype, device=device)
               for p, x in zip(paths, leaves, strict=True)]  # fmt: skip
    params = tree.unflatten(treedef, out)
    return cfg, params if place is None else place(params)
