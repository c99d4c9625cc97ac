"""SwiGLU's gating (Shazeer 2020, "GLU Variants Improve Transformer") as a Triton kernel, forward and backward.

``silu(gate) * up = gate * sigmoid(gate) * up``, elementwise, in one pass over
``gate`` and ``up`` (float32 arithmetic, stored in the inputs' dtype); the
backward writes ``dgate = dy * up * s * (1 + gate * (1 - s))`` and
``dup = dy * gate * s`` (``s = sigmoid(gate)``) in one pass too. The three
projections around it stay torch matmuls (:func:`swiglu_mlp`).

The pure-torch :func:`swiglu_reference` (``ftitan.nn.swiglu``'s gating, with
``silu`` written out as the train step's two gradient paths need) runs on
the CPU and under ``torch.func`` transforms (``ftitan.kernels.op``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ftitan.kernels import op

__all__ = ["swiglu", "swiglu_mlp", "swiglu_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel takes; others run the reference
_BLOCK = 1024  # elements per program


def swiglu_reference(
    gate: torch.Tensor,  # (..., F)
    up: torch.Tensor,  # (..., F)
) -> torch.Tensor:  # (..., F)
    """``gate * sigmoid(gate) * up`` in plain ops, as ``ftitan.nn.swiglu`` computes it."""
    return gate * torch.sigmoid(gate) * up


# ---------------------------------------------------------------- Triton kernels


@triton.jit
def _fwd_kernel(g_ptr, u_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(y_ptr + offs, (g * s * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(dg_ptr + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- ops (launches + fakes)


def _fwd_impl(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    if gate.numel():
        _fwd_kernel[(triton.cdiv(gate.numel(), _BLOCK),)](gate, up, y, gate.numel(), BLOCK=_BLOCK)
    return y


def _fwd_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


def _bwd_impl(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy, gate, up = dy.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        _bwd_kernel[(triton.cdiv(gate.numel(), _BLOCK),)](dy, gate, up, dg, du, gate.numel(), BLOCK=_BLOCK)
    return dg, du


def _bwd_fake(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))  # fmt: skip


_fwd_op = op.define("swiglu_fwd", "(Tensor gate, Tensor up) -> Tensor", _fwd_impl, _fwd_fake)
_bwd_op = op.define("swiglu_bwd", "(Tensor dy, Tensor gate, Tensor up) -> (Tensor, Tensor)", _bwd_impl, _bwd_fake)


# ---------------------------------------------------------------- autograd (the ops, never the reference)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _fwd_op(gate, up)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        return _bwd_op(dy, gate, up)


# ---------------------------------------------------------------- public


def swiglu(
    gate: torch.Tensor,  # (..., F)
    up: torch.Tensor,  # (..., F)
) -> torch.Tensor:  # (..., F)
    """``silu(gate) * up``: the Triton kernel where it runs (``op.use_kernel``; float32, bfloat16 and
    float16 of one shape and dtype), else :func:`swiglu_reference`."""
    if gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in _DTYPES and op.use_kernel(gate, up):
        return _SwiGLU.apply(gate, up)
    return swiglu_reference(gate, up)


def swiglu_mlp(
    x: torch.Tensor,  # (..., D)
    w1: torch.Tensor | None = None,  # (F, D) gate
    w2: torch.Tensor | None = None,  # (D, F) down
    w3: torch.Tensor | None = None,  # (F, D) up
    *,
    w13: torch.Tensor | None = None,  # (2F, D): [w1; w3] in one matrix, instead of w1 and w3
    kernels: str = "triton",
    float8: str = "",
) -> torch.Tensor:  # (..., D)
    """``ftitan.nn.swiglu`` (``w2(silu(w1 x) * w3 x)``) with its gating by :func:`swiglu`; the matmuls
    are ``ftitan.nn.linear``'s with ``kernels`` (oneDNN's GEMMs on the CPU: ``ftitan.kernels.onednn``) and
    ``float8`` (``ftitan.nn.float8``)."""
    from ftitan.nn.linear import linear  # ftitan.nn.mlp imports this module lazily

    if w13 is not None:
        gate, up = linear(x, w13, kernels=kernels, float8=float8).chunk(2, dim=-1)
    else:
        gate, up = linear(x, w1, kernels=kernels, float8=float8), linear(x, w3, kernels=kernels, float8=float8)
    return linear(swiglu(gate, up), w2, kernels=kernels, float8=float8)
