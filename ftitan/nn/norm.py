"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as HF Llama does."""

from __future__ import annotations

import torch

from ftitan.nn import invariant as _invariant
from ftitan.nn.param import Param, init, ones_init

__all__ = ["NORM_AXES", "init_norm", "norm_param", "rms_norm"]

NORM_AXES = ("norm",)


def rms_norm(
    x: torch.Tensor,  # (..., D)
    w: torch.Tensor,  # (D,)
    eps: float,
    *,
    invariant: bool = False,
    kernels: str = "torch",
) -> torch.Tensor:  # (..., D), dtype of x
    """``w * x / sqrt(mean(x^2) + eps)``.

    The statistics are taken in float32 and the normalized value is cast back
    to ``x.dtype`` before the scale, exactly as ``LlamaRMSNorm``. The scale is
    cast to ``x.dtype`` too, so float32 master weights with bfloat16
    activations keep the activations bfloat16 (HF would promote to float32).
    Float64 inputs keep float64 statistics (finite-difference checks).
    Under mixed precision this is what keeps the statistics float32 for
    bfloat16 / float16 activations (float16 ``x**2`` overflows from
    ``|x| > 256``); every norm of the models (block, final, QK-norm, MLA's
    latent norms) is this function. ``invariant``: the mean as a fixed-order
    tree (``ftitan.nn.invariant.rms_norm``). ``kernels="triton"``:
    ``ftitan.kernels.rms_norm`` (the Triton kernel on CUDA, this function's reference elsewhere).
    """
    if kernels == "helion" and not invariant:  # Helion's RMSNorm kernel (ftitan.kernels.helion_rms_norm)
        from ftitan.kernels.helion_rms_norm import rms_norm as helion_rms_norm

        return helion_rms_norm(x, w, eps)
    if kernels == "triton" and not invariant:  # imported here: ftitan.kernels imports ftitan.nn
        from ftitan.kernels.rms_norm import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, w, eps)
    if invariant:
        return _invariant.rms_norm(x, w, eps)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w.to(x.dtype) * normed.to(x.dtype)


def norm_param(dim: int) -> Param:
    """Spec of a ``(dim,)`` scale initialized to ones."""
    return Param(shape=(dim,), axes=NORM_AXES, init=ones_init)


def init_norm(
    key: torch.Tensor,
    dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # (D,)
    return init(norm_param(dim), key, dtype=dtype, device=device)
