"""Gradient clipping by global norm (Pascanu et al. 2013, "On the difficulty of
training recurrent neural networks")."""

from __future__ import annotations

import math

import torch

from ftitan import tree
from ftitan.optim.transform import EmptyState, Params, Transform, Updates

__all__ = ["clip_by_global_norm"]


def clip_by_global_norm(max_norm: float | torch.Tensor) -> Transform:
    """Scales all updates by ``max_norm / max(norm, max_norm)``, ``norm`` their global L2 norm.

    Updates with ``norm <= max_norm`` pass unchanged (the factor is exactly 1);
    larger ones are scaled to norm ``max_norm``, as optax does. The norm is
    accumulated in float32 (float64 if any leaf is float64) and the factor is
    a 0-d tensor, so there is no data-dependent branch to break a compiled
    graph. (torch.nn.utils.clip_grad_norm_ divides by ``norm + 1e-6``
    instead, a relative difference of ``1e-6 / norm``.) ``max_norm`` may be
    a 0-d tensor (:func:`~ftitan.optim.inject_hyperparams`).
    """
    if not isinstance(max_norm, torch.Tensor) and (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float))
        or not (max_norm > 0 and math.isfinite(max_norm))
    ):
        raise ValueError(f"max_norm={max_norm!r}: expected a finite float > 0")

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        del params
        norm = tree.global_norm(grads)
        bound = max_norm.to(norm) if isinstance(max_norm, torch.Tensor) else max_norm
        factor = bound / torch.clamp(norm, min=bound)
        return tree.map(lambda g: g * factor.to(g.device), grads), state

    return Transform(init, update, leafwise=True)
