"""``apply_if_finite``: skip updates whose gradients hold a NaN or an inf (optax's)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ftitan import tree
from ftitan.optim.transform import Params, State, Transform, Updates, state_device

__all__ = ["ApplyIfFiniteState", "all_finite", "apply_if_finite"]


class ApplyIfFiniteState(NamedTuple):
    notfinite_count: torch.Tensor  # () int64: consecutive non-finite gradients, reset by a finite one
    last_finite: torch.Tensor  # () bool: whether the last gradients were finite
    total_notfinite: torch.Tensor  # () int64: non-finite gradients seen in all
    inner_state: State  # the inner transform's state, unchanged by a skipped update


def all_finite(t: Updates) -> torch.Tensor:
    """A 0-d bool tensor: every element of every tensor leaf is finite (True for no leaves)."""
    flags = [torch.isfinite(x).all() for x in tree.leaves(t) if tree.is_tensor(x)]
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool)


def apply_if_finite(inner: Transform, max_consecutive_errors: int) -> Transform:
    """Applies ``inner`` only when the incoming gradients are all finite.

    A non-finite gradient gives zero updates and leaves ``inner``'s state as
    it was; ``notfinite_count`` counts such gradients in a row,
    ``total_notfinite`` in all. After more than ``max_consecutive_errors`` in
    a row the update is applied anyway (optax's semantics: the run is
    broken, so stop hiding it). Both branches are computed and selected with
    ``torch.where``: no data-dependent branch under ``torch.compile``.
    optax: ``optax.apply_if_finite``.
    """
    if not isinstance(inner, Transform):
        raise TypeError(f"apply_if_finite: inner is a {type(inner).__name__}, not a Transform")
    n = max_consecutive_errors
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"max_consecutive_errors={max_consecutive_errors!r}: expected an int >= 0")

    def init(params: Params) -> ApplyIfFiniteState:
        device = state_device(params)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        finite = torch.ones((), dtype=torch.bool, device=device)
        return ApplyIfFiniteState(zero, finite, zero.clone(), inner.init(params))

    def update(
        grads: Updates, state: ApplyIfFiniteState, params: Params | None = None
    ) -> tuple[Updates, ApplyIfFiniteState]:
        finite = all_finite(grads).to(state.last_finite.device)
        bad = (~finite).to(torch.int64)
        notfinite_count = (state.notfinite_count + 1) * bad  # 0 after a finite gradient
        apply = finite | (notfinite_count > max_consecutive_errors)
        updates, inner_state = inner.update(grads, state.inner_state, params)
        updates = tree.map(lambda u: torch.where(apply, u, torch.zeros_like(u)), updates)
        inner_state = tree.map(lambda new, old: torch.where(apply, new, old), inner_state, state.inner_state)
        return updates, ApplyIfFiniteState(notfinite_count, finite, state.total_notfinite + bad, inner_state)

    return Transform(init, update)
