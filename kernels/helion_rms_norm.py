"""RMSNorm (Zhang & Sennrich 2019) written in Helion: forward and backward, the same function as
:func:`ftitan.nn.norm.rms_norm` (statistics in float32, the normalized value cast back to ``x``'s dtype
before the scale, the scale cast to ``x``'s dtype).

Helion (``helion.language``) writes a kernel as PyTorch code over tiles: ``hl.tile(m)`` splits the rows
into blocks, each block's body is ordinary tensor code that Helion lowers to Triton. One fixed config
(``block_sizes``: rows per program), no autotuning. Chosen by a model's ``kernels="helion"`` (Helion
kernels where ftitan has one, Triton otherwise).

The ops run the kernels compiled to Triton: on CUDA, and on CPU tensors inside
:func:`ftitan.kernels.op.interpret` through the Triton interpreter (``TRITON_INTERPRET=1``), so the tests
run the generated Triton code itself. :data:`KERNELS` also holds the same bodies in Helion's eager
reference mode (``ref_mode=helion.RefMode.EAGER``: each tile's PyTorch code executed as written; what
``HELION_INTERPRET=1`` does, which cannot be set next to ``TRITON_INTERPRET``), which the tests compare too.

The ops follow ``ftitan.kernels.op``: a forward op (output and the per-row ``1/rms``) and a backward op
(``dx`` and the per-block partial sums of ``dw``, summed in torch), an ``autograd.Function`` calling them,
and the reference under ``torch.func`` transforms.
"""

from __future__ import annotations

from typing import Any

import helion
import helion.language as hl
import torch

from ftitan.kernels import op
from ftitan.kernels.rms_norm import norm_function
from ftitan.nn import norm

__all__ = ["rms_norm", "rms_norm_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernels take; float64 runs the reference
_ROWS = 16  # rows per program (one block size: no autotuning)


def _fwd_body(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w * normed, 1 / rms)`` of ``x`` (M, N) with ``w`` (N,): the body of the forward kernel."""
    m, n = x.size()
    out = torch.empty_like(x)
    rstd = torch.empty([m], dtype=torch.float32, device=x.device)
    for rows in hl.tile(m):
        xf = x[rows, :].to(torch.float32)
        r = 1.0 / torch.sqrt(torch.mean(xf * xf, dim=-1) + eps)  # (rows,); rsqrt lowers to libdevice, which
        # the Triton interpreter lacks
        normed = (xf * r[:, None]).to(x.dtype).to(torch.float32)
        # the bf16 product as an fp32 product rounded once (exact: two bf16 factors multiply exactly in fp32);
        # the Triton interpreter gets bf16 * bf16 wrong
        out[rows, :] = (w[None, :].to(x.dtype).to(torch.float32) * normed).to(x.dtype)
        rstd[rows] = r
    return out, rstd


def _bwd_body(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``dx`` (M, N) and the partial sums of ``dw`` per block of rows (blocks, N) float32.

    With ``n = x r`` and ``r = (mean(x^2) + eps)^{-1/2}``: ``dn = dy w``, ``dx = r (dn - n mean(dn n))``,
    ``dw = sum_rows dy n`` (``n`` rounded to ``x``'s dtype, as the forward used it)."""
    m, n = x.size()
    block = hl.register_block_size(m)
    dx = torch.empty_like(x)
    dw_part = torch.empty([helion.cdiv(m, block), n], dtype=torch.float32, device=x.device)
    for rows in hl.tile(m, block_size=block):
        xf = x[rows, :].to(torch.float32)
        r = rstd[rows][:, None]
        normed = xf * r
        g = dy[rows, :].to(torch.float32)
        dn = (g * w[None, :].to(x.dtype).to(torch.float32)).to(x.dtype).to(torch.float32)
        dot = torch.mean(dn * normed, dim=-1, keepdim=True)
        dx[rows, :] = (r * (dn - normed * dot)).to(x.dtype)
        dw_part[rows.id, :] = torch.sum(g * normed.to(x.dtype).to(torch.float32), dim=0)
    return dx, dw_part


_CONFIG = helion.Config(block_sizes=[_ROWS])
KERNELS = {  # (forward, backward): compiled to Triton (what the ops run), and Helion's eager reference mode
    "triton": (helion.kernel(config=_CONFIG, static_shapes=False)(_fwd_body),
               helion.kernel(config=_CONFIG, static_shapes=False)(_bwd_body)),
    "eager": (helion.kernel(config=_CONFIG, ref_mode=helion.RefMode.EAGER)(_fwd_body),
              helion.kernel(config=_CONFIG, ref_mode=helion.RefMode.EAGER)(_bwd_body)),
}  # fmt: skip


def _fwd_impl(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return KERNELS["triton"][0](x.contiguous(), w.contiguous(), eps)


def _fwd_fake(x, w, eps):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape), x.new_empty(x.shape[0], dtype=torch.float32)


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    dx, dw_part = KERNELS["triton"][1](dy.contiguous(), x.contiguous(), w.contiguous(), rstd)
    return dx, dw_part.sum(0).to(w.dtype)


def _bwd_fake(dy, x, w, rstd):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape), w.new_empty(w.shape)


_FWD = op.define("helion_rms_norm_fwd", "(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)", _fwd_impl, _fwd_fake)
_BWD = op.define("helion_rms_norm_bwd", "(Tensor dy, Tensor x, Tensor w, Tensor rstd) -> (Tensor, Tensor)",
                 _bwd_impl, _bwd_fake)  # fmt: skip


_RMSNorm = norm_function(lambda *a: _FWD(*a), lambda *a: _BWD(*a))  # the Triton RMSNorm's Function, Helion ops


def rms_norm_reference(
    x: torch.Tensor,  # (..., D)
    w: torch.Tensor,  # (D,)
    eps: float,
) -> torch.Tensor:  # (..., D), dtype of x
    """``w * x / sqrt(mean(x^2) + eps)`` in plain torch: ``ftitan.nn.rms_norm`` itself (its torch path)."""
    return norm.rms_norm(x, w, eps)


def rms_norm(
    x: torch.Tensor,  # (..., D)
    w: torch.Tensor,  # (D,)
    eps: float,
) -> torch.Tensor:  # (..., D), dtype of x
    """RMSNorm by the Helion kernels where :func:`ftitan.kernels.op.use_kernel` (CUDA, or the interpreter)
    and ``x`` is bf16/fp16/fp32 with ``w`` of a kernel dtype too; :func:`rms_norm_reference` otherwise."""
    if x.dtype not in _DTYPES or w.dtype not in _DTYPES or x.numel() == 0 or not op.use_kernel(x, w):
        return rms_norm_reference(x, w, eps)
    y, _ = _RMSNorm.apply(x.reshape(-1, x.shape[-1]), w, float(eps))
    return y.reshape(x.shape)
