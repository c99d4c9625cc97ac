"""Distributed Muon over a parallel run's DTensor state: what ``ftitan train`` runs under dp_shard / tp.

The trainer stores each leaf as a ``DTensor`` split by the rules (``ftitan.parallel``): FSDP rows over
``dp_shard``, heads / MLP width over ``tp``, experts over ``ep``. Muon's momentum, weight decay and learning
rate are elementwise and run on the local shards. Its Newton-Schulz needs whole matrices (or whole blocks),
and per leaf this transform does the least work that gives them:

- **local**: the leaf's matrix dims are not split (a replicated matrix, or a 3-D expert stack split over
  its expert dim: each rank holds whole experts), or ``blocks`` orthogonalizes it per block of the dim
  that is split and every rank's shard is whole blocks (``--flexshard.placement block`` stores whole
  heads per rank: per-head Muon with no communication). Each rank orthogonalizes its shard.
- **owned**: otherwise the leaf is *owned* by one rank of the ranks that split it (balanced by
  ``newton_schulz_cost``, the largest first, ties to the lowest rank): one all-to-all sends every rank's
  shards of the leaves it does not own to their owners, each owner orthogonalizes its whole matrices (per
  block too), and one all-to-all sends each rank its shard of the updates. Per step and per group of
  ranks: two all-to-alls, each rank's Newton-Schulz work about ``1 / n`` of the model's (FSDP-only Muon,
  ``DTensor`` algebra: every rank gathers and orthogonalizes every matrix).

Results equal single-process :func:`ftitan.optim.muon` with the same ``blocks``, bit for bit (the same
matrices, batched by shape on each rank; the exchanges carry the Newton-Schulz dtype, which Newton-Schulz
casts its input to first, and each rank casts and scales its own shard of the result). The compute layout (who owns what) is a function
of the shapes and the mesh, not state: the momentum is stored like the params, so a checkpoint reshards to
another layout as the params do, and the owners are recomputed there.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ftitan import tree
from ftitan.flexshard.plan import balance, newton_schulz_cost
from ftitan.optim.adam import adamw
from ftitan.optim.muon import (
    DEFAULT_COEFFICIENTS,
    Blocks,
    MuonState,
    NesterovStyle,
    ShapeScaling,
    as_matrices,
    block_of,
    check_arguments,
    from_matrices,
    init_state,
    momentum_step,
    muon_chain,
    muon_shape_scale,
    orthogonalize,
    scaled_update,
)
from ftitan.optim.muon_adamw import muon_with_adamw as _muon_with_adamw
from ftitan.optim.schedules import Schedule
from ftitan.optim.transform import Transform, Updates
from ftitan.parallel import collectives as C
from ftitan.parallel.dims import AXES
from ftitan.parallel.layout import Layout
from ftitan.parallel.rules import Rules
from ftitan.parallel import shard as parallel_shard
from ftitan.parallel.shard import from_local, on_shards

__all__ = ["block_rules", "head_blocks", "mesh_muon", "mesh_muon_with_adamw", "muon_kind", "scale_by_mesh_muon",
           "sharded_adamw"]  # fmt: skip

HEAD_AXES = {"heads": "n_heads", "kv_heads": "n_kv_heads"}  # logical axis -> the model config's head count


def _head_dims(model: Any) -> dict[str, tuple[int, int, tuple[str | None, ...], tuple[int, ...]]]:
    """``{path: (dim, heads, logical axes, shape)}`` of ``model``'s matrices with a ``heads`` / ``kv_heads`` logical
    axis on one of their two matrix dims (the first such dim), expert stacks aside; ``heads``: the config's
    count of that axis."""
    from ftitan import random

    out = {}

    def one(path: str, x: Any, axes: tuple[str | None, ...]) -> None:
        dims = [d for d in range(max(0, x.ndim - 2), x.ndim) if axes[d] in HEAD_AXES]
        if dims and "experts" not in axes:
            out[path] = (dims[0], getattr(model.config, HEAD_AXES[axes[dims[0]]], 0), tuple(axes), tuple(x.shape))

    tree.map_with_path(one, model.init(random.key(0), device="meta"), model.param_axes)
    return out


def head_blocks(model: Any) -> dict[str, tuple[int, int]]:
    """``blocks`` for per-head Muon on ``model`` (a ``ftitan.models.Model``): every matrix with a
    ``heads`` / ``kv_heads`` logical axis on one of its two matrix dims (q/k/v/o projections, MLA's
    up-projections), cut into that many blocks along it; one glob per leaf name (the layer index as ``*``)."""
    out: dict[str, tuple[int, int]] = {}
    for path, (d, heads, _, shape) in _head_dims(model).items():
        if heads and shape[d] % heads == 0:
            out.setdefault(_glob(path), (d - len(shape), shape[d] // heads))
    return out


def block_rules(rules: Rules, model: Any, sizes: Mapping[str, int]) -> Rules:
    """``rules`` with ``dp_shard`` storing whole heads and whole experts (FlexShard's ``BlockShard`` for the
    trainer, ``--flexshard.placement block``): every matrix with a ``heads`` / ``kv_heads`` axis is split over
    ``dp_shard`` along that axis (per-head Muon is then local where the heads divide evenly), and expert stacks
    along their expert dim (per-expert Muon is local). Only where the axis has no other split (``tp`` for
    heads, ``ep`` for experts, size 1 in ``sizes``): DTensor splits one dim over several mesh axes outermost
    first, and ``dp_shard`` is outer to ``tp`` and ``ep``, so their blocks would interleave."""
    if sizes.get("ep", 1) == 1:
        rules = rules.with_rule("experts", (*rules.mesh_axes("experts"), "dp_shard"))
    if sizes.get("tp", 1) > 1:
        return rules
    overrides: dict[str, tuple[tuple[str, ...], ...]] = {}
    for path, (d, _, axes, _) in _head_dims(model).items():
        per_dim = tuple(("dp_shard",) if i == d else
                        tuple(a for a in (rules.mesh_axes(ax) if ax else ()) if a != "dp_shard")
                        for i, ax in enumerate(axes))  # fmt: skip
        overrides.setdefault(_glob(path), per_dim)
    for pattern, per_dim in overrides.items():
        rules = rules.with_override(pattern, per_dim)
    return rules


def _glob(path: str) -> str:
    """``path`` with its layer index as ``*``: one pattern for that leaf of every layer."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def _split_axes(x: Any) -> tuple[str, ...]:
    """The mesh axes splitting one of the two matrix dims of ``x`` (a DTensor; ``()`` for a plain tensor)."""
    if not isinstance(x, DTensor) or x.ndim < 2:
        return ()
    names = x.device_mesh.mesh_dim_names or ()
    return tuple(a for a, p in zip(names, x.placements, strict=True) if isinstance(p, Shard) and p.dim >= x.ndim - 2)


def _dims(x: DTensor) -> dict[str, int]:
    """``{mesh axis: tensor dim}`` of the axes splitting ``x``."""
    names = x.device_mesh.mesh_dim_names or ()
    return {a: p.dim for a, p in zip(names, x.placements, strict=True) if isinstance(p, Shard)}


def muon_kind(x: Any, path: str, blocks: Blocks | None) -> str:
    """How the ranks orthogonalize leaf ``path`` stored as ``x``: ``"local"`` (each rank its own shard: the
    matrix dims are whole, or split into whole blocks of ``blocks``) or ``"owned"`` (one rank, its owner,
    the whole matrix)."""
    split = _split_axes(x)
    if not split:
        return "local"
    block = block_of(path, blocks)
    if block is None:
        return "owned"
    dims, d = _dims(x), block[0] % x.ndim
    local = parallel_shard.local_shard(x)
    return "local" if all(dims[a] == d for a in split) and local.shape[d] % block[1] == 0 else "owned"


class _Group:
    """The leaves owned within one group of ranks (those splitting their matrix dims over ``axes``)."""

    def __init__(self, axes: tuple[str, ...], mesh: DeviceMesh, sizes: dict[str, int]) -> None:
        self.axes, self.mesh, self.sizes = axes, mesh, sizes
        self.world, self.me = mesh.size(), mesh.get_local_rank()

    def coords(self, j: int) -> dict[str, int]:
        """Member ``j``'s coordinate on each axis (row-major over ``axes`` in mesh order)."""
        out = {}
        for a in reversed(self.axes):
            j, out[a] = divmod(j, self.sizes[a])
        return out

    def piece(self, j: int, x: DTensor, local_shape: Sequence[int]) -> tuple[slice, ...]:
        """Where member ``j``'s shard lies in the leaf's whole matrices (the other dims as held)."""
        dims, c = _dims(x), self.coords(j)
        out = []
        for d, n in enumerate(local_shape):
            axes = [a for a in AXES if a in self.axes and dims[a] == d]
            index = 0
            for a in axes:
                index = index * self.sizes[a] + c[a]
            out.append(slice(index * n, (index + 1) * n))
        return tuple(out)

    def whole_shape(self, x: DTensor, local_shape: Sequence[int]) -> tuple[int, ...]:
        dims = _dims(x)
        return tuple(n * math.prod(self.sizes[a] for a in self.axes if dims[a] == d) for d, n in enumerate(local_shape))


def scale_by_mesh_muon(
    layout: Layout | None,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_dtype: torch.dtype = torch.bfloat16,
    shape_scaling: ShapeScaling = "original",
    *,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    eps: float = 1e-7,
    nesterov_style: NesterovStyle = "torch",
    blocks: Blocks | None = None,
) -> Transform:
    """:func:`ftitan.optim.scale_by_muon` over DTensor leaves of ``layout`` (see the module docstring);
    plain tensors (``layout=None``, one process) are orthogonalized where they are. The groups of ranks
    for leaves split over several mesh axes are made here, on every rank alike (a collective call)."""
    check_arguments(momentum, nesterov_style, shape_scaling)
    meshes: dict[tuple[str, ...], DeviceMesh] = {}
    if layout is not None:
        axes = [a for a in layout.storage_axes if layout.sizes[a] > 1]
        for k in range(1, len(axes) + 1):
            for combo in itertools.combinations(axes, k):
                meshes[combo] = layout.mesh[combo[0]] if k == 1 else layout.mesh[combo]._flatten("_".join(combo))

    def init(params: Any) -> MuonState:
        return init_state(params, nesterov_style, fix="flexshard.mesh_muon_with_adamw")

    def update(grads: Updates, state: MuonState, params: Any = None) -> tuple[Updates, MuonState]:
        del params
        paths, gs, treedef = tree.flatten_with_paths(grads)
        bufs = tree.leaves(state.momentum)
        count = None if state.count is None else state.count + 1
        local = parallel_shard.local_shard
        new_bufs, inputs = momentum_step([local(g) for g in gs], [local(b) for b in bufs], momentum, nesterov,
                                         nesterov_style, count)  # fmt: skip
        blocks_of = [block_of(path, blocks) for path in paths]
        kinds = [muon_kind(g, path, blocks) for path, g in zip(paths, gs, strict=True)]
        mats: list[torch.Tensor | None] = [None] * len(gs)
        owned: dict[tuple[str, ...], list[int]] = {}  # by the axes that split them: one group of ranks each
        for i, (path, x, kind) in enumerate(zip(paths, inputs, kinds, strict=True)):
            if kind == "local":  # (Newton-Schulz casts to ns_dtype first: the same batches as the owned ones)
                mats[i] = as_matrices(x, blocks_of[i], path).to(ns_dtype)
            else:
                owned.setdefault(_split_axes(gs[i]), []).append(i)
        exchanges = []
        for split, members in sorted(owned.items()):
            if split not in meshes:
                raise ValueError(f"flexshard.mesh_muon: {paths[members[0]]} is split over {split}, which the "
                                 f"layout this optimizer was built for does not have; build it with the run's layout")
            group = _Group(split, meshes[split], layout.sizes)  # type: ignore[union-attr]
            exchanges.append(_exchange(group, members, gs, inputs, paths, blocks_of, mats, ns_dtype))
        ortho = orthogonalize(mats, steps=ns_steps, coefficients=coefficients, eps=eps,  # type: ignore[arg-type]
                              dtype=ns_dtype)  # fmt: skip
        outputs: list[torch.Tensor | None] = [None] * len(gs)
        for i, o in enumerate(ortho):
            if kinds[i] == "local":
                g = local(gs[i])
                outputs[i] = scaled_update(o, g.dtype, g.shape, blocks_of[i], shape_scaling)
        for ex in exchanges:
            ex.scatter(ortho, gs, blocks_of, shape_scaling, outputs)
        momentum_bufs = from_local(tree.unflatten(tree.structure(state.momentum), new_bufs), state.momentum)
        return from_local(tree.unflatten(treedef, outputs), grads), MuonState(momentum=momentum_bufs, count=count)

    return Transform(init, update)


class _Exchange:
    """One group's owned leaves: their shards gathered whole on the owners (one all-to-all, :func:`_exchange`),
    the orthogonalized leaves' shards sent back (:meth:`scatter`, one all-to-all). Both travel in the
    Newton-Schulz dtype: Newton-Schulz casts its input to it first, and each rank casts and scales its shard
    of the result as :func:`ftitan.optim.muon.scaled_update` does, so the bits are single-process Muon's."""

    def __init__(self, group: _Group, members: list[int], owners: list[int], shapes: list[tuple[int, ...]],
                 wholes: list[tuple[int, ...]], matrices: list[tuple[int, int]], like: torch.Tensor) -> None:  # fmt: skip
        self.group, self.members, self.owners, self.shapes = group, members, owners, shapes
        self.wholes, self.matrices = wholes, matrices  # each leaf's whole shape, and its matrices' (m, n)
        self.dtype, self.device = like.dtype, like.device
        self.mine = [k for k, o in enumerate(owners) if o == group.me]

    def splits(self) -> tuple[list[int], list[int]]:
        """``(numel from each member, numel of mine)``: an all-to-all's splits, shards to owners."""
        numel = [math.prod(s) for s in self.shapes]
        per_owner = [sum(numel[k] for k, o in enumerate(self.owners) if o == j) for j in range(self.group.world)]
        return per_owner, [sum(numel[k] for k in self.mine)] * self.group.world

    def scatter(self, ortho: list[torch.Tensor], gs: list[Any], blocks_of: list[Any], shape_scaling: ShapeScaling,
                outputs: list[torch.Tensor | None]) -> None:  # fmt: skip
        g = self.group
        whole = {k: from_matrices(ortho[self.members[k]], self.wholes[k], blocks_of[self.members[k]])
                 for k in self.mine}  # fmt: skip
        sends = [whole[k][g.piece(j, gs[self.members[k]], self.shapes[k])].reshape(-1)
                 for j in range(g.world) for k in self.mine]  # fmt: skip
        per_owner, mine = self.splits()
        buf = torch.cat(sends) if sends else torch.zeros(0, dtype=self.dtype, device=self.device)
        got = C.all_to_all(buf, g.mesh, out_splits=per_owner, in_splits=mine).split(
            [math.prod(self.shapes[k]) for j in range(g.world) for k, o in enumerate(self.owners) if o == j])
        order = [k for j in range(g.world) for k, o in enumerate(self.owners) if o == j]  # from owner j, its leaves
        for piece, k in zip(got, order, strict=True):
            i = self.members[k]
            scale = muon_shape_scale(*self.matrices[k], shape_scaling)
            outputs[i] = piece.view(self.shapes[k]).to(parallel_shard.local_shard(gs[i]).dtype) * scale


def _exchange(group: _Group, members: list[int], gs: list[Any], inputs: list[torch.Tensor], paths: list[str],
              blocks_of: list[Any], mats: list[torch.Tensor | None], dtype: torch.dtype) -> _Exchange:  # fmt: skip
    """Send each shard of ``members`` (in ``dtype``) to its leaf's owner (one all-to-all over ``group``); the
    owner's ``mats`` entries become the whole leaves' matrices, the others' empty batches of that shape."""
    shapes = [tuple(inputs[i].shape) for i in members]
    wholes = [group.whole_shape(gs[i], s) for i, s in zip(members, shapes, strict=True)]
    like = [as_matrices(torch.empty(w, device="meta"), blocks_of[i], paths[i])
            for i, w in zip(members, wholes, strict=True)]  # fmt: skip
    owners = balance([newton_schulz_cost(m.shape) for m in like], group.world)
    x0 = inputs[members[0]]
    ex = _Exchange(group, members, owners, shapes, wholes, [tuple(m.shape[-2:]) for m in like],
                   torch.empty(0, dtype=dtype, device=x0.device))  # fmt: skip
    sends = [inputs[i].reshape(-1).to(dtype) for j in range(group.world) for k, i in enumerate(members)
             if owners[k] == j]  # fmt: skip
    per_owner, mine = ex.splits()
    buf = torch.cat(sends) if sends else torch.zeros(0, dtype=dtype, device=x0.device)
    got = C.all_to_all(buf, group.mesh, out_splits=mine, in_splits=per_owner)
    whole = {k: torch.empty(wholes[k], dtype=dtype, device=x0.device) for k in ex.mine}
    pieces = got.split([math.prod(shapes[k]) for _ in range(group.world) for k in ex.mine])
    for n, piece in enumerate(pieces):  # from member j, its shard of each leaf I own
        j, k = divmod(n, len(ex.mine))
        k = ex.mine[k]
        whole[k][group.piece(j, gs[members[k]], shapes[k])] = piece.view(shapes[k])
    for k, i in enumerate(members):
        mats[i] = (as_matrices(whole[k], blocks_of[i], paths[i]) if k in whole
                   else torch.zeros(0, *like[k].shape[-2:], dtype=dtype, device=x0.device))  # fmt: skip
    return ex


def mesh_muon(layout: Layout | None, lr: float | torch.Tensor | Schedule, weight_decay: float | torch.Tensor = 0.1,
              **kwargs: Any) -> Transform:  # fmt: skip
    """:func:`ftitan.optim.muon` over ``layout``'s DTensor params: distributed Newton-Schulz (see the module
    docstring), weight decay and learning rate on the local shards; the other keyword arguments are
    :func:`scale_by_mesh_muon`'s (``ft.optim.scale_by_muon``'s). Its state is ``ft.optim.muon``'s leaf for
    leaf (a checkpoint reads either)."""
    return muon_chain(scale_by_mesh_muon(layout, **kwargs), lr, weight_decay, elementwise=on_shards)


def mesh_muon_with_adamw(layout: Layout | None, params: Any = None, **kwargs: Any) -> Transform:
    """:func:`ftitan.optim.muon_with_adamw` over ``layout``'s DTensor params: :func:`mesh_muon` on the hidden
    matrices, AdamW on the rest (on the local shards: ``parallel.on_shards``); the same keyword arguments."""
    return _muon_with_adamw(params, muon_impl=functools.partial(mesh_muon, layout), adamw_impl=sharded_adamw,
                            **kwargs)  # fmt: skip


def sharded_adamw(*args: Any, **kwargs: Any) -> Transform:
    """:func:`ftitan.optim.adamw` on each DTensor's local shard (``parallel.on_shards``): elementwise, so the
    same numbers without DTensor's per-op dispatch."""
    return on_shards(adamw(*args, **kwargs))
