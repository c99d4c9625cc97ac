"""Params on a mesh: ``shard_params`` (a tree of DTensors), and the gathered view a step computes with.

Storage: every leaf is a ``DTensor`` with the placements its logical axes
resolve to (``rules.resolve``): split over ``tp`` / ``ep`` for compute and
over ``dp_shard`` for storage (FSDP). Compute: a parallel step works on the
local shards (``to_local``); :func:`gathered` is the params view the model
reads, which all-gathers each leaf over its data axes when the model first
touches it (layer by layer, as the forward walks the layers), with the
adjoint in backward: gradients are reduce-scattered over ``dp_shard`` and
all-reduced over the data axes the leaf is replicated on (DDP).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ftitan import tree
from ftitan.parallel import collectives as C
from ftitan.parallel.layout import Layout
from ftitan.parallel.rules import Rules, Sharding, check_sharded, local_slice, resolve

__all__ = ["from_local", "gathered", "shard_params", "to_local", "unshard"]

# axes a weight may be stored split over but is gathered on for compute (tp / ep stay split)
GATHERED_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp")


def shard_params(
    params: tree.Tree,
    axes: tree.Tree,
    rules: Rules,
    layout: Layout | DeviceMesh,
    *,
    check: bool = False,
    min_numel: int = 1 << 16,
) -> tree.Tree:
    """Every leaf as a ``DTensor`` placed by ``rules`` (built from this rank's blocks of the full,
    identical-on-every-rank ``params``; no communication), on ``layout.storage_mesh``: the mesh axes
    of size > 1, pp aside.

    ``check=True`` also runs the "insufficiently sharded" check
    (:func:`ftitan.parallel.check_sharded`) for leaves of ``min_numel`` or more.
    """
    if isinstance(layout, DeviceMesh):  # a mesh from parallel.mesh(...): placed by these rules
        layout = Layout(layout, rules)
    shardings = resolve(params, axes, rules, layout.mesh)
    if check:
        check_sharded(params, shardings, layout.mesh, min_numel=min_numel)

    def one(x: torch.Tensor, s: Sharding) -> DTensor:
        local = local_slice(x, s, layout.coords, layout.sizes).contiguous()
        placements = s.placements(layout.storage_axes)
        return DTensor.from_local(local, layout.storage_mesh, placements, run_check=False, shape=x.shape, stride=x.stride())

    return tree.map(one, params, shardings)


def to_local(params: tree.Tree) -> tree.Tree:
    """This rank's shards, as plain tensors (non-DTensor leaves pass through)."""
    return tree.map(lambda x: x.to_local() if isinstance(x, DTensor) else x, params)


def from_local(local: tree.Tree, like: tree.Tree) -> tree.Tree:
    """Local shards placed like the DTensors of ``like`` (same mesh, placements, global shape)."""

    def one(x: torch.Tensor, ref: Any) -> Any:
        if not isinstance(ref, DTensor):
            return x
        return DTensor.from_local(x, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride())

    return tree.map(one, local, like)


def unshard(params: tree.Tree) -> tree.Tree:
    """Full tensors on every rank (``DTensor.full_tensor``), e.g. to compare with a single-process run."""
    return tree.map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, params)


def gather_leaf(x: torch.Tensor, s: Sharding, layout: Layout) -> torch.Tensor:
    """The compute view of one local shard: gathered over its data axes (tp / ep stay split).

    Backward: reduce-scatter over the axes gathered here, all-reduce over the
    data axes the leaf is replicated on (cheapest order: the all-reduce runs on
    the shard, after the reduce-scatter).
    """
    stored = set(s.mesh_axes())
    for a in layout.data_axes():
        # a leaf split over ep (routed experts) gets its whole gradient back through EP's all-to-all
        if a not in stored:
            x = C.grad_all_reduce(x, layout.group(a))
    for a in reversed([a for a in s.mesh_axes() if a in GATHERED_AXES]):  # innermost split first
        x = C.all_gather(x, layout.group(a), dim=s.dim_of(a))
    return x


class _Gathered(Mapping[str, Any]):
    """Read-only params view that gathers a leaf the first time the model reads it."""

    def __init__(self, local: Mapping[str, Any], shardings: Mapping[str, Any], layout: Layout) -> None:
        self._local, self._shardings, self._layout = local, shardings, layout
        self._memo: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._memo:
            x, s = self._local[key], self._shardings[key]
            if isinstance(x, Mapping):
                self._memo[key] = _Gathered(x, s, self._layout)
            else:
                self._memo[key] = gather_leaf(x, s, self._layout) if isinstance(x, torch.Tensor) else x
        return self._memo[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._local)

    def __len__(self) -> int:
        return len(self._local)


def gathered(local: tree.Tree, shardings: tree.Tree, layout: Layout) -> Mapping[str, Any]:
    """The params view for compute: leaves gathered lazily, layer by layer, as the model reads them."""
    if not isinstance(local, Mapping):
        raise TypeError(f"gathered: params must be a dict tree, got {type(local).__name__}")
    return _Gathered(local, shardings, layout)
