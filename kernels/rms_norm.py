"""RMSNorm (Zhang & Sennrich 2019) as a Triton kernel, forward and backward.

``y = w * x / sqrt(mean(x^2) + eps)`` over the last dim, with the dtype
rules of ``ftitan.nn.rms_norm``: statistics in float32, the normalized value
cast back to ``x.dtype`` before the scale, the scale cast to ``x.dtype``, the
output in ``x.dtype``.

- Forward: one program per row (the whole row in one block), which also
  writes the row's ``rstd`` (float32) for the backward.
- Backward: ``dx = rstd * (dn - xhat * mean(dn * xhat))`` with
  ``dn = dy * w`` and ``xhat = x * rstd`` (both float32), per row; the scale's
  gradient ``dw = sum_rows dy * n`` is accumulated in float32 by a fixed set of
  programs, each walking rows ``pid, pid + P, ...`` into its own partial row,
  and the ``P`` partials are summed by one small torch reduction. No atomics:
  the result is deterministic.

The pure-torch :func:`rms_norm_reference` runs on the CPU and under
``torch.func`` transforms (``ftitan.kernels.op``), and in float64.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ftitan.kernels import op
from ftitan.nn import norm

__all__ = ["rms_norm", "rms_norm_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel takes; others run the reference
_MAX_BLOCK = 65536  # widest row held in one block; wider rows run the reference


def rms_norm_reference(
    x: torch.Tensor,  # (..., D)
    w: torch.Tensor,  # (D,)
    eps: float,
) -> torch.Tensor:  # (..., D), dtype of x
    """``w * x / sqrt(mean(x^2) + eps)`` in plain torch: ``ftitan.nn.rms_norm`` itself (its torch path)."""
    return norm.rms_norm(x, w, eps)


# ---------------------------------------------------------------- Triton kernels


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    n = (xf * rstd).to(x.dtype).to(tl.float32)  # normalized, rounded to x's dtype as the reference does
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(x.dtype).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (w * n).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, M, D, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    x_dtype = dx_ptr.dtype.element_ty
    w = w.to(x_dtype).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for row in range(pid, M, tl.num_programs(0)):
        offs = tl.cast(row, tl.int64) * D + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        dw += dy * xhat.to(x_dtype).to(tl.float32)
        dn = dy * w
        dx = rstd * (dn - xhat * (tl.sum(dn * xhat, axis=0) / D))
        tl.store(dx_ptr + offs, dx.to(x_dtype), mask=mask)
    tl.store(dw_part_ptr + pid.to(tl.int64) * D + cols, dw, mask=mask)


def _block(d: int) -> int:
    return triton.next_power_of_2(max(d, 16))


def _warps(block: int) -> int:
    """Warps of a program holding a ``block``-wide row: more for wider rows (fewer registers per thread)."""
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


def _programs(x: torch.Tensor, rows: int) -> int:
    """Programs of the backward: a few per SM on CUDA (each keeps one float32 partial of ``dw``), few on CPU."""
    per = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    return max(1, min(rows, per))


# ---------------------------------------------------------------- ops (launches + fakes)


def _fwd_impl(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    x2, w = x.contiguous().view(-1, d), w.contiguous()
    y, rstd = torch.empty_like(x2), torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0] and d:
        _fwd_kernel[(x2.shape[0],)](x2, w, y, rstd, d, eps, BLOCK_D=_block(d), num_warps=_warps(_block(d)))
    return y.view(x.shape), rstd


def _fwd_fake(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(rows, dtype=torch.float32)


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    x2, dy2, w = x.contiguous().view(-1, d), dy.contiguous().view(-1, d), w.contiguous()
    dx = torch.empty_like(x2)
    rows = x2.shape[0]
    if not (rows and d):
        return dx.view(x.shape), torch.zeros_like(w)
    programs = _programs(x2, rows)
    parts = torch.empty(programs, d, dtype=torch.float32, device=x.device)
    _bwd_kernel[(programs,)](dy2, x2, w, rstd, dx, parts, rows, d, BLOCK_D=_block(d), num_warps=_warps(_block(d)))
    # the reference's dw is (dy * n) summed in x's dtype, then cast to w's dtype
    return dx.view(x.shape), parts.sum(0).to(x.dtype).to(w.dtype)


def _bwd_fake(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w)


_fwd_op = op.define("rms_norm_fwd", "(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)", _fwd_impl, _fwd_fake)
_bwd_op = op.define("rms_norm_bwd", "(Tensor dy, Tensor x, Tensor w, Tensor rstd) -> (Tensor, Tensor)",
                    _bwd_impl, _bwd_fake)  # fmt: skip


# ---------------------------------------------------------------- autograd (the ops, never the reference)


def norm_function(fwd: Any, bwd: Any) -> type[torch.autograd.Function]:
    """The autograd Function of an RMSNorm kernel pair: ``fwd(x, w, eps) -> (y, rstd)`` and
    ``bwd(dy, x, w, rstd) -> (dx, dw)`` ops (this module's Triton ones, or the Helion ones of
    ``ftitan.kernels.helion_rms_norm``); backward calls ``bwd``, never the reference."""

    class _RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
            return fwd(x, w, eps)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            x, w, _ = inputs
            ctx.save_for_backward(x, w, output[1])
            ctx.mark_non_differentiable(output[1])

        @staticmethod
        def backward(ctx: Any, dy: torch.Tensor, _drstd: Any) -> tuple[Any, ...]:  # type: ignore[override]
            x, w, rstd = ctx.saved_tensors
            dx, dw = bwd(dy, x, w, rstd)
            return dx, dw, None

    return _RMSNorm


_RMSNorm = norm_function(lambda *a: _fwd_op(*a), lambda *a: _bwd_op(*a))  # looked up per call (tests spy on them)


# ---------------------------------------------------------------- public


def rms_norm(
    x: torch.Tensor,  # (..., D)
    w: torch.Tensor,  # (D,)
    eps: float,
) -> torch.Tensor:  # (..., D), dtype of x
    """``w * x / sqrt(mean(x^2) + eps)``: the Triton kernel where it runs (``op.use_kernel``; float32,
    bfloat16 and float16 rows up to 65,536 wide), else :func:`rms_norm_reference`."""
    if (x.dtype in _DTYPES and w.dtype.is_floating_point and w.shape == x.shape[-1:] and 0 < x.shape[-1] <= _MAX_BLOCK
            and op.use_kernel(x, w)):  # fmt: skip
        return _RMSNorm.apply(x, w, eps)[0]
    return rms_norm_reference(x, w, eps)
