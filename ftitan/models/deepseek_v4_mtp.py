"""DeepSeek-V4's multi-token prediction (MTP) modules (DeepSeek-V4 report; DeepSeek-V3 report sec. 2.2).

Module ``k`` (1-based; params ``mtp.{k-1}``) works on the hyper-connection
streams: at position ``i`` it mixes the previous depth's streams ``h^{k-1}_i``
(B, T, N, D) (``h^0``: the main model's streams after its last block, before
the final collapse) with the embedding of token ``t_{i+k}``, runs one V4 block
(sliding-window attention, learned top-k MoE) and predicts ``t_{i+k+1}`` through
its own stream collapse and norm and the shared head::

    x = e_proj(RMSNorm_e(Emb(t_{i+k}))) + h_proj(RMSNorm_h(h^{k-1}_i))    (added to every stream)
    h^k = Block_k(x)
    P^k = softmax(head(RMSNorm_k(hc_head_k(h^k))))
    L_MTP = weight * mean_k CE(P^k, t)

as DeepSeek's inference code builds it (``MTPBlock``; its checkpoints hold one
module under ``mtp.0.*``, with no compressor: a sliding layer). The loss
enters training through ``apply_with_aux`` (``aux["loss"]``, metric
``"mtp.loss"``), with the inputs only: depth ``k`` scores positions
``0 .. T-k-2`` against the inputs shifted by ``k + 1`` (the last position,
whose target lies past the row, is dropped). transformers does not build
these modules (it drops ``mtp.*``); export writes them under the hub's
names, import leaves them out (``n_mtp_layers=0``).

Params tree (per module)::

    {"enorm": (D,), "hnorm": (D,), "e_proj": (D, D), "h_proj": (D, D), "block": {a V4 block, sliding},
     "hc_head": {"fn": (N, N * D), "base": (N,), "scale": (1,)}, "norm": (D,)}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ftitan import nn
from ftitan.nn import hyper_connections as hc

__all__ = ["mtp_losses", "mtp_specs"]


def mtp_specs(dim: int, n: int, block: Callable[[], dict[str, Any]], *, hc_mult: int, std: float) -> dict[str, Any]:
    """Specs of ``n`` modules; ``block()`` gives one sliding, learned-routing V4 block's specs."""
    return {
        str(k): {
            "enorm": nn.norm_param(dim),
            "hnorm": nn.norm_param(dim),
            "e_proj": nn.linear_param(dim, dim, axes=(None, "embed"), std=std),
            "h_proj": nn.linear_param(dim, dim, axes=(None, "embed"), std=std),
            "block": block(),
            "hc_head": hc.hc_head_params(dim, hc_mult, std=std),
            "norm": nn.norm_param(dim),
        }
        for k in range(n)
    }


def mtp_losses(
    cfg: Any,  # deepseek_v4.Config
    mtp: Mapping[str, Any],  # params["mtp"]
    embed: torch.Tensor,  # (V, D)
    head: torch.Tensor,  # (V, D)
    h: torch.Tensor,  # (B, T, N, D) the main model's streams after its last block
    tokens: torch.Tensor,  # (B, T) int
    block: Callable[..., tuple[torch.Tensor, Any, Any]],  # (p, streams, tokens, positions) -> (streams, stats, _)
) -> tuple[list[torch.Tensor], list[Any]]:  # per depth: mean CE (0-d), router stats
    """Each depth's cross-entropy and its block's router statistics (see the module docstring)."""
    losses, stats = [], []
    t = tokens.shape[1]
    for k in range(1, cfg.n_mtp_layers + 1):
        if t - k < 2:
            raise ValueError(f"deepseek_v4 MTP: rows of {t} tokens leave depth {k} no position to score; "
                             f"use rows of more than {k + 1} tokens")  # fmt: skip
        p = mtp[str(k - 1)]
        e = F.embedding(tokens[:, k:], embed)  # (B, T-k, D)
        e = nn.rms_norm(e, p["enorm"], cfg.norm_eps, kernels=cfg.kernels)
        x = nn.rms_norm(h[:, : t - k], p["hnorm"], cfg.norm_eps, kernels=cfg.kernels)
        x = nn.linear(e, p["e_proj"], kernels=cfg.kernels).unsqueeze(2) + nn.linear(x, p["h_proj"], kernels=cfg.kernels)
        h, s, _ = block(p["block"], x, tokens[:, k:], torch.arange(t - k, device=tokens.device))
        out = nn.rms_norm(hc.hc_head(h, p["hc_head"], eps=cfg.hc_eps, norm_eps=cfg.norm_eps), p["norm"], cfg.norm_eps)
        logits = nn.linear(out[:, :-1], head, kernels=cfg.kernels)  # (B, T-k-1, V): position i predicts t_{i+k+1}
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32; float64 kept
        losses.append(F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1 :].flatten()))
        stats.append(s)
    return losses, stats
