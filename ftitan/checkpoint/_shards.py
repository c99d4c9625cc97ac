"""Which blocks of a tree this rank writes, and which block of each leaf it reads back.

A leaf is a ``DTensor`` under a parallel layout, or a plain tensor. A rank
writes a DTensor's local block when its mesh coordinate is 0 on every mesh
dim where that leaf is ``Replicate`` (so each block is written once, by the
first of the ranks that hold it); plain leaves (step, rng, counters, the
loader position) are the same on every rank and written by global rank 0.
Reading is the mirror image: a DTensor leaf of the tree to restore into
asks for its own block (any placements, any mesh: resharding), a plain leaf
for all of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ftitan import tree as ftree
from ftitan.checkpoint._manifest import Chunk, LeafSpec, spec_of

__all__ = ["Part", "SavePlan", "block_of", "plan_save"]

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


class Part:
    """A block of a global tensor that this rank holds outside DTensor's placements (FlexShard's ragged rows
    and owned matrices): ``local`` sits at ``offsets`` of a tensor of ``shape``; ``write`` says whether
    this rank writes it (one holder per block; an empty block is never written). As a leaf of a tree
    to restore into, a Part asks for the block at its ``offsets`` of its ``local``'s shape, whatever
    blocks the saving ranks held (resharding), and comes back as a Part holding it.
    ``ftitan.flexshard.Plan.parts`` / ``from_parts`` make and unmake them."""

    __slots__ = ("local", "offsets", "shape", "write")

    def __init__(self, local: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...], write: bool = True
                 ) -> None:  # fmt: skip
        if len(shape) != local.dim() or len(offsets) != local.dim() or any(
                o < 0 or o + n > s for o, n, s in zip(offsets, local.shape, shape, strict=True)):  # fmt: skip
            raise ValueError(f"Part: a block of shape {tuple(local.shape)} at {tuple(offsets)} is not inside a tensor "
                             f"of shape {tuple(shape)}")  # fmt: skip
        self.local, self.shape, self.offsets, self.write = local, tuple(shape), tuple(offsets), write

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def __repr__(self) -> str:
        return f"Part({tuple(self.local.shape)} at {self.offsets} of {self.shape}, write={self.write})"


class SavePlan(NamedTuple):
    """This rank's part of a save: the tensors it writes (key -> tensor), every leaf's spec with the
    chunks this rank writes of it, and the plain leaves' specs (every rank must agree on those)."""

    tensors: dict[str, torch.Tensor]
    leaves: tuple[LeafSpec, ...]
    plain: tuple[tuple[str, str, tuple[int, ...]], ...]  # (path, dtype, shape)


def _check_placements(path: str, x: DTensor) -> None:
    for p in x.placements:
        if type(p) not in (Shard, Replicate):
            fix = "x.redistribute(placements=...)" if not p.is_partial() else "reduce it first (x.redistribute)"
            raise ValueError(
                f"{path}: a DTensor placed {x.placements} has a {type(p).__name__} placement, which a checkpoint "
                f"cannot store as blocks; use Shard/Replicate placements: {fix}"
            )


def block_of(path: str, x: torch.Tensor) -> Block:
    """``(offsets, shape)`` of the block of ``x``'s global tensor this rank holds: a DTensor's local
    block (DTensor's chunking, uneven sizes included), a :class:`Part`'s, or all of a plain tensor."""
    if isinstance(x, Part):
        return x.offsets, tuple(x.local.shape)
    if isinstance(x, DTensor):
        _check_placements(path, x)
        shape, offsets = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
        return tuple(int(o) for o in offsets), tuple(int(n) for n in shape)
    return (0,) * x.dim(), tuple(x.shape)


def _writes(x: DTensor) -> bool:
    """Whether this rank is the first holder of its block: coordinate 0 on every Replicate mesh dim."""
    coords = x.device_mesh.get_coordinate()
    if coords is None:  # not on this DTensor's mesh
        return False
    return all(c == 0 for c, p in zip(coords, x.placements, strict=True) if isinstance(p, Replicate))


def _standalone(x: torch.Tensor, seen: set[int]) -> torch.Tensor:
    # safetensors refuses tensors that share storage (views, tied weights) and wants them contiguous;
    # copy only those
    if not x.is_contiguous():
        x = x.contiguous()
    ptr = x.untyped_storage().data_ptr()
    if ptr in seen and x.untyped_storage().nbytes() > 0:
        x = x.clone()
        ptr = x.untyped_storage().data_ptr()
    seen.add(ptr)
    return x


def plan_save(tree: Any, *, rank: int, file: str) -> SavePlan:
    """What this rank (global ``rank``) writes of ``tree`` into its tensor ``file``: tensors keyed by
    their dotted path (a rank holds one block per leaf)."""
    paths, leaves, _ = ftree.flatten_with_paths(tree)
    tensors: dict[str, torch.Tensor] = {}
    specs: list[LeafSpec] = []
    plain: list[tuple[str, str, tuple[int, ...]]] = []
    seen: set[str] = set()
    storages: set[int] = set()
    for path, x in zip(paths, leaves, strict=True):
        if not isinstance(x, (torch.Tensor, Part)):
            raise TypeError(
                f"{path}: leaf is a {type(x).__name__}, not a tensor; a checkpoint stores tensors only. "
                "Make it a 0-d tensor, or pass it through save(..., extra={...})"
            )
        if path in seen:
            raise ValueError(
                f"{path}: two leaves share this dotted path (a dict key containing '.'?); "
                "rename the keys so that paths are unique"
            )
        seen.add(path)
        local = x.local if isinstance(x, Part) else x.to_local() if isinstance(x, DTensor) else x
        if local.device.type == "meta":
            raise ValueError(f"{path}: a meta tensor has no data to save; materialize the tree first")
        offsets, shape = block_of(path, x)
        spec = spec_of(path, x)
        if isinstance(x, Part):
            mine = x.write and local.numel() > 0
        elif isinstance(x, DTensor):
            mine = _writes(x)
        else:
            plain.append((path, spec.dtype, spec.shape))
            mine = rank == 0
        if mine:
            tensors[path] = _standalone(local.detach(), storages)
            spec = LeafSpec(path=path, dtype=spec.dtype, shape=spec.shape,
                            chunks=(Chunk(file=file, key=path, offsets=offsets, shape=shape),))  # fmt: skip
        specs.append(spec)
    return SavePlan(tensors, tuple(specs), tuple(plain))
