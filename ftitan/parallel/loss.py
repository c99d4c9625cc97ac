"""Vocab-parallel cross-entropy: the output head stays split over ``tp``; no rank holds all logits
(nor the whole head).

Under tensor parallelism the head ``w`` (V, D) is split along the vocab, and
the hidden states ``h`` are whole on every tp rank. Each rank computes the
logits of its vocab slice one chunk of tokens at a time; the log-sum-exp
and the target logit come from two small all-reduces per chunk (a max, then
a sum), so every tp rank gets the full cross-entropy value.

Gradients (formed in forward, chunk by chunk, like
``ftitan.train.losses.chunked_cross_entropy``): rank ``r``'s logits get
``G (softmax - onehot)`` restricted to its slice, where ``G`` is the sum of
every tp rank's incoming gradient (each rank's loss value depends on every
slice: the adjoint of the all-reduced value), so ``w``'s gradient is exact
on each rank and ``h``'s is this slice's part, summed over tp by the
``column_input`` seam the hidden states came through.
"""

from __future__ import annotations

from typing import Any

import torch

from ftitan.parallel import collectives as C
from ftitan.parallel.layout import Layout

__all__ = ["vocab_parallel_cross_entropy"]


def _chunk(hc: torch.Tensor, w32: torch.Tensor, tc: torch.Tensor, start: int, group: Any, ignore_index: int,
           cap: float | None):  # fmt: skip
    z = hc.float() @ w32.T  # (C, V_local)
    th = None
    if cap is not None:  # the soft-capped logits (ftitan.models.base.soft_cap), elementwise on each slice
        th = torch.tanh(z / cap)
        z = cap * th
    m = C.all_reduce_value(z.max(-1).values, group, op="max")  # (C,)
    e = torch.exp(z - m[:, None])
    s = C.all_reduce_value(e.sum(-1), group)  # (C,)
    lse = m + torch.log(s)
    valid = tc != ignore_index
    local = tc - start
    mine = valid & (local >= 0) & (local < w32.shape[0])
    safe = torch.where(mine, local, torch.zeros_like(local))
    picked = torch.where(mine, z.gather(1, safe[:, None]).squeeze(1), torch.zeros_like(lse))
    target_logit = C.all_reduce_value(picked, group)  # (C,)
    loss = torch.where(valid, lse - target_logit, torch.zeros_like(lse)).sum()
    dz = e.div_(s[:, None])  # softmax of this slice, in place
    # minus one at the target, for rows whose target is in this slice (others add 0: static shapes, compiles)
    dz.scatter_add_(1, safe[:, None], -mine.to(dz.dtype)[:, None])
    if th is not None:  # through the soft-cap: 1 - tanh^2
        dz.mul_(th.square_().neg_().add_(1))
    return loss, dz, valid


class _VocabParallelCE(torch.autograd.Function):
    """Sum over valid tokens of the cross-entropy of ``h @ w.T`` with ``w`` this rank's vocab slice."""

    @staticmethod
    def forward(h, w, targets, start: int, group: Any, chunk_size: int, ignore_index: int,  # type: ignore[override]
                cap: float | None):  # fmt: skip
        w32 = w.float()
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(w32)
        for i in range(0, h.shape[0], chunk_size):
            hc, tc = h[i : i + chunk_size], targets[i : i + chunk_size]
            loss, dz, valid = _chunk(hc, w32, tc, start, group, ignore_index, cap)
            total = total + loss
            keep = valid[:, None].to(torch.float32)
            grad_h[i : i + chunk_size] = ((dz @ w32) * keep).to(h.dtype)
            grad_w += dz.T @ (hc.float() * keep)
        return total, grad_h, grad_w.to(w.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        _total, grad_h, grad_w = output
        ctx.mark_non_differentiable(grad_h, grad_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.group = inputs[4]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _gh: Any, _gw: Any):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        total = C.all_reduce_value(g, ctx.group)  # every tp rank's loss depends on this slice
        return grad_h * total.to(grad_h.dtype), grad_w * total.to(grad_w.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    h: torch.Tensor,  # (N, D) final hidden states, whole on every tp rank
    w: torch.Tensor,  # (V / tp, D) this rank's slice of the head
    targets: torch.Tensor,  # (N,) int64, ignore_index where no loss
    layout: Layout,
    *,
    chunk_size: int,
    ignore_index: int,
    reduction: str,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """The cross-entropy of ``h @ w_full.T`` (the same value on every tp rank) from this rank's slice.

    Called by ``ftitan.train.losses.cross_entropy`` when the layout splits ``vocab``. ``logit_softcap``:
    the logits are ``cap * tanh(h @ w_full.T / cap)`` (elementwise, so each slice caps its own).
    """
    axes = layout.axes_of("vocab")
    if axes != ("tp",):
        raise NotImplementedError(f"vocab-parallel cross-entropy: vocab split over {axes}; only ('tp',) is supported")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use 'mean' or 'sum'")
    start = layout.coords["tp"] * w.shape[0]
    total, _, _ = _VocabParallelCE.apply(h, w, targets, start, layout.group("tp"), chunk_size, ignore_index,
                                         logit_softcap)  # fmt: skip
    if reduction == "sum":
        return total
    return total / (targets != ignore_index).sum().clamp(min=1)
