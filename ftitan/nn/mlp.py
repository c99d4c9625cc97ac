"""SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer").

``w2(silu(w1 x) * w3 x)`` with ``w1`` the gate, ``w3`` the up and ``w2`` the
down projection (Meta's Llama names; HF: gate_proj, up_proj, down_proj).
"""

from __future__ import annotations

import torch

from ftitan.nn import invariant as _invariant
from ftitan.nn.linear import linear, linear_param
from ftitan.nn.param import Param, init

__all__ = ["init_swiglu", "swiglu", "swiglu_params"]


def swiglu(
    x: torch.Tensor,  # (..., D)
    w1: torch.Tensor | None = None,  # (F, D) gate
    w2: torch.Tensor | None = None,  # (D, F) down
    w3: torch.Tensor | None = None,  # (F, D) up
    *,
    w13: torch.Tensor | None = None,  # (2F, D): [w1; w3] in one matrix, instead of w1 and w3
    invariant: bool = False,
    kernels: str = "torch",
    float8: str = "",
) -> torch.Tensor:  # (..., D)
    """``w2(silu(w1 x) * w3 x)``; with ``w13`` (``ftitan.models.fused``: one matmul for gate and up, as
    inference engines do and as a config's ``fuse_projections`` trains) the same function. ``invariant``:
    batch-invariant matmuls (``ftitan.nn.invariant``). ``kernels="triton"`` (or "helion"): the gating by
    ``ftitan.kernels.swiglu``.
    ``float8`` (e.g. "tensorwise"): the three projections in float8 (``ftitan.nn.float8``)."""
    if kernels != "torch" and not invariant:  # "triton", "helion": Triton's; imported here (ftitan.kernels imports nn)
        from ftitan.kernels.swiglu import swiglu_mlp

        return swiglu_mlp(x, w1, w2, w3, w13=w13, kernels=kernels, float8=float8)
    if w13 is not None:
        gate, up = linear(x, w13, invariant=invariant, float8=float8).chunk(2, dim=-1)
    else:
        gate, up = linear(x, w1, invariant=invariant, float8=float8), linear(x, w3, invariant=invariant, float8=float8)
    # silu written out: F.silu's fused backward kernel differs from the
    # decomposition torch.func uses by an ulp, and the train step promises
    # identical gradients on its torch.func and autograd paths
    sig = _invariant.sigmoid(gate) if invariant else torch.sigmoid(gate)
    return linear(gate * sig * up, w2, invariant=invariant, float8=float8)


def swiglu_params(dim: int, hidden_dim: int, *, std: float = 0.02, out_std: float | None = None) -> dict[str, Param]:
    """Specs ``{"w1", "w2", "w3"}``; ``out_std`` (default ``std``) is for the down projection ``w2``."""
    return {
        "w1": linear_param(dim, hidden_dim, axes=("mlp", "embed"), std=std),
        "w2": linear_param(hidden_dim, dim, axes=("embed", "mlp"), std=std if out_std is None else out_std),
        "w3": linear_param(dim, hidden_dim, axes=("mlp", "embed"), std=std),
    }


def init_swiglu(
    key: torch.Tensor,
    dim: int,
    hidden_dim: int,
    *,
    std: float = 0.02,
    out_std: float | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """``{"w1", "w2", "w3"}``, leaf ``name`` drawn from ``fold_in(key, name)``."""
    return init(swiglu_params(dim, hidden_dim, std=std, out_std=out_std), key, dtype=dtype, device=device)
