"""Momentum and SGD.

Heavy-ball momentum: Polyak 1964; Nesterov momentum in the form of
Sutskever et al. 2013, "On the importance of initialization and momentum in
deep learning", as torch.optim.SGD implements it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ftitan import tree
from ftitan.optim.learning_rate import scale_by_learning_rate
from ftitan.optim.schedules import Schedule
from ftitan.optim.transform import Params, Transform, Updates, accumulator_dtype, chain, identity
from ftitan.optim.weight_decay import add_decayed_weights

__all__ = ["TraceState", "sgd", "trace"]


class TraceState(NamedTuple):
    trace: Params  # momentum buffers, float32 (float64 for float64 params)


def trace(momentum: float | torch.Tensor, nesterov: bool = False) -> Transform:
    """Momentum ``t = momentum * t + g``; the update is ``t``, or ``g + momentum * t`` (Nesterov).

    The same arithmetic as torch.optim.SGD with ``dampening=0`` (its first
    step's ``t = g`` equals ``momentum * 0 + g``). Buffers are float32 (float64
    for float64 params); updates come back in the gradient dtype. ``momentum``
    may be a 0-d tensor (:func:`~ftitan.optim.inject_hyperparams`).
    """
    injected = isinstance(momentum, torch.Tensor)
    if not injected:
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or momentum < 0:
            raise ValueError(f"momentum={momentum!r}: expected a float >= 0")
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")

    def add(g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # g + momentum * t, in t's dtype
        if injected:
            return g.to(t.dtype) + momentum.to(t.dtype) * t  # type: ignore[union-attr]
        return torch.add(g.to(t.dtype), t, alpha=momentum)

    def init(params: Params) -> TraceState:
        return TraceState(trace=tree.map(lambda p: torch.zeros_like(p, dtype=accumulator_dtype(p)), params))

    def update(grads: Updates, state: TraceState, params: Params | None = None) -> tuple[Updates, TraceState]:
        del params
        new = tree.map(lambda t, g: add(g, t), state.trace, grads)
        if nesterov:
            updates = tree.map(lambda t, g: add(g, t).to(g.dtype), new, grads)
        else:
            updates = tree.map(lambda t, g: t.to(g.dtype), new, grads)
        return updates, TraceState(trace=new)

    return Transform(init, update, leafwise=True)


def sgd(
    lr: float | torch.Tensor | Schedule,
    momentum: float | torch.Tensor = 0.0,
    nesterov: bool = False,
    weight_decay: float | torch.Tensor = 0.0,
) -> Transform:
    """Stochastic gradient descent with torch.optim.SGD's semantics.

    ``chain(add_decayed_weights, trace, scale_by_learning_rate)``: the decay
    is coupled (L2, added to the gradient before momentum) as in torch. An
    injected (tensor) momentum always keeps a trace buffer.
    """
    with_trace = isinstance(momentum, torch.Tensor) or momentum > 0 or nesterov
    return chain(
        add_decayed_weights(weight_decay),
        trace(momentum, nesterov) if with_trace else identity(),
        scale_by_learning_rate(lr),
    )
