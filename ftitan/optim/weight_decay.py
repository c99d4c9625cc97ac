"""Decoupled weight decay: ``updates + weight_decay * params``.

Placed before the learning-rate scale, it gives the decoupled decay of
AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"):
``p - lr * (u + wd * p) = p * (1 - lr * wd) - lr * u``. Placed before the
momentum (as in :func:`ftitan.optim.sgd`) it is classic L2 regularization.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ftitan import tree
from ftitan.optim.transform import EmptyState, Params, Transform, Updates

__all__ = ["add_decayed_weights"]

Mask = Callable[[str, torch.Tensor], bool] | str | Sequence[str]


def _mask_fn(mask: Mask | None) -> Callable[[str, Any], bool]:
    if mask is None:
        return lambda _path, _x: True
    if isinstance(mask, str):
        mask = [mask]
    if isinstance(mask, (list, tuple)):
        patterns = list(mask)
        return lambda path, _x: any(tree.match(path, p) for p in patterns)
    if callable(mask):
        return mask
    raise TypeError(
        f"mask={mask!r}: expected None, a predicate (path, leaf) -> bool, "
        "or glob pattern(s) over dotted paths such as 'layers.*.attn.w?'"
    )


def add_decayed_weights(weight_decay: float | torch.Tensor, mask: Mask | None = None) -> Transform:
    """Adds ``weight_decay * param`` to the update of each param ``mask`` selects.

    ``mask`` is a predicate ``(path, leaf) -> bool`` or glob pattern(s) over
    dotted paths (``"**.w?"``); ``None`` decays every leaf. Paths and shapes
    are static, so masking costs nothing under ``torch.compile``. A 0-d
    tensor ``weight_decay`` (:func:`~ftitan.optim.inject_hyperparams`) is
    read at every update.
    """
    injected = isinstance(weight_decay, torch.Tensor)
    if not injected and (
        isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0
    ):
        raise ValueError(f"weight_decay={weight_decay!r}: expected a float >= 0")
    selected = _mask_fn(mask)

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        if not injected and weight_decay == 0:
            return grads, state
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(grads, state, params)")

        def one(path: str, g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            if not selected(path, p):
                return g
            if injected:
                return g + weight_decay * p.to(g.dtype)  # type: ignore[operator]
            return torch.add(g, p.to(g.dtype), alpha=weight_decay)

        return tree.map_with_path(one, grads, params), state

    return Transform(init, update, leafwise=mask is None)  # a mask reads paths, which a layer's part lacks
