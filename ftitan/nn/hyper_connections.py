"""Manifold-constrained hyper-connections (mHC: Xie et al. 2026; DeepSeek-V4 sec. 2.2).

The residual stream is widened to ``N`` parallel streams ``h`` (B, T, N, D).
Around each block (attention or feed-forward) one small projection of the
RMS-normed, flattened streams gives three per-token mixings:

- ``pre`` (B, T, N): ``sigmoid(.) + eps``, collapses the streams into the
  block's input ``x = sum_n pre_n h_n`` (B, T, D);
- ``post`` (B, T, N): ``2 sigmoid(.)``, spreads the block's output ``y``
  back over the streams;
- ``comb`` (B, T, N, N): ``softmax(.) + eps`` projected towards the doubly
  stochastic matrices by Sinkhorn-Knopp (column normalization first, then
  ``iters - 1`` row/column rounds), which mixes the old streams:
  ``h' = post y + comb^T h``.

A doubly stochastic ``comb`` keeps the residual mapping non-expansive
across depth. :func:`hc_head` collapses the streams once more (``pre`` only)
before the final norm. The mixing math runs in float32 whatever the
activation dtype, as the reference does (float64 activations keep float64).

Params of one connection (``hc_params``)::

    {"fn": (N * (N + 2), N * D), "base": (N * (N + 2),), "scale": (3,)}   # rows: pre | post | comb
    head: {"fn": (N, N * D), "base": (N,), "scale": (1,)}
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ftitan.nn.param import Param, normal_init, ones_init, zeros_init

__all__ = ["hc_collapse", "hc_expand", "hc_head", "hc_head_params", "hc_params", "hc_weights", "unweighted_rms_norm"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32, float64 kept (finite-difference checks)."""
    return torch.promote_types(dtype, torch.float32)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:  # (..., D) -> (..., D)
    """``x / sqrt(mean(x^2) + eps)`` without a scale, statistics in float32 (float64 kept) (DeepSeek-V4's q and
    mHC norms)."""
    xf = x.to(_acc(x.dtype))
    return x * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hc_params(dim: int, n_streams: int, *, std: float = 0.02) -> dict[str, Param]:
    """Specs of one connection; ``fn`` drawn N(0, std^2), ``base`` zeros, ``scale`` ones (as the reference)."""
    n = n_streams
    return {
        "fn": Param(shape=(n * (n + 2), n * dim), axes=(None, "embed"), init=normal_init(std)),
        "base": Param(shape=(n * (n + 2),), axes=("norm",), init=zeros_init),
        "scale": Param(shape=(3,), axes=("norm",), init=ones_init),
    }


def hc_head_params(dim: int, n_streams: int, *, std: float = 0.02) -> dict[str, Param]:
    """Specs of the final collapse (:func:`hc_head`)."""
    n = n_streams
    return {
        "fn": Param(shape=(n, n * dim), axes=(None, "embed"), init=normal_init(std)),
        "base": Param(shape=(n,), axes=("norm",), init=zeros_init),
        "scale": Param(shape=(1,), axes=("norm",), init=ones_init),
    }


def _mix(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:  # (B, T, N, D) -> (B, T, rows) fp32
    acc = _acc(h.dtype)
    flat = unweighted_rms_norm(h.flatten(-2).to(acc), norm_eps)
    return flat @ fn.to(acc).t()


def hc_weights(
    h: torch.Tensor,  # (B, T, N, D) streams
    p: Mapping[str, torch.Tensor],
    *,
    sinkhorn_iters: int,
    eps: float,  # floor of pre / comb and of the Sinkhorn denominators (HF hc_eps)
    norm_eps: float,  # epsilon of the input RMS norm (HF rms_norm_eps)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # pre (B, T, N), post (B, T, N), comb (B, T, N, N): fp32 | fp64
    """The three mixings of one connection (see the module docstring)."""
    n = h.shape[-2]
    pre_w, post_w, comb_w = _mix(h, p["fn"], norm_eps).split([n, n, n * n], dim=-1)
    acc = _acc(h.dtype)
    pre_b, post_b, comb_b = p["base"].to(acc).split([n, n, n * n])
    s_pre, s_post, s_comb = p["scale"].to(acc).unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    logits = comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n)
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):  # Sinkhorn-Knopp: rows, then columns
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:  # (B, T, N, D), (B, T, N) -> (B, T, D)
    """The block input ``sum_n pre_n h_n``, in ``h``'s dtype."""
    return (pre.unsqueeze(-1) * h).sum(dim=-2).to(h.dtype)


def hc_expand(
    h: torch.Tensor,  # (B, T, N, D) streams entering the block
    y: torch.Tensor,  # (B, T, D) block output
    post: torch.Tensor,  # (B, T, N)
    comb: torch.Tensor,  # (B, T, N, N)
) -> torch.Tensor:  # (B, T, N, D)
    """The streams after the block: ``post_n y + sum_m comb_{m n} h_m``."""
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ h


def hc_head(
    h: torch.Tensor,  # (B, T, N, D)
    p: Mapping[str, torch.Tensor],
    *,
    eps: float,
    norm_eps: float,
) -> torch.Tensor:  # (B, T, D)
    """The final collapse of the streams: ``sum_n (sigmoid(fn(h) * scale + base) + eps)_n h_n``."""
    acc = _acc(h.dtype)
    pre = torch.sigmoid(_mix(h, p["fn"], norm_eps) * p["scale"].to(acc) + p["base"].to(acc)) + eps
    return hc_collapse(h, pre)
