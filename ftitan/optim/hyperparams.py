"""Editable hyperparameters: optax's ``inject_hyperparams``.

``inject_hyperparams(factory)(lr=..., weight_decay=..., b1=...)`` builds the
optimizer ``factory(**hyperparams)`` with every float hyperparameter stored
in the state as a 0-d tensor, and rebuilds it from the state at each update,
so the update reads the stored values. Edit them between steps with
:func:`set_hyperparams` (same dtype and device, so a compiled step does not
recompile). A schedule is evaluated at the state's ``count`` each update and
its value recorded under ``scheduled`` (editing it would be overwritten, so
:func:`set_hyperparams` refuses).

>>> import torch, ftitan.optim as fo
>>> opt = fo.inject_hyperparams(fo.adamw)(lr=1e-3, weight_decay=0.1)
>>> params = {"w": torch.ones(2)}
>>> state = fo.set_hyperparams(opt.init(params), lr=0.0)
>>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
>>> updates["w"].tolist(), float(state.hyperparams["lr"])
([-0.0, -0.0], 0.0)

The factory's pieces must accept 0-d tensors for the injected names; in
ftitan.optim they all do (learning rates, betas, eps, eps_root, weight
decay, momentum, clipping norm, scale factors).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import optree
import torch

from ftitan import tree
from ftitan.optim.transform import Params, Transform, Updates, scalar_dtype, state_device

__all__ = ["LR_NAMES", "InjectHyperparamsState", "inject_hyperparams", "set_hyperparams"]

LR_NAMES = ("lr", "learning_rate")
"""Hyperparameter names reported as learning rates (``learning_rates``, ``metrics["lr"]``)."""


class InjectHyperparamsState(NamedTuple):
    count: torch.Tensor  # () int64: updates applied so far (the schedules' step)
    hyperparams: dict[str, torch.Tensor]  # editable values: float hyperparameters as 0-d tensors
    scheduled: dict[str, torch.Tensor]  # scheduled hyperparameters: the value of the last update
    inner_state: Any  # the state of factory(**hyperparams)


def _is_schedule(x: Any) -> bool:
    return callable(x) and not isinstance(x, (torch.Tensor, type))


def inject_hyperparams(
    factory: Callable[..., Transform], *, static_args: Collection[str] = ()
) -> Callable[..., Transform]:
    """Wraps an optimizer factory so its float and scheduled keyword arguments live in the state.

    ``inject_hyperparams(factory)(*args, **kwargs)``: each keyword argument
    that is a float (not a bool) becomes an editable 0-d tensor in
    ``state.hyperparams`` (float64 if any param is float64, else float32);
    each that is a schedule (a callable not named in ``static_args``) is
    evaluated at ``state.count`` every update, its value kept in
    ``state.scheduled``. Positional arguments, ints, bools, strings and
    names in ``static_args`` are passed through unchanged. optax:
    ``optax.inject_hyperparams``.
    """
    static = frozenset(static_args)

    def build(*args: Any, **kwargs: Any) -> Transform:
        editable = {
            k: float(v)
            for k, v in kwargs.items()
            if k not in static and isinstance(v, float) and not isinstance(v, bool)
        }
        schedules = {k: v for k, v in kwargs.items() if k not in static and _is_schedule(v)}
        fixed = {k: v for k, v in kwargs.items() if k not in editable and k not in schedules}

        def values(count: torch.Tensor, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: s(count).to(device=count.device, dtype=_dtype(stored)) for k, s in schedules.items()}

        def init(params: Params) -> InjectHyperparamsState:
            device, dtype = state_device(params), scalar_dtype(params)
            count = torch.zeros((), dtype=torch.int64, device=device)
            hyper = {k: torch.full((), v, dtype=dtype, device=device) for k, v in editable.items()}
            scheduled = {k: s(count).to(device=device, dtype=dtype) for k, s in schedules.items()}
            inner = factory(*args, **fixed, **hyper, **scheduled)
            return InjectHyperparamsState(count, hyper, scheduled, inner.init(params))

        def update(
            grads: Updates, state: InjectHyperparamsState, params: Params | None = None
        ) -> tuple[Updates, InjectHyperparamsState]:
            scheduled = values(state.count, state.hyperparams | state.scheduled)
            inner = factory(*args, **fixed, **state.hyperparams, **scheduled)
            updates, inner_state = inner.update(grads, state.inner_state, params)
            return updates, InjectHyperparamsState(state.count + 1, state.hyperparams, scheduled, inner_state)

        return Transform(init, update)

    return build


def _dtype(stored: dict[str, torch.Tensor]) -> torch.dtype:
    return next(iter(stored.values())).dtype


def set_hyperparams(opt_state: Any, *, label: str | None = None, **values: float | torch.Tensor) -> Any:
    """``opt_state`` with the named injected hyperparameters set, e.g. ``set_hyperparams(s, lr=0.0)``.

    Every :class:`InjectHyperparamsState` in ``opt_state`` that has the name
    is edited (``label`` restricts to those whose path in the state has that
    component, e.g. a ``multi_transform`` label). New values keep the old
    tensors' dtype and device, so a compiled step does not recompile. Raises
    for a name no injected state holds, and for a scheduled one.
    """
    paths, leaves, treedef = optree.tree_flatten_with_path(
        opt_state, is_leaf=lambda x: isinstance(x, InjectHyperparamsState), namespace=tree.NAMESPACE
    )
    touched: set[str] = set()
    out = []
    for path, leaf in zip(paths, leaves, strict=True):
        parts = [str(k) for k in path]
        if not isinstance(leaf, InjectHyperparamsState) or (label is not None and label not in parts):
            out.append(leaf)
            continue
        for name in values:
            if name in leaf.scheduled:
                raise ValueError(
                    f"set_hyperparams: {name!r} is scheduled (at {'.'.join(parts) or 'the root'}); its value is "
                    "recomputed every update. Pass a float for it to inject_hyperparams to make it editable"
                )
        hyper = dict(leaf.hyperparams)
        for name, value in values.items():
            if name in hyper:
                old = hyper[name]
                # a Python float goes straight to the stored dtype (no float32 detour)
                hyper[name] = torch.as_tensor(value, dtype=old.dtype).to(device=old.device).reshape(())
                touched.add(name)
        out.append(leaf._replace(hyperparams=hyper))
    missing = sorted(set(values) - touched)
    if missing:
        known = sorted({k for x in leaves if isinstance(x, InjectHyperparamsState) for k in x.hyperparams})
        where = f" under label {label!r}" if label is not None else ""
        raise ValueError(
            f"set_hyperparams: no injected hyperparameter {missing}{where}; editable ones: {known}. "
            "Build the optimizer with inject_hyperparams(factory)(name=float, ...)"
        )
    return optree.tree_unflatten(treedef, out)
