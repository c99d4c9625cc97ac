"""Gradient transformations: the ``(init, update)`` pair and its composition.

An optimizer is a :class:`Transform`, a pair of pure functions (optax's
``GradientTransformation``, Babuschkin et al. 2020, "The DeepMind JAX
Ecosystem"):

- ``init(params) -> state``
- ``update(grads, state, params=None) -> (updates, new_state)``

``updates`` are *added* to the params (:func:`apply_updates`), so a
descent step carries a negative learning rate. States are NamedTuples of
tensors and trees, never Python numbers that change, so a compiled step
(``torch.compile(fullgraph=True)``) sees the same graph every step.

>>> import torch, ftitan.optim as fo
>>> opt = fo.chain(fo.clip_by_global_norm(1.0), fo.sgd(0.1))
>>> params = {"w": torch.ones(2)}
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
>>> fo.apply_updates(params, updates)["w"]
tensor([0.9293, 0.9293])
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from ftitan import tree

__all__ = [
    "EmptyState",
    "InitFn",
    "Transform",
    "UpdateFn",
    "accumulator_dtype",
    "apply_updates",
    "chain",
    "identity",
    "scalar_dtype",
    "scale",
    "set_to_zero",
    "state_device",
]

Params = Any  # tree of tensors
Updates = Any  # tree of tensors, same structure as the params
State = Any  # tree of NamedTuples of tensors


class InitFn(Protocol):
    def __call__(self, params: Params) -> State: ...


class UpdateFn(Protocol):
    def __call__(self, grads: Updates, state: State, params: Params | None = None) -> tuple[Updates, State]: ...


class Transform(NamedTuple):
    """An optimizer or a piece of one: ``init(params)`` and ``update(grads, state, params)``.

    ``leafwise``: ``update`` computes each leaf's update and state from that leaf's gradient, state and
    param and the state's scalars (step counts, learning rates) alone, reading the whole tree only through
    ``tree.global_norm`` / ``optim.nonfinite_leaves`` of the gradients it was given (clipping, the
    non-finite guard). Run on one part of the tree inside ``tree.as_part_of`` it then gives that part of
    the whole update, so ``make_train_step(update_backend=...)`` compiles the update once per layer and
    reuses it (``ftitan.train.regional``). ``False`` (the default) is always safe; :func:`chain` is
    leafwise when all its transforms are; path masks and routing (``masked``, ``multi_transform``, Muon)
    are not.
    """

    init: InitFn
    update: UpdateFn
    leafwise: bool = False


class EmptyState(NamedTuple):
    """State of a stateless transform."""


def state_device(params: Params) -> torch.device:
    """Device for scalar state (step counts): that of the first tensor leaf, else CPU."""
    for x in tree.leaves(params):
        if tree.is_tensor(x):
            return x.device
    return torch.device("cpu")


def scalar_dtype(params: Params) -> torch.dtype:
    """Dtype of 0-d hyperparameter state (learning rates, injected values): float64 if any
    leaf is float64 (so float64 updates are scaled exactly), else float32."""
    if any(tree.is_tensor(x) and x.dtype == torch.float64 for x in tree.leaves(params)):
        return torch.float64
    return torch.float32


def accumulator_dtype(x: torch.Tensor) -> torch.dtype:
    """Dtype for optimizer statistics of ``x``: float32, or float64 for float64 params.

    Low-precision (bf16/fp16) params keep float32 moments: their updates are
    far below bf16 resolution of the statistics otherwise.
    """
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def identity() -> Transform:
    """Passes the updates through unchanged."""

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        del params
        return grads, state

    return Transform(init, update, leafwise=True)


def chain(*transforms: Transform) -> Transform:
    """Applies ``transforms`` in order; the state is the tuple of their states.

    Each transform sees the previous one's updates as its ``grads`` and the
    same ``params``.
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            raise TypeError(f"chain(): argument {i} is a {type(t).__name__}, not a Transform")

    def init(params: Params) -> tuple[State, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(
        grads: Updates, state: tuple[State, ...], params: Params | None = None
    ) -> tuple[Updates, tuple[State, ...]]:
        if len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transforms got a state of {len(state)} entries; "
                "was the state made by this chain's init?"
            )
        new_states = []
        for t, s in zip(transforms, state, strict=True):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        return grads, tuple(new_states)

    return Transform(init, update, leafwise=all(t.leafwise for t in transforms))


def set_to_zero() -> Transform:
    """Replaces every update by zeros (optax's ``set_to_zero``); allocates no state.

    Route leaves to it with :func:`~ftitan.optim.multi_transform`, or use
    :func:`~ftitan.optim.selective_transform` / :func:`~ftitan.optim.freeze`.
    """

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        del params
        return tree.map(torch.zeros_like, grads), state

    return Transform(init, update, leafwise=True)


def scale(factor: float | torch.Tensor) -> Transform:
    """Multiplies the updates by ``factor`` (a float, or a 0-d tensor under ``inject_hyperparams``)."""

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        del params
        return tree.map(lambda g: g * factor, grads), state

    return Transform(init, update, leafwise=True)


def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates`` leafwise, in each param's dtype (one rounding for low precision)."""

    def add(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return (p + u).to(p.dtype)

    return tree.map(add, params, updates)
