"""Gradient accumulation: optax's ``MultiSteps``, weighted by target tokens.

``MultiSteps(inner, k)`` accumulates the gradients of ``k`` calls and applies
``inner`` to their mean on the ``k``-th, emitting zero updates in between.
The mean is weighted: ``update(..., weight=n)`` counts a micro-batch ``n``
times (``make_train_step`` passes its target-token count), so that with a
token-mean loss the accumulated gradient is the full batch's even when the
micro-batches hold different numbers of target tokens. Without weights it
is optax's plain mean.

:func:`update_weighted_mean` is the one accumulation rule: ``MultiSteps``
and ``make_train_step(accum_steps=k)`` both use it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftitan import tree
from ftitan.optim.transform import Params, State, Transform, Updates, accumulator_dtype, scalar_dtype, state_device

__all__ = ["MultiStepsState", "MultiSteps", "update_weighted_mean"]


class MultiStepsState(NamedTuple):
    mini_step: torch.Tensor  # () int64: calls since the last inner update, in [0, k)
    gradient_step: torch.Tensor  # () int64: inner updates applied
    inner_opt_state: State  # the inner transform's state
    acc_grads: Params  # weighted mean of this round's gradients, float32 (float64 for float64 params)
    acc_weight: torch.Tensor  # () total weight of this round (float32, float64 for float64 params)


def update_weighted_mean(
    mean: Any, total: torch.Tensor, new: Any, weight: torch.Tensor | float = 1.0
) -> tuple[Any, torch.Tensor]:
    """One step of a running weighted mean: ``(mean + (new - mean) * w / (total + w), total + w)``.

    ``mean`` starts as zeros and ``total`` as 0. With unit weights this is
    optax's (Welford) running mean; a zero weight leaves ``mean`` as it is
    (also when ``total`` is 0). ``new`` is cast to each mean leaf's dtype;
    the ratio is formed in ``total``'s dtype.
    """
    weight = torch.as_tensor(weight).to(device=total.device, dtype=total.dtype)
    total = total + weight
    frac = weight / total.clamp(min=torch.finfo(total.dtype).tiny)
    return tree.map(lambda m, x: m + (x.to(m.dtype) - m) * frac, mean, new), total


def MultiSteps(inner: Transform, every_k: int) -> Transform:  # noqa: N802 - optax's name
    """Accumulate ``every_k`` gradients, then apply ``inner`` to their (weighted) mean.

    ``update(grads, state, params=None, *, weight=None)`` returns zero
    updates for ``every_k - 1`` calls and ``inner``'s update of the weighted
    mean gradient on the ``every_k``-th; ``inner``'s state moves only then.
    ``weight`` (a 0-d tensor or float, 1 by default) weights this call's
    gradient, e.g. its micro-batch's target-token count. As in optax, the
    inner update is computed on every call and selected with ``torch.where``
    (no data-dependent branch under ``torch.compile``), so each call costs
    one inner update. optax: ``optax.MultiSteps`` (``use_grad_mean=True``).
    """
    if not isinstance(inner, Transform):
        raise TypeError(f"MultiSteps: inner is a {type(inner).__name__}, not a Transform")
    if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"MultiSteps: every_k={every_k!r}; expected an int >= 1 (micro-batches per update)")

    def init(params: Params) -> MultiStepsState:
        device = state_device(params)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return MultiStepsState(
            mini_step=zero,
            gradient_step=zero.clone(),
            inner_opt_state=inner.init(params),
            acc_grads=tree.map(lambda p: torch.zeros_like(p, dtype=accumulator_dtype(p)), params),
            acc_weight=torch.zeros((), dtype=scalar_dtype(params), device=device),
        )

    def update(
        grads: Updates,
        state: MultiStepsState,
        params: Params | None = None,
        *,
        weight: torch.Tensor | float | None = None,
    ) -> tuple[Updates, MultiStepsState]:
        acc, total = update_weighted_mean(state.acc_grads, state.acc_weight, grads, 1.0 if weight is None else weight)
        emit = state.mini_step == every_k - 1
        mean = tree.map(lambda a, g: a.to(g.dtype), acc, grads)
        inner_updates, inner_state = inner.update(mean, state.inner_opt_state, params)
        keep = lambda new, old: torch.where(emit, new, old)  # noqa: E731
        new_state = MultiStepsState(
            mini_step=torch.remainder(state.mini_step + 1, every_k),
            gradient_step=state.gradient_step + emit.to(state.gradient_step.dtype),
            inner_opt_state=tree.map(keep, inner_state, state.inner_opt_state),
            acc_grads=tree.map(lambda a: torch.where(emit, torch.zeros_like(a), a), acc),
            acc_weight=torch.where(emit, torch.zeros_like(total), total),
        )
        return tree.map(lambda u: torch.where(emit, u, torch.zeros_like(u)), inner_updates), new_state

    return Transform(init, update)
