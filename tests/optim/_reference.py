"""Straightforward float64 references for Muon: one matrix at a time, no batching."""

from __future__ import annotations

import math

import torch

A, B, C = 3.4445, -4.7750, 2.0315


def newton_schulz_f64(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Jordan 2024 on one (m, n) matrix, in float64."""
    assert G.ndim == 2
    X = G.to(torch.float64)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / max(X.norm().item(), eps)
    for _ in range(steps):
        gram = X @ X.T
        X = A * X + (B * gram + C * gram @ gram) @ X
    return X.T if tall else X


def muon_f64(
    params: dict[str, torch.Tensor],
    grads: list[dict[str, torch.Tensor]],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    scale: str = "original",
    style: str = "torch",
) -> dict[str, torch.Tensor]:
    """Muon as written in Jordan 2024 / torch.optim.Muon's docs, float64, leaf by leaf.

    ``style="optax"``: optax.contrib.muon's bias-corrected momentum,
    ``mu * B / (1 - mu^(t+1)) + (1 - mu) * g / (1 - mu^t)`` (Nesterov) or ``B / (1 - mu^t)``.
    """
    p = {k: v.to(torch.float64).clone() for k, v in params.items()}
    buf = {k: torch.zeros_like(v) for k, v in p.items()}
    for t, g in enumerate(grads, start=1):
        for k in p:
            gk = g[k].to(torch.float64)
            buf[k] = momentum * buf[k] + (1 - momentum) * gk
            if style == "torch":
                x = (1 - momentum) * gk + momentum * buf[k] if nesterov else buf[k]
            elif nesterov:
                x = momentum * buf[k] / (1 - momentum ** (t + 1)) + (1 - momentum) * gk / (1 - momentum**t)
            else:
                x = buf[k] / (1 - momentum**t)
            rows, cols = x.shape[-2:]
            o = torch.stack([newton_schulz_f64(m) for m in x.reshape(-1, rows, cols)]).reshape(x.shape)
            s = math.sqrt(max(1, rows / cols)) if scale == "original" else 0.2 * math.sqrt(max(rows, cols))
            p[k] = p[k] * (1 - lr * weight_decay) - lr * s * o
    return p
