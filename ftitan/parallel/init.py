"""Per-rank init: each rank draws only the blocks it holds, directly on its device.

``init_params(model, key, layout)`` equals
``shard_params(stage_params(model.init(key), ...), ...)`` -- the same DTensor
placements, bit-equal values -- without ever building a full tensor: every
leaf is drawn from ``fold_in(key, path)`` by a counter-based draw
(:mod:`ftitan.random`), so this rank's block of it (its rows / columns under
its ``tp`` / ``ep`` / ``dp_shard`` coordinates, :func:`local_block`) is
computed from its flat indices alone (``nn.init(specs, key, blocks=...)``).
Under ``pp > 1`` only this rank's stage is drawn. Memory per rank: its shards,
plus, per leaf, the int64 temporaries of a draw (bounded by ``ftitan.random``'s
chunking).

>>> layout = parallel.Layout(parallel.mesh(dp_shard=8))          # doctest: +SKIP
>>> params = parallel.init_params(model, ft.random.key(0), layout, dtype=torch.bfloat16)  # doctest: +SKIP

The spec tree comes from the model itself: a ``Model`` whose ``init`` is the
family's own (``functools.partial(nn.init, specs)``, or the family module's
``model(cfg).init`` around ``nn.init(param_specs(cfg))``, as DeepSeek-V3's,
which keeps its routing bias in float32: per-leaf dtypes come from a
shapes-only ``init`` on the meta device). For any other ``Model`` (a
transformed ``init``), pass ``specs=`` whose ``nn.init`` equals that ``init``
up to dtypes, or get the fallback: the full ``model.init`` on ``device``,
then each rank's blocks copied out (full-size memory for a moment). With an
``init`` that is exactly ``nn.init(specs)`` nothing full-sized is built, not
even on the meta device.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ftitan import nn, random, tree
from ftitan.models.base import Model
from ftitan.parallel.layout import Layout
from ftitan.parallel.pipeline import stage_params
from ftitan.parallel.rules import Sharding, local_slice, resolve

__all__ = ["init_params", "layout_device", "local_block", "local_plan", "place_local", "stage_shapes"]

Block = tuple[tuple[int, int], ...]  # (start, stop) per dim


def local_block(shape: Sequence[int], sharding: Sharding, coords: Mapping[str, int], sizes: Mapping[str, int]) -> Block:
    """``(start, stop)`` per dim of this rank's block of a tensor of ``shape``: the indices
    :func:`ftitan.parallel.rules.local_slice` takes (dim ``i`` split evenly over its mesh axes,
    this rank's index on them row-major, outermost axis first)."""
    out = []
    for size, axes in zip(shape, sharding.dims, strict=True):
        n = math.prod(sizes[a] for a in axes)
        index = 0
        for a in axes:
            index = index * sizes[a] + coords[a]
        step = size // n
        out.append((index * step, (index + 1) * step))
    return tuple(out)


def layout_device(layout: Layout, device: torch.device | str | None = None) -> torch.device:
    """``device``, or the layout's: the current CUDA device on a CUDA mesh, else the CPU."""
    if device is not None:
        return torch.device(device)
    if layout.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(layout.mesh.device_type)


def _staged(tree_: Any, model: Model, layout: Layout) -> Any:
    return stage_params(tree_, model, layout) if layout.sizes["pp"] > 1 else tree_


def stage_shapes(model: Model, layout: Layout, *, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(like, axes)``: this rank's stage of a shapes-only ``model.init(dtype=dtype)`` (meta tensors:
    each leaf's global shape and dtype) and of ``model.param_axes``."""
    like = model.init(random.key(0), dtype=dtype, device="meta")
    return _staged(like, model, layout), _staged(model.param_axes, model, layout)


def local_plan(like: Any, axes: Any, layout: Layout) -> tuple[Any, dict[str, Block]]:
    """``(shardings, blocks)`` of the leaves of ``like`` (anything with a ``.shape``: meta tensors,
    ``nn.Param`` specs): their :class:`Sharding` under ``layout.rules`` (a tree) and this rank's block
    of each, ``{path: ((start, stop), ...)}``."""
    shardings = resolve(like, axes, layout.rules, layout.sizes)  # sizes: slicing the mesh per leaf is slow
    paths, leaves, treedef = tree.flatten_with_paths(like)
    blocks = {
        p: local_block(x.shape, s, layout.coords, layout.sizes)
        for p, x, s in zip(paths, leaves, treedef.flatten_up_to(shardings), strict=True)
    }
    return shardings, blocks


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, out = 1, []
    for d in reversed(tuple(shape)):
        out.append(stride)
        stride *= max(int(d), 1)
    return tuple(reversed(out))


def place_local(local: Any, shardings: Any, like: Any, layout: Layout) -> Any:
    """Local blocks as DTensors of ``like``'s global shapes (leaves with a ``.shape``), placed as
    ``shard_params`` places them (on ``layout.storage_mesh``, no communication)."""

    def one(x: torch.Tensor, s: Sharding, ref: Any) -> DTensor:
        placements = s.placements(layout.storage_axes)
        return DTensor.from_local(
            x, layout.storage_mesh, placements, run_check=False, shape=ref.shape, stride=_contiguous_stride(ref.shape)
        )

    return tree.map(one, local, shardings, like)


def _family_specs(model: Model) -> tuple[Any | None, bool]:
    """``(specs, exact)``: the spec tree ``model.init`` draws from when ``init`` is the family's own (else
    ``None``); ``exact``: ``init`` is ``nn.init(specs, ...)`` itself, so every leaf has ``init``'s dtype."""
    init = model.init
    if getattr(model.config, "fuse_projections", False):  # its leaves are stacks of the specs' (models.fused)
        return None, False
    if isinstance(init, functools.partial) and init.func is nn.init and len(init.args) == 1 and not init.keywords:
        return init.args[0], True
    module = sys.modules.get(type(model.config).__module__)
    param_specs, family_model = getattr(module, "param_specs", None), getattr(module, "model", None)
    code = getattr(init, "__code__", None)
    if param_specs is None or family_model is None or code is None:
        return None, False
    if getattr(family_model(model.config).init, "__code__", None) is not code:
        return None, False  # a different init (a transform): its values may differ from the specs'
    return param_specs(model.config), False


def _check_specs(specs: Any, like: Any) -> None:
    """``specs`` give the leaves, shapes and logical axes of ``like`` (a shapes-only init)."""
    sp, ss, _ = tree.flatten_with_paths(specs)
    lp, ls, _ = tree.flatten_with_paths(like)
    if sp != lp:
        raise ValueError(
            f"init_params: the specs have leaves [{', '.join(sorted(set(sp) - set(lp))[:4])}] the params do not, "
            f"and lack [{', '.join(sorted(set(lp) - set(sp))[:4])}]; pass specs= shaped like model.init's params"
        )
    for p, s, x in zip(sp, ss, ls, strict=True):
        if s.shape != tuple(x.shape):
            raise ValueError(f"init_params: {p}: spec shape {s.shape}, model.init gives {tuple(x.shape)}")


def init_params(
    model: Model,
    key: torch.Tensor,
    layout: Layout | DeviceMesh | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    specs: Any | None = None,
) -> Any:
    """This rank's params as DTensors, drawn block by block on ``device`` (see the module docstring).

    Equals ``shard_params(stage_params(model.init(key, dtype=dtype), model, layout),
    stage_params(model.param_axes, ...), layout.rules, layout)`` (the stage only under ``pp > 1``;
    bit-equal values on the same device type). ``device`` defaults to the layout's
    (:func:`layout_device`); ``device="meta"`` builds shapes and placements only. A
    ``DeviceMesh`` is placed by the default rules; ``layout=None`` is ``model.init(key, ...)``.
    ``specs``: the spec tree for a ``Model`` whose ``init`` is not its family's own (its ``nn.init``
    must equal ``model.init`` up to each leaf's dtype).
    """
    if layout is None:
        return model.init(key, dtype=dtype, device=device)
    if isinstance(layout, DeviceMesh):
        layout = Layout(layout)
    device = layout_device(layout, device)
    exact = False
    if specs is None:
        specs, exact = _family_specs(model)
    axes = _staged(model.param_axes, model, layout)
    if specs is None:
        like = stage_shapes(model, layout, dtype=dtype)[0]
        shardings, _ = local_plan(like, axes, layout)
        return place_local(_sliced_full_init(model, key, layout, shardings, dtype, device), shardings, like, layout)
    specs = _staged(specs, model, layout)
    # nn.init(specs) is init itself: nothing to probe. Otherwise a shapes-only init (meta: nothing is
    # allocated) gives each leaf's dtype (DeepSeek-V3 keeps its routing bias in float32) and checks the specs
    like = None if exact else stage_shapes(model, layout, dtype=dtype)[0]
    if like is not None:
        _check_specs(specs, like)
    shardings, blocks = local_plan(specs, axes, layout)
    local = nn.init(specs, key, dtype=dtype, device=device, blocks=blocks)
    if like is not None:
        local = tree.map(lambda x, ref: x.to(ref.dtype), local, like)
    return place_local(local, shardings, specs, layout)


def _sliced_full_init(
    model: Model, key: torch.Tensor, layout: Layout, shardings: Any, dtype: torch.dtype, device: torch.device
) -> Any:
    """The fallback: the whole ``model.init`` on ``device``, then copies of this rank's blocks."""
    full = _staged(model.init(key, dtype=dtype, device=device), model, layout)
    _, leaves, treedef = tree.flatten_with_paths(full)
    del full
    out = []
    for x, s in zip(leaves, treedef.flatten_up_to(shardings), strict=True):
        out.append(local_slice(x, s, layout.coords, layout.sizes).clone())
    del leaves
    return tree.unflatten(treedef, out)
