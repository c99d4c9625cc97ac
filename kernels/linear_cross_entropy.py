"""Fused linear + cross-entropy as Triton kernels (``ftitan.kernels.linear_cross_entropy``).

The loss of the output head: ``sum over valid rows i of CE(soft_cap(h @ w.T)[i], t[i])``
(``ignore_index`` rows give nothing; ``soft_cap(z) = cap * tanh(z / cap)``, Gemma 2's logit
soft-cap, or none), with float32 logits and accumulation, without ever holding a
``(tokens, vocab)`` block larger than one ``(BLOCK_N, BLOCK_V)`` tile, forward *and*
backward (the tiled, recomputing approach of Cut Cross-Entropy, Wijmans et al. 2024,
"Cut Your Losses in Large-Vocabulary Language Models"):

- **forward** (one program per block of ``BLOCK_N`` rows): walks the vocab in
  ``BLOCK_V`` tiles, each tile's logits a ``BLOCK_D``-stepped ``tl.dot`` over the hidden
  dim, keeping an online max and sum of exponentials (the rows' logsumexp) and picking
  the target's logit. It writes each row's ``lse`` and loss (``lse - z_t``; 0 when
  ignored); the sum over rows is a torch ``sum`` (deterministic).
- **backward** recomputes the logits tile by tile from ``h``, ``w`` and the saved
  ``lse`` and forms ``d_logits = g * (softmax - onehot) * (1 - tanh^2)`` (the soft-cap's
  chain factor) per tile. Two kernels, both *deterministic* (no atomics: every output
  element has one program, which adds its terms in a fixed order): ``dh`` with one
  program per row block looping over the vocab tiles, ``dW`` with one program per vocab
  tile looping over the row blocks. Each program accumulates its own float32 rows of
  ``dh`` / ``dW`` in global memory ``BLOCK_D`` columns at a time (a barrier per tile
  orders the read-modify-writes), so nothing of size ``D`` sits in registers. The price
  of determinism: the logits are recomputed twice (4 GEMM-sized passes instead of 3).

Precision: the logits' ``tl.dot`` runs in IEEE float32 for float32 inputs (not TF32)
and on the bf16 / fp16 values with float32 accumulation for those (as the reference's
float32 upcast: the products are exact); ``d_logits`` enters the gradient GEMMs in the
inputs' dtype (float32: exact; bf16: rounded to bf16, within the bf16 gradient's own
rounding). ``tanh`` is written with ``exp`` (Triton's interpreter has no libdevice):
an odd polynomial near 0, ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` elsewhere.

:func:`linear_cross_entropy_reference` (``F.cross_entropy`` of the float32 logits, summed)
is the definition; ``ftitan.train.losses.chunked_cross_entropy`` dispatches here for a
``kernels="triton"`` model where :func:`ftitan.kernels.op.use_kernel` holds.
Targets outside ``[0, V)`` other than ``ignore_index`` are not checked (that would
synchronize with the host): their target logit reads as 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ftitan.kernels import op

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "supported"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TILES = (64, 128, 64)  # (BLOCK_N, BLOCK_V, BLOCK_D) on a GPU; each >= 16 (tl.dot's smallest)


@triton.jit
def _tanh(x):
    a = tl.abs(x)
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.125, small, tl.where(x < 0, -big, big))


@triton.jit
def _logits(h_ptr, w_ptr, rows, cols, N, V, D, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
            BLOCK_D: tl.constexpr, CAP: tl.constexpr, cap, F32_DOT: tl.constexpr):  # fmt: skip
    """The (BLOCK_N, BLOCK_V) float32 logits tile of ``rows`` x ``cols`` (soft-capped when CAP) and
    ``tanh(z / cap)`` (the chain factor's; zeros without CAP). F32_DOT: bf16 / fp16 tiles upcast before
    ``tl.dot`` (the same exact products; the interpreter's bf16 ``tl.dot`` reads the raw bits)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    hr, wr = rows.to(tl.int64)[:, None] * D, cols.to(tl.int64)[:, None] * D
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        hb = tl.load(h_ptr + hr + d[None, :], mask=(rows[:, None] < N) & (d[None, :] < D), other=0.0)
        wb = tl.load(w_ptr + wr + d[None, :], mask=(cols[:, None] < V) & (d[None, :] < D), other=0.0)
        if F32_DOT:
            hb, wb = hb.to(tl.float32), wb.to(tl.float32)
        acc = tl.dot(hb, tl.trans(wb), acc, input_precision="ieee")
    th = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if CAP:
        th = _tanh(acc / cap)
        acc = cap * th
    return acc, th


@triton.jit
def _lce_fwd(h_ptr, w_ptr, t_ptr, lse_ptr, loss_ptr, N, V, D, ignore_index, cap, CAP: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.load(t_ptr + rows, mask=rows < N, other=ignore_index)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)  # running max
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)  # running sum of exp(z - m)
    zt = tl.zeros((BLOCK_N,), dtype=tl.float32)  # the target's logit
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z, _th = _logits(h_ptr, w_ptr, rows, cols, N, V, D, BLOCK_N, BLOCK_V, BLOCK_D, CAP, cap, F32_DOT)
        z = tl.where(cols[None, :] < V, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
        zt += tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), axis=1)
    lse = m + tl.log(s)
    valid = (t != ignore_index) & (rows < N)
    tl.store(lse_ptr + rows, lse, mask=rows < N)
    tl.store(loss_ptr + rows, tl.where(valid, lse - zt, 0.0), mask=rows < N)


@triton.jit
def _dlogits(h_ptr, w_ptr, t_ptr, lse_ptr, g, rows, cols, N, V, D, ignore_index, cap, CAP: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr):  # fmt: skip
    """``g * (softmax - onehot) * chain`` of a (BLOCK_N, BLOCK_V) tile, zero in ignored rows and past V."""
    t = tl.load(t_ptr + rows, mask=rows < N, other=ignore_index)
    lse = tl.load(lse_ptr + rows, mask=rows < N, other=0.0)
    coef = tl.where((t != ignore_index) & (rows < N), g, 0.0)
    z, th = _logits(h_ptr, w_ptr, rows, cols, N, V, D, BLOCK_N, BLOCK_V, BLOCK_D, CAP, cap, F32_DOT)
    p = tl.where(cols[None, :] < V, tl.exp(z - lse[:, None]), 0.0)
    dz = (p - (cols[None, :] == t[:, None]).to(tl.float32)) * coef[:, None]
    if CAP:
        dz = dz * (1.0 - th * th)
    return dz


@triton.jit
def _lce_bwd_dh(h_ptr, w_ptr, t_ptr, lse_ptr, g_ptr, dh_ptr, N, V, D, ignore_index, cap,
                CAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                F32_DOT: tl.constexpr):  # fmt: skip
    # dh: (N, D) float32 zeros; this program owns rows [pid * BLOCK_N, +BLOCK_N)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.load(g_ptr)
    hr = rows.to(tl.int64)[:, None] * D
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        dz = _dlogits(h_ptr, w_ptr, t_ptr, lse_ptr, g, rows, cols, N, V, D, ignore_index, cap, CAP, BLOCK_N,
                      BLOCK_V, BLOCK_D, F32_DOT).to(w_ptr.dtype.element_ty)  # fmt: skip
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            wb = tl.load(w_ptr + cols.to(tl.int64)[:, None] * D + d[None, :],
                         mask=(cols[:, None] < V) & (d[None, :] < D), other=0.0)  # fmt: skip
            mask = (rows[:, None] < N) & (d[None, :] < D)
            acc = tl.load(dh_ptr + hr + d[None, :], mask=mask, other=0.0)
            if F32_DOT:
                wb = wb.to(tl.float32)
            acc = tl.dot(dz.to(wb.dtype), wb, acc, input_precision="ieee")
            tl.store(dh_ptr + hr + d[None, :], acc, mask=mask)
        tl.debug_barrier()


@triton.jit
def _lce_bwd_dw(h_ptr, w_ptr, t_ptr, lse_ptr, g_ptr, dw_ptr, N, V, D, ignore_index, cap,
                CAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                F32_DOT: tl.constexpr):  # fmt: skip
    # dw: (V, D) float32 zeros; this program owns vocab rows [pid * BLOCK_V, +BLOCK_V)
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    g = tl.load(g_ptr)
    wr = cols.to(tl.int64)[:, None] * D
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        dz = _dlogits(h_ptr, w_ptr, t_ptr, lse_ptr, g, rows, cols, N, V, D, ignore_index, cap, CAP, BLOCK_N,
                      BLOCK_V, BLOCK_D, F32_DOT).to(h_ptr.dtype.element_ty)  # fmt: skip
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            hb = tl.load(h_ptr + rows.to(tl.int64)[:, None] * D + d[None, :],
                         mask=(rows[:, None] < N) & (d[None, :] < D), other=0.0)  # fmt: skip
            mask = (cols[:, None] < V) & (d[None, :] < D)
            acc = tl.load(dw_ptr + wr + d[None, :], mask=mask, other=0.0)
            if F32_DOT:
                hb = hb.to(tl.float32)
            acc = tl.dot(tl.trans(dz.to(hb.dtype)), hb, acc, input_precision="ieee")
            tl.store(dw_ptr + wr + d[None, :], acc, mask=mask)
        tl.debug_barrier()


def _launch_args(h: torch.Tensor, w: torch.Tensor, ignore_index: int, cap: float, tiles: tuple[int, int, int]):
    bn, bv, bd = tiles
    sizes = dict(N=h.shape[0], V=w.shape[0], D=h.shape[1], ignore_index=ignore_index, cap=cap or 1.0)
    return sizes, dict(CAP=cap > 0, BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, F32_DOT=not h.is_cuda)


def _fwd_impl(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore_index: int, cap: float, block_n: int,
              block_v: int, block_d: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    h, w, targets = h.contiguous(), w.contiguous(), targets.contiguous()
    lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    loss = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    if h.shape[0]:
        sizes, meta = _launch_args(h, w, ignore_index, cap, (block_n, block_v, block_d))
        _lce_fwd[(triton.cdiv(h.shape[0], block_n),)](h, w, targets, lse, loss, **sizes, **meta)
    return lse, loss


def _fwd_fake(h, w, targets, ignore_index, cap, block_n, block_v, block_d):  # type: ignore[no-untyped-def]
    return h.new_empty(h.shape[0], dtype=torch.float32), h.new_empty(h.shape[0], dtype=torch.float32)


def _bwd_impl(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
              ignore_index: int, cap: float, block_n: int, block_v: int, block_d: int, need_dh: bool,
              need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    # dh (N, D) and dw (V, D) in h's / w's dtypes; an unneeded one is empty (0,) and not computed
    h, w, targets = h.contiguous(), w.contiguous(), targets.contiguous()
    g = g.to(torch.float32).reshape(1).contiguous()
    dh = torch.zeros(h.shape if need_dh else (0,), dtype=torch.float32, device=h.device)
    dw = torch.zeros(w.shape if need_dw else (0,), dtype=torch.float32, device=w.device)
    if h.shape[0]:
        sizes, meta = _launch_args(h, w, ignore_index, cap, (block_n, block_v, block_d))
        args = (h, w, targets, lse.contiguous(), g)
        if need_dh:
            _lce_bwd_dh[(triton.cdiv(h.shape[0], block_n),)](*args, dh, **sizes, **meta)
        if need_dw:
            _lce_bwd_dw[(triton.cdiv(w.shape[0], block_v),)](*args, dw, **sizes, **meta)
    return dh.to(h.dtype), dw.to(w.dtype)


def _bwd_fake(h, w, targets, lse, g, ignore_index, cap, block_n, block_v, block_d,  # type: ignore[no-untyped-def]
              need_dh, need_dw):  # fmt: skip
    return h.new_empty(h.shape if need_dh else (0,)), w.new_empty(w.shape if need_dw else (0,))


_SIZES = "int ignore_index, float cap, int block_n, int block_v, int block_d"
fwd_op = op.define("linear_cross_entropy_fwd", f"(Tensor h, Tensor w, Tensor targets, {_SIZES}) -> (Tensor, Tensor)",
                   _fwd_impl, _fwd_fake)  # fmt: skip
bwd_op = op.define("linear_cross_entropy_bwd",
                   f"(Tensor h, Tensor w, Tensor targets, Tensor lse, Tensor g, {_SIZES}, bool need_dh, "
                   "bool need_dw) -> (Tensor, Tensor)",
                   _bwd_impl, _bwd_fake)  # fmt: skip


class _LinearCrossEntropy(torch.autograd.Function):
    """The summed loss by :data:`fwd_op` (also returning the rows' logsumexp, saved), gradients by :data:`bwd_op`."""

    @staticmethod
    def forward(h, w, targets, ignore_index: int, cap: float, tiles: tuple[int, int, int]):  # type: ignore[override]
        lse, loss = fwd_op(h, w, targets, ignore_index, cap, *tiles)
        return loss.sum(), lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        h, w, targets, ctx.ignore_index, ctx.cap, ctx.tiles = inputs
        _total, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(h, w, targets, lse)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _glse: Any):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(
                "linear_cross_entropy: double backward (autograd.grad(..., create_graph=True)) through the Triton "
                "kernel, whose backward has no derivative; pass fused=False (next_token_loss(model, fused=False)) "
                "or differentiate with torch.func, which runs the reference"
            )
        h, w, targets, lse = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[:2]
        dh, dw = bwd_op(h, w, targets, lse, g, ctx.ignore_index, ctx.cap, *ctx.tiles, need_dh, need_dw)
        return dh if need_dh else None, dw if need_dw else None, None, None, None, None


def linear_cross_entropy_reference(
    h: torch.Tensor,  # (N, D)
    w: torch.Tensor,  # (V, D)
    targets: torch.Tensor,  # (N,) int64, ignore_index where no loss
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> torch.Tensor:  # () float32 (float64 for float64 inputs)
    """``F.cross_entropy(soft_cap(h @ w.T), targets, reduction="sum")`` with float32 logits: the definition."""
    acc = torch.promote_types(torch.promote_types(h.dtype, w.dtype), torch.float32)
    z = h.to(acc) @ w.to(acc).T  # (N, V)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, targets, ignore_index=ignore_index, reduction="sum")


def supported(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: one dtype of float32 / bf16 / fp16, 2-d, and
    :func:`ftitan.kernels.op.use_kernel` (CUDA or the interpreter, no torch.func transform)."""
    return h.dtype == w.dtype and h.dtype in _DTYPES and h.dim() == w.dim() == 2 and op.use_kernel(h, w)


def linear_cross_entropy(
    h: torch.Tensor,  # (N, D)
    w: torch.Tensor,  # (V, D)
    targets: torch.Tensor,  # (N,) int64, ignore_index where no loss
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    tiles: tuple[int, int, int] | None = None,  # (BLOCK_N, BLOCK_V, BLOCK_D), each a power of 2 >= 16
) -> torch.Tensor:  # () float32
    """The summed cross-entropy of ``soft_cap(h @ w.T)`` (see the module docstring): the Triton kernels where
    :func:`supported`, else :func:`linear_cross_entropy_reference` (which holds all logits)."""
    if not supported(h, w):
        return linear_cross_entropy_reference(h, w, targets, ignore_index=ignore_index, softcap=softcap)
    tiles = tiles or TILES
    if any(b < 16 or b & (b - 1) for b in tiles):
        raise ValueError(f"linear_cross_entropy: tiles={tiles}: each must be a power of 2 >= 16 (tl.dot's smallest)")
    total, _lse = _LinearCrossEntropy.apply(h, w, targets, ignore_index, float(softcap or 0.0), tuple(tiles))
    return total
