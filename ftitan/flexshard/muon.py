"""Distributed Muon over FlexShard state: each rank orthogonalizes only what it holds whole.

The state is the plan's local parts (``Plan.shard``). Per leaf, by placement:

- ``Owned``: the owner holds the whole tensor and runs Newton-Schulz on it; the other ranks hold nothing
  and compute nothing. No communication: the gradient arrived by the bucket's reduce-scatter.
- ``BlockShard(dim, size)`` with ``blocks`` giving that leaf the same blocks (per head), or over a batch
  dim of a stack (per expert), and ``Shard`` over a batch dim: each rank's blocks are whole matrices,
  orthogonalized where they are.
- ``Replicate``: every rank holds it, and computes it (the same on every rank).
- ``Shard`` over a matrix dim (rows of a matrix split): the rank cannot orthogonalize a part, so the
  Newton-Schulz input is all-gathered and every rank orthogonalizes the whole matrix, keeping its rows:
  what FSDP-only Muon does for every matrix (the benchmark's baseline).

Momentum, weight decay and the learning rate are elementwise, on the parts. The results equal
:func:`ftitan.optim.muon` with the same ``blocks`` on the full params (same matrices, same batches by
shape on each rank).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ftitan import tree
from ftitan.flexshard.plan import BlockShard, Owned, Plan, Replicate, Shard
from ftitan.optim.muon import (
    Blocks,
    DEFAULT_COEFFICIENTS,
    MuonState,
    NesterovStyle,
    ShapeScaling,
    as_matrices,
    block_of,
    check_arguments,
    init_state,
    momentum_step,
    muon_chain,
    orthogonalize,
    scaled_update,
)
from ftitan.optim.muon_adamw import muon_with_adamw as _muon_with_adamw
from ftitan.optim.schedules import Schedule
from ftitan.optim.transform import Transform, Updates

__all__ = ["local_kind", "muon", "muon_with_adamw", "scale_by_muon"]


def local_kind(plan: Plan, path: str, blocks: Blocks | None) -> str:
    """How a rank orthogonalizes leaf ``path``: ``"local"`` (its part is whole matrices, or nothing: Owned,
    Replicate, whole blocks) or ``"gather"`` (a part of a matrix: the whole one is gathered)."""
    lp = plan.leaves[path]
    p, nd = lp.placement, len(lp.shape)
    if isinstance(p, (Owned, Replicate)) or not lp.shape:
        return "local"
    dim = lp.dim
    if dim < nd - 2:  # split over a batch dim (experts of a stack): whole matrices
        return "local"
    block = block_of(path, blocks)
    if isinstance(p, BlockShard) and block is not None and block[0] % nd == dim and p.block_size % block[1] == 0:
        return "local"  # whole blocks per rank, orthogonalized per block anyway
    assert isinstance(p, (Shard, BlockShard))
    return "gather"


def scale_by_muon(
    plan: Plan,
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
    """:func:`ftitan.optim.scale_by_muon` over ``plan``'s local parts (see the module docstring)."""
    check_arguments(momentum, nesterov_style, shape_scaling)

    def init(params: Any) -> MuonState:
        return init_state(params, nesterov_style, fix="flexshard.muon_with_adamw")

    def update(grads: Updates, state: MuonState, params: Any = None) -> tuple[Updates, MuonState]:
        del params
        paths, gs, treedef = tree.flatten_with_paths(grads)
        count = None if state.count is None else state.count + 1
        new_bufs, inputs = momentum_step(gs, tree.leaves(state.momentum), momentum, nesterov, nesterov_style, count)
        mats, kinds = [], []
        for path, x in zip(paths, inputs, strict=True):
            kind = local_kind(plan, path, blocks)
            whole = plan.gather_leaf(x, path) if kind == "gather" else x
            block = block_of(path, blocks)
            full = plan.leaves[path].shape
            m, n = as_matrices(torch.empty(full, device="meta"), block, path).shape[-2:]
            mats.append(as_matrices(whole, block, path) if whole.numel() else whole.new_zeros(0, m, n))
            kinds.append((kind, block, whole.shape))
        ortho = orthogonalize(mats, steps=ns_steps, coefficients=coefficients, eps=eps, dtype=ns_dtype)
        outputs = []
        for path, o, g, (kind, block, shape) in zip(paths, ortho, gs, kinds, strict=True):
            if not g.numel():
                outputs.append(torch.zeros_like(g))
                continue
            u = scaled_update(o, g.dtype, shape, block, shape_scaling)
            if kind == "gather":  # this rank's rows of the whole matrix's update
                lp = plan.leaves[path]
                lo, hi = lp.rows[plan.rank]
                u = u.narrow(lp.dim, lo, hi - lo).contiguous()
            outputs.append(u)
        new_state = MuonState(momentum=tree.unflatten(tree.structure(state.momentum), new_bufs), count=count)
        return tree.unflatten(treedef, outputs), new_state

    return Transform(init, update)


def muon(plan: Plan, lr: float | torch.Tensor | Schedule, weight_decay: float | torch.Tensor = 0.1,
         **kwargs: Any) -> Transform:  # fmt: skip
    """:func:`ftitan.optim.muon` over ``plan``'s local parts: distributed Newton-Schulz, elementwise rest; the
    other keyword arguments are :func:`scale_by_muon`'s (``ft.optim.scale_by_muon``'s)."""
    return muon_chain(scale_by_muon(plan, **kwargs), lr, weight_decay)


def muon_with_adamw(plan: Plan, params: Any = None, **kwargs: Any) -> Transform:
    """:func:`ftitan.optim.muon_with_adamw` over ``plan``'s local parts: distributed Muon on the hidden
    matrices, AdamW (elementwise) on the parts of the rest; the same keyword arguments."""
    return _muon_with_adamw(params, muon_impl=functools.partial(muon, plan), **kwargs)
