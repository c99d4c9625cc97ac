"""MoE token permutation: dispatch (token rows -> expert-sorted rows) and combine (back, weighted).

A mixture-of-experts layer sends each token's row to its ``k`` chosen
experts, runs every expert on one contiguous block of rows (the grouped
GEMM), and sums the ``k`` outputs back into the token, weighted by the
router (Switch Transformer, Fedus et al. 2021; the "permute / unpermute"
of Megablocks, Gale et al. 2022). Both moves are described by one index,
``pos`` (N, k): the row of the expert-sorted buffer that holds token ``n``'s
``j``-th choice (``-1``: the pair goes nowhere, e.g. an expert on another
expert-parallel rank).

- :func:`sort_by_expert` computes ``pos`` and the group ends ``offs`` on the
  device, without a host synchronization: counts by a histogram
  (``index_add`` of ones), offsets by ``cumsum``, positions by a stable
  ``argsort`` of the expert ids (so a group keeps its tokens' order).
- :func:`dispatch`: ``out[pos[n, j]] = x[n]`` into ``n_rows`` rows; rows no
  pair addresses are zero. Its adjoint is a combine without weights.
- :func:`combine`: ``out[n] = sum_j w[n, j] * y[pos[n, j]]`` (fp32
  accumulation; ``pos = -1`` adds nothing, and such rows of ``y`` are never
  read, so padding rows may hold anything). Its adjoint is a weighted
  dispatch of the gradient plus ``dw[n, j] = <g[n], y[pos[n, j]]>``.

Each has a Triton kernel (one program per token and column block; no
atomics: every written row has one writer, so results are deterministic)
and a pure-torch reference, the readable definition that runs on the CPU
and under ``torch.func`` transforms (``ftitan.kernels.op``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ftitan.kernels import op

__all__ = [
    "Permutation",
    "combine",
    "combine_reference",
    "dispatch",
    "dispatch_reference",
    "sort_by_expert",
]


class Permutation(NamedTuple):
    pos: torch.Tensor  # (N, k) int64: row of the sorted buffer holding (token n, choice j); -1: none
    offs: torch.Tensor  # (E,) int32: cumulative row ends of the experts' blocks
    counts: torch.Tensor  # (E,) fp32: rows per expert


def sort_by_expert(experts: torch.Tensor, n_experts: int) -> Permutation:
    """``experts`` (N, k) int ids in ``[0, n_experts)`` (anything else, e.g. ``-1``, is dropped: ``pos = -1``)
    -> :class:`Permutation` of the rows sorted by expert (stable), computed on the device (no sync)."""
    flat = experts.reshape(-1)  # (N*k,)
    valid = (flat >= 0) & (flat < n_experts)
    key = torch.where(valid, flat, n_experts)  # dropped pairs sort last, past every expert's block
    order = torch.argsort(key, stable=True)  # sorted row i holds pair order[i]
    ones = torch.ones_like(key, dtype=torch.float32)
    counts = torch.zeros(n_experts + 1, dtype=torch.float32, device=flat.device).index_add(0, key, ones)[:-1]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = torch.arange(flat.numel(), device=flat.device)
    pos = torch.empty_like(order).scatter(0, order, rows)  # out of place: vmap has no in-place rule here
    return Permutation(torch.where(valid, pos, -1).view(experts.shape), offs, counts)


# ---------------------------------------------------------------- references (plain differentiable ops)


def dispatch_reference(x: torch.Tensor, pos: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``out[pos[n, j]] = x[n]``: (N, D), (N, k) -> (n_rows, D); unaddressed rows are zero."""
    n, k = pos.shape
    flat = pos.reshape(-1)
    target = torch.where(flat >= 0, flat, n_rows)  # dropped pairs land on a spare row, cut off below
    token = torch.arange(n * k, device=pos.device) // k
    source = torch.full((n_rows + 1,), n, dtype=torch.long, device=pos.device).scatter(0, target, token)
    return F.pad(x, (0, 0, 0, 1))[source[:n_rows]]  # row n of the padded x is zero


def combine_reference(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``out[n] = sum_j w[n, j] * y[pos[n, j]]`` (``w = 1`` without weights): (M, D), (N, k) -> (N, D).
    Pairs with ``pos = -1`` read a zero row: padding rows of ``y`` are never read."""
    rows = F.pad(y, (0, 0, 0, 1))[torch.where(pos >= 0, pos, y.shape[0])]  # (N, k, D)
    if weights is not None:
        rows = rows * weights.unsqueeze(-1)
    return rows.sum(1)


# ---------------------------------------------------------------- Triton kernels


@triton.jit
def _dispatch_kernel(x_ptr, pos_ptr, out_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    row = tl.load(x_ptr + n.to(tl.int64) * D + cols, mask=cmask, other=0.0)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + n * K + j) + 0 * cols  # (BLOCK_D,): the interpreter wants vector masks
        tl.store(out_ptr + p * D + cols, row, mask=cmask & (p >= 0))


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, D, K: tl.constexpr, HAS_W: tl.constexpr,
                    BLOCK_D: tl.constexpr):  # fmt: skip
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + n * K + j) + 0 * cols
        row = tl.load(y_ptr + p * D + cols, mask=cmask & (p >= 0), other=0.0).to(tl.float32)
        if HAS_W:
            row = row * tl.load(w_ptr + n * K + j).to(tl.float32)
        acc += row
    tl.store(out_ptr + n.to(tl.int64) * D + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _combine_bwd_kernel(g_ptr, y_ptr, pos_ptr, w_ptr, gy_ptr, gw_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per token n: gy[pos[n, j]] = w[n, j] g[n]; gw[n, j] = <g[n], y[pos[n, j]]> (whole rows: a loop over D)."""
    n = tl.program_id(0)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + n * K + j)
        w = tl.load(w_ptr + n * K + j).to(tl.float32)
        dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            mask = (cols < D) & (p + 0 * cols >= 0)
            g = tl.load(g_ptr + n.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + p * D + cols, mask=mask, other=0.0).to(tl.float32)
            dot += g * y
            tl.store(gy_ptr + p * D + cols, (w * g).to(gy_ptr.dtype.element_ty), mask=mask)
        tl.store(gw_ptr + n * K + j, tl.sum(dot, axis=0).to(gw_ptr.dtype.element_ty))


def _block(d: int) -> int:
    return min(1024, triton.next_power_of_2(max(d, 16)))


# ---------------------------------------------------------------- ops (launches + fakes)


def _dispatch_impl(x: torch.Tensor, pos: torch.Tensor, n_rows: int) -> torch.Tensor:
    x, pos = x.contiguous(), pos.contiguous()
    out = x.new_zeros(n_rows, x.shape[1])
    n, k = pos.shape
    if n and x.shape[1]:
        block = _block(x.shape[1])
        _dispatch_kernel[(n, triton.cdiv(x.shape[1], block))](x, pos, out, x.shape[1], K=k, BLOCK_D=block)
    return out


def _dispatch_fake(x: torch.Tensor, pos: torch.Tensor, n_rows: int) -> torch.Tensor:
    return x.new_empty(n_rows, x.shape[1])


def _combine_impl(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    y, pos = y.contiguous(), pos.contiguous()
    n, k = pos.shape
    out = y.new_empty(n, y.shape[1])
    if n and y.shape[1]:
        block = _block(y.shape[1])
        w = pos if weights is None else weights.contiguous()  # an unread placeholder without weights
        _combine_kernel[(n, triton.cdiv(y.shape[1], block))](y, pos, w, out, y.shape[1], K=k,
                                                             HAS_W=weights is not None, BLOCK_D=block)  # fmt: skip
    return out


def _combine_fake(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return y.new_empty(pos.shape[0], y.shape[1])


def _combine_bwd_impl(g: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor):
    g, y, pos, weights = g.contiguous(), y.contiguous(), pos.contiguous(), weights.contiguous()
    gy, gw = torch.zeros_like(y), torch.empty_like(weights)
    n, k = pos.shape
    if n:
        _combine_bwd_kernel[(n,)](g, y, pos, weights, gy, gw, y.shape[1], K=k, BLOCK_D=_block(y.shape[1]))
    return gy, gw


def _combine_bwd_fake(g: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor):
    return torch.empty_like(y), torch.empty_like(weights)


_dispatch_op = op.define("permute_dispatch", "(Tensor x, Tensor pos, SymInt n_rows) -> Tensor",
                         _dispatch_impl, _dispatch_fake)  # fmt: skip
_combine_op = op.define("permute_combine", "(Tensor y, Tensor pos, Tensor? weights) -> Tensor",
                        _combine_impl, _combine_fake)  # fmt: skip
_combine_bwd_op = op.define("permute_combine_bwd",
                            "(Tensor g, Tensor y, Tensor pos, Tensor weights) -> (Tensor, Tensor)",
                            _combine_bwd_impl, _combine_bwd_fake)  # fmt: skip


# ---------------------------------------------------------------- autograd (the ops, never the reference)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, pos: torch.Tensor, n_rows: int) -> torch.Tensor:  # type: ignore[override]
        return _dispatch_op(x, pos, n_rows)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (pos,) = ctx.saved_tensors
        return _combine_op(g, pos, None), None, None  # the adjoint: a combine without weights


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]  # noqa: E501
        return _combine_op(y, pos, weights)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        y, pos, weights = inputs
        ctx.n_rows = y.shape[0]
        ctx.save_for_backward(y, pos, weights)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        y, pos, weights = ctx.saved_tensors
        if weights is None:  # the adjoint: a dispatch
            return _dispatch_op(g, pos, ctx.n_rows), None, None
        gy, gw = _combine_bwd_op(g, y, pos, weights)
        return gy, None, gw


# ---------------------------------------------------------------- public


def dispatch(
    x: torch.Tensor,  # (N, D) token rows
    pos: torch.Tensor,  # (N, k) int64 target rows (sort_by_expert), -1: dropped
    n_rows: int,  # rows of the sorted buffer (N * k, or more: padding)
) -> torch.Tensor:  # (n_rows, D)
    """Copy token ``n`` to rows ``pos[n, :]`` of an ``n_rows``-row buffer (others zero); see the module doc."""
    if op.use_kernel(x, pos):
        return _Dispatch.apply(x, pos, n_rows)
    return dispatch_reference(x, pos, n_rows)


def combine(
    y: torch.Tensor,  # (M, D) expert-sorted rows
    pos: torch.Tensor,  # (N, k) int64 rows of each token's choices, -1: none
    weights: torch.Tensor | None = None,  # (N, k) routing weights (1 without)
) -> torch.Tensor:  # (N, D)
    """``out[n] = sum_j weights[n, j] * y[pos[n, j]]``; see the module doc."""
    if op.use_kernel(y, pos):
        return _Combine.apply(y, pos, weights)
    return combine_reference(y, pos, weights)
