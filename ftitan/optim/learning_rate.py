"""The learning-rate step: ``updates * -lr`` with ``lr`` a constant or a schedule.

The state holds the step (updates applied so far) and the last learning rate as 0-d tensors,
so a compiled train step takes both as graph inputs (no recompilation when
the schedule moves) and can report the lr it used (:func:`current_lr`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ftitan import tree
from ftitan.optim.schedules import Schedule
from ftitan.optim.transform import Params, Transform, Updates, state_device

__all__ = [
    "ScaleByLearningRateState",
    "current_lr",
    "learning_rates",
    "scale_by_learning_rate",
]


class ScaleByLearningRateState(NamedTuple):
    step: torch.Tensor  # () int64: updates applied so far
    lr: torch.Tensor  # () float32: the lr of the last update (before any: the first one's)


def scale_by_learning_rate(lr: float | Schedule) -> Transform:
    """Multiplies the updates by ``-lr`` (descent), ``lr`` a float or a schedule.

    A schedule is called with the number of updates applied so far (0 for the
    first update). A float lr multiplies as a Python float, so float64 updates
    are scaled exactly; a schedule's 0-d float32 tensor keeps the update dtype
    (a 0-d tensor does not promote a higher-dimensional one).
    """
    if isinstance(lr, bool) or not (isinstance(lr, (int, float)) or callable(lr)):
        raise TypeError(f"lr={lr!r}: expected a float or a schedule (step tensor -> lr tensor)")
    schedule: Schedule | None = lr if callable(lr) else None

    def lr_at(step: torch.Tensor) -> torch.Tensor:
        if schedule is None:
            return torch.full((), float(lr), dtype=torch.float32, device=step.device)  # type: ignore[arg-type]
        return schedule(step).to(torch.float32)

    def init(params: Params) -> ScaleByLearningRateState:
        step = torch.zeros((), dtype=torch.int64, device=state_device(params))
        return ScaleByLearningRateState(step=step, lr=lr_at(step))

    def update(
        grads: Updates, state: ScaleByLearningRateState, params: Params | None = None
    ) -> tuple[Updates, ScaleByLearningRateState]:
        del params
        if schedule is None:
            step_lr = state.lr
            factor: float | torch.Tensor = -float(lr)  # type: ignore[arg-type]
        else:
            step_lr = lr_at(state.step)
            factor = -step_lr
        updates = tree.map(lambda g: g * factor, grads)
        return updates, ScaleByLearningRateState(step=state.step + 1, lr=step_lr)

    return Transform(init, update)


def learning_rates(opt_state: Any) -> dict[str, torch.Tensor]:
    """Every learning rate in an optimizer state, by its dotted path in that state.

    Paths index NamedTuple fields and chain entries by position and
    multi_transform states by label.

    >>> import torch, ftitan.optim as fo
    >>> opt = fo.multi_transform({"a": fo.sgd(0.1), "b": fo.sgd(0.2)}, lambda path, x: path)
    >>> sorted(fo.learning_rates(opt.init({"a": torch.ones(1), "b": torch.ones(1)})))
    ['0.a.2', '0.b.2']
    """
    found = optree.tree_flatten_with_path(
        opt_state,
        is_leaf=lambda x: isinstance(x, ScaleByLearningRateState),
        namespace=tree.NAMESPACE,
    )
    paths, leaves = found[0], found[1]
    return {
        ".".join(str(k) for k in p): s.lr
        for p, s in zip(paths, leaves, strict=True)
        if isinstance(s, ScaleByLearningRateState)
    }


def current_lr(opt_state: Any, label: str | None = None) -> torch.Tensor:
    """The learning rate of the last update, found anywhere in ``opt_state``.

    With several (e.g. Muon and AdamW under ``multi_transform``), ``label``
    picks the one whose path in the state has that component (``"muon"``);
    without it the first in tree order is returned (labels sort
    alphabetically). Works inside a compiled step.
    """
    lrs = learning_rates(opt_state)
    if label is not None:
        lrs = {p: v for p, v in lrs.items() if label in p.split(".")}
    if not lrs:
        where = f" under label {label!r}" if label is not None else ""
        known = sorted(learning_rates(opt_state))
        raise ValueError(
            f"no scale_by_learning_rate state{where} in this optimizer state "
            f"(learning rates found at: {known}); build the optimizer with a learning rate"
        )
    return next(iter(lrs.values()))
