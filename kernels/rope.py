"""Rotary position embedding (Su et al. 2021, RoFormer) as one fused Triton kernel for q and k, forward and backward.

The convention is ``ftitan.nn.apply_rope``'s (HF's "rotate half"): a head
vector's halves ``(x1, x2)`` rotate as

    y1 = x1 * c1 - x2 * s1,    y2 = x2 * c2 + x1 * s2

with ``(c1, c2) = cos``, ``(s1, s2) = sin`` (``cos``/``sin`` of shape
``(T, Dh)`` or ``(B, T, Dh)``, cast to ``x.dtype`` first, as HF does). Its
adjoint, the backward, is ``dx1 = g1 * c1 + g2 * s2``, ``dx2 = g2 * c2 - g1 * s1``
(the rotation by ``-angle``): the same kernel with one flag.

One program per token ``(b, t)`` loads that token's ``cos``/``sin`` once and
rotates every head of q and of k (:func:`apply_rope_qk`: one launch for both);
:func:`apply_rope` rotates one tensor. Arithmetic in float32, stored in the
input's dtype. The angles get no gradient here: where ``cos``/``sin`` require
one, the reference runs.

The pure-torch :func:`apply_rope_reference` runs on the CPU and under
``torch.func`` transforms (``ftitan.kernels.op``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ftitan.kernels import op
from ftitan.nn import rope

__all__ = ["apply_rope", "apply_rope_qk", "apply_rope_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel takes; others run the reference


def apply_rope_reference(
    x: torch.Tensor,  # (B, T, H, Dh)
    cos: torch.Tensor,  # (T, Dh) | (B, T, Dh), or a table (S, Dh) when positions is given
    sin: torch.Tensor,  # same shape as cos
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int rows of the cos/sin table
) -> torch.Tensor:  # (B, T, H, Dh)
    """``x * cos + rotate_half(x) * sin`` in plain ops: ``ftitan.nn.apply_rope`` itself (its torch path)."""
    return rope.apply_rope(x, cos, sin, positions)


# ---------------------------------------------------------------- Triton kernels


@triton.jit
def _rotate(in_ptr, out_ptr, token, H, HALF, c1, c2, s1, s2, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
            BACKWARD: tl.constexpr):  # fmt: skip
    """Rotate the ``H`` heads of one token (rows ``[token * H, (token + 1) * H)`` of width ``2 * HALF``)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (cols < HALF)
    offs = (token * H + heads) * (2 * HALF) + cols  # (BLOCK_H, BLOCK_HALF) first halves
    x1 = tl.load(in_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(in_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the adjoint: rotation by -angle
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(out_ptr + offs, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + offs + HALF, y2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, T, HQ, HK, HALF, PER_BATCH: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BACKWARD: tl.constexpr):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    if PER_BATCH:  # the token's row of cos/sin
        row = token
    else:
        row = token % T
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < HALF
    base = row * (2 * HALF) + cols
    dtype = qo_ptr.dtype.element_ty  # the angles are cast to x's dtype first, as the reference does
    c1 = tl.load(cos_ptr + base, mask=cmask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + base + HALF, mask=cmask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + base, mask=cmask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + base + HALF, mask=cmask, other=0.0).to(dtype).to(tl.float32)
    _rotate(q_ptr, qo_ptr, token, HQ, HALF, c1, c2, s1, s2, BLOCK_HQ, BLOCK_HALF, BACKWARD)
    if HK > 0:
        _rotate(k_ptr, ko_ptr, token, HK, HALF, c1, c2, s1, s2, BLOCK_HK, BLOCK_HALF, BACKWARD)


# ---------------------------------------------------------------- ops (launches + fakes)


def _rope_impl(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               backward: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    b, t, hq, dh = q.shape
    q, k, cos, sin = q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous()
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if q.numel():
        _rope_kernel[(b * t,)](
            q, k, qo, ko, cos, sin, t, hq, k.shape[2], dh // 2, PER_BATCH=cos.dim() == 3,
            BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(max(k.shape[2], 1)),
            BLOCK_HALF=triton.next_power_of_2(dh // 2), BACKWARD=backward,
        )  # fmt: skip
    return qo, ko


def _rope_fake(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               backward: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))  # fmt: skip


_rope_op = op.define("rope", "(Tensor q, Tensor k, Tensor cos, Tensor sin, bool backward) -> (Tensor, Tensor)",
                     _rope_impl, _rope_fake)  # fmt: skip


# ---------------------------------------------------------------- autograd (the ops, never the reference)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:  # type: ignore[override]
        return _rope_op(q, k, cos, sin, False)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[2], inputs[3])

    @staticmethod
    def backward(ctx: Any, gq: torch.Tensor, gk: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        dq, dk = _rope_op(gq, gk, cos, sin, True)
        return dq, dk, None, None


# ---------------------------------------------------------------- public


def _runs_kernel(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    b, t, _, dh = q.shape
    aligned = cos.shape == sin.shape and cos.shape in ((t, dh), (b, t, dh)) and k.shape[:2] == (b, t)
    return (aligned and dh % 2 == 0 and k.shape[-1] == dh and q.dtype == k.dtype and q.dtype in _DTYPES
            and cos.dtype.is_floating_point and sin.dtype.is_floating_point
            and not (cos.requires_grad or sin.requires_grad) and op.use_kernel(q, k, cos, sin))  # fmt: skip


def apply_rope_qk(
    q: torch.Tensor,  # (B, T, Hq, Dh)
    k: torch.Tensor,  # (B, T, Hk, Dh)
    cos: torch.Tensor,  # (T, Dh) | (B, T, Dh), or a table (S, Dh) when positions is given
    sin: torch.Tensor,  # same shape as cos
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int rows of the cos/sin table
) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T, Hq, Dh), (B, T, Hk, Dh)
    """q and k rotated (:func:`apply_rope_reference` each), in one kernel launch where it runs
    (``op.use_kernel``; float32, bfloat16, float16)."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    if q.dim() == 4 and k.dim() == 4 and _runs_kernel(q, k, cos, sin):
        return _Rope.apply(q, k, cos, sin)
    return apply_rope_reference(q, cos, sin), apply_rope_reference(k, cos, sin)


def apply_rope(
    x: torch.Tensor,  # (B, T, H, Dh)
    cos: torch.Tensor,  # (T, Dh) | (B, T, Dh), or a table (S, Dh) when positions is given
    sin: torch.Tensor,  # same shape as cos
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int rows of the cos/sin table
) -> torch.Tensor:  # (B, T, H, Dh)
    """``x`` rotated (:func:`apply_rope_reference`): the kernel where it runs (``op.use_kernel``), else
    the reference."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    if x.dim() == 4:
        none = x.new_empty(*x.shape[:2], 0, x.shape[-1])  # no k: the kernel rotates x's heads only
        if _runs_kernel(x, none, cos, sin):
            return _Rope.apply(x, none, cos, sin)[0]
    return apply_rope_reference(x, cos, sin)
