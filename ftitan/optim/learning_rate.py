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
from ftitan.optim.hyperparams import LR_NAMES, InjectHyperparamsState
from ftitan.optim.schedules import Schedule
from ftitan.optim.transform import Params, Transform, Updates, scalar_dtype, state_device

__all__ = [
    "ScaleByLearningRateState",
    "current_lr",
    "find_lr",
    "learning_rates",
    "scale_by_learning_rate",
]


class ScaleByLearningRateState(NamedTuple):
    step: torch.Tensor  # () int64: updates applied so far
    lr: torch.Tensor  # () float32 (float64 for float64 params): see scale_by_learning_rate


def scale_by_learning_rate(lr: float | torch.Tensor | Schedule) -> Transform:
    """Multiplies the updates by ``-lr`` (descent), ``lr`` a float, a 0-d tensor or a schedule.

    The state's ``lr`` is what the update uses:

    - a float lr is stored in the state at init and *read from it* by every
      update, so editing it between steps (``state._replace(lr=...)``, or
      :func:`~ftitan.optim.set_hyperparams` under ``inject_hyperparams``)
      changes the step; ``lr = 0`` stops the params. Its dtype is float64
      when any param is float64 (float64 updates are scaled exactly), else
      float32; a 0-d lr tensor does not promote the updates' dtype.
    - a schedule is called with ``state.step`` (0 for the first update); the
      state records the value it returned (before any update: the first
      one's), so an edit of ``lr`` is overwritten. Shift a schedule by
      editing ``step``, or make it editable with ``inject_hyperparams``.
    - a 0-d tensor (what ``inject_hyperparams`` passes) is used as it is and
      recorded in the state.
    """
    if isinstance(lr, bool) or not (isinstance(lr, (int, float, torch.Tensor)) or callable(lr)):
        raise TypeError(f"lr={lr!r}: expected a float, a 0-d tensor or a schedule (step tensor -> lr tensor)")
    if isinstance(lr, torch.Tensor) and lr.ndim != 0:
        raise ValueError(f"lr: expected a 0-d tensor, got shape {tuple(lr.shape)}")
    schedule: Schedule | None = lr if callable(lr) and not isinstance(lr, torch.Tensor) else None

    def init(params: Params) -> ScaleByLearningRateState:
        step = torch.zeros((), dtype=torch.int64, device=state_device(params))
        dtype = scalar_dtype(params)
        if schedule is not None:
            value = schedule(step).to(dtype)
        elif isinstance(lr, torch.Tensor):
            value = lr.to(device=step.device, dtype=dtype)
        else:
            value = torch.full((), float(lr), dtype=dtype, device=step.device)  # type: ignore[arg-type]
        return ScaleByLearningRateState(step=step, lr=value)

    def update(
        grads: Updates, state: ScaleByLearningRateState, params: Params | None = None
    ) -> tuple[Updates, ScaleByLearningRateState]:
        del params
        if schedule is not None:
            step_lr = schedule(state.step).to(state.lr.dtype)
        elif isinstance(lr, torch.Tensor):
            step_lr = lr
        else:
            step_lr = state.lr  # the state is the lr: an edit between steps takes effect
        factor = -step_lr
        updates = tree.map(lambda g: g * factor, grads)
        return updates, ScaleByLearningRateState(step=state.step + 1, lr=step_lr.to(state.lr.dtype))

    return Transform(init, update, leafwise=True)


def learning_rates(opt_state: Any) -> dict[str, torch.Tensor]:
    """Every learning rate in an optimizer state, by its dotted path in that state.

    Found in :class:`ScaleByLearningRateState` entries and in the ``lr`` /
    ``learning_rate`` hyperparameters of :func:`~ftitan.optim.inject_hyperparams`
    states. Paths index NamedTuple fields and chain entries by position and
    multi_transform states by label.

    >>> import torch, ftitan.optim as fo
    >>> opt = fo.multi_transform({"a": fo.sgd(0.1), "b": fo.sgd(0.2)}, lambda path, x: path)
    >>> sorted(fo.learning_rates(opt.init({"a": torch.ones(1), "b": torch.ones(1)})))
    ['0.a.2', '0.b.2']
    """
    found = optree.tree_flatten_with_path(
        opt_state,
        is_leaf=lambda x: isinstance(x, (ScaleByLearningRateState, InjectHyperparamsState)),
        namespace=tree.NAMESPACE,
    )
    paths, leaves = found[0], found[1]
    out: dict[str, torch.Tensor] = {}
    for p, s in zip(paths, leaves, strict=True):
        where = ".".join(str(k) for k in p)
        if isinstance(s, ScaleByLearningRateState):
            out[where] = s.lr
        elif isinstance(s, InjectHyperparamsState):
            for field in ("hyperparams", "scheduled"):
                for name in LR_NAMES:
                    if name in getattr(s, field):
                        out[f"{where}.{field}.{name}"] = getattr(s, field)[name]
            for sub, lr in learning_rates(s.inner_state).items():
                out[f"{where}.inner_state.{sub}"] = lr
    return out


def find_lr(opt_state: Any) -> torch.Tensor | None:
    """The first learning rate in ``opt_state`` (tree order), or ``None`` when it has no
    learning-rate stage (e.g. ``chain(scale_by_adam(), scale(-1e-3))``)."""
    return next(iter(learning_rates(opt_state).values()), None)


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
