"""The trainer's side of the non-finite guard (``--optim.nonfinite``): read it now and then, stop with a name.

The guard itself is an optimizer transform (:func:`ftitan.optim.guard_nonfinite`,
around every run's optimizer): it decides on the device, inside the compiled
step, whether to skip an update, and records where the first non-finite
gradient of a run of them appeared. Nothing here runs per step. The trainer
calls :func:`read` on record steps and before each checkpoint (one read back
of a few integers) and :meth:`GuardReading.check` turns a halted guard, or
params that are not finite where a checkpoint would save them, into a
:class:`~ftitan.train.faults.RunFailure` naming the step and the leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ftitan import tree as T
from ftitan.optim.finite import find_finite_guard, nonfinite_leaves
from ftitan.train.faults import RunFailure, resume_hint

__all__ = ["GuardReading", "read"]


def _first(flags: torch.Tensor) -> torch.Tensor:
    """Index of the first True in a 1-d bool tensor, -1 when none (on the device: no branch)."""
    if not flags.numel():
        return torch.full((), -1, dtype=torch.int64)
    return torch.where(flags.any(), torch.argmax(flags.to(torch.int32)), -1).to(torch.int64)


def _tensor_paths(tree: Any) -> list[str]:
    paths, leaves, _ = T.flatten_with_paths(tree)
    return [p for p, x in zip(paths, leaves, strict=True) if T.is_tensor(x)]


class GuardReading(NamedTuple):
    """What the guard says, read back once. Steps count from 1 (the guard's own count of updates)."""

    nonfinite_steps: int  # steps whose gradients held a NaN or an inf, in all (skipped unless mode "off")
    halted: bool  # the guard stopped applying updates: the run must stop
    bad_step: int  # where the latest run of non-finite gradients began (0: none)
    bad_leaf: str | None  # its first non-finite gradient leaf (None: not known, under pipeline parallel)
    params_finite: bool  # read(..., params=True): every param of every rank is finite (else True)
    params_bad_leaf: str | None  # and this rank's first param that is not (None: another stage's)
    steps: int  # updates the guard has seen

    def metrics(self) -> dict[str, float]:
        """For the record of a record step."""
        return {"nonfinite_steps": float(self.nonfinite_steps)}

    def check(self, optim: Any, *, step: int, run_dir: Any = None, settle: Callable[[], None] | None = None) -> None:
        """Raise :class:`RunFailure` if the guard halted or (``read(params=True)``) a param is not finite.

        ``optim``: the run's ``OptimConfig`` (its ``nonfinite`` and ``max_nonfinite`` go into the message);
        ``step``: the trainer's step now; ``run_dir``: the ``RunDir`` whose newest checkpoint to resume
        from; ``settle``: called first when failing (e.g. a checkpointer's ``wait``: the save in flight,
        of an earlier, finite state, is committed before the message names the newest checkpoint).
        """
        if not self.halted and self.params_finite:
            return
        if settle is not None:
            try:
                settle()
            except Exception:  # noqa: BLE001 - the stop is the news; a failed save only shows in the hint
                pass
        fix = "lower --optim.lr (or --model.init-std), or check the data"
        fix = f"{fix}, then {resume_hint(run_dir)}" if run_dir is not None else fix
        if self.halted:
            where = self.bad_leaf or "a leaf (not named under pipeline parallel)"
            if optim.nonfinite == "skip" and optim.max_nonfinite > 1:
                last = self.bad_step + optim.max_nonfinite - 1
                what = (f"steps {self.bad_step}-{last} all had NaN or inf gradients (--optim.max-nonfinite "
                        f"{optim.max_nonfinite}), the first in {where} at step {self.bad_step}")  # fmt: skip
            else:
                what = f"step {self.bad_step}: the gradient of {where} holds a NaN or an inf"
            raise RunFailure(f"{what}; stopped at step {step} (--optim.nonfinite {optim.nonfinite}) with the params "
                             f"from before step {self.bad_step}, no update applied since; {fix}")  # fmt: skip
        where = self.params_bad_leaf or "of another pipeline stage"
        raise RunFailure(f"step {step}: param {where} holds a NaN or an inf; no checkpoint is saved of it "
                         f"(--optim.nonfinite {optim.nonfinite}); {fix}")  # fmt: skip


def read(state: Any, *, params: bool = False) -> GuardReading:
    """The guard in ``state.opt_state`` read back (one host read); ``params=True`` also checks that every
    param is finite (on the device, in the same read): what to do before saving a checkpoint. Under
    torch.distributed, ``params=True`` is collective (one all-reduce of a flag: every rank calls it).

    Under a parallel layout every rank reads the same values (DTensors are judged whole). A state
    without a guard reads as a guard that never saw a non-finite gradient.
    """
    guard = find_finite_guard(state.opt_state)
    zero = torch.zeros((), dtype=torch.int64)
    if guard is None:
        fields = [zero, zero.bool(), zero, zero - 1, zero]
    else:
        fields = [guard.total_notfinite, guard.halted, guard.bad_step, guard.bad_leaf, guard.count]
    device = fields[0].device
    param_flags = nonfinite_leaves(state.params).to(device) if params else torch.zeros(0, dtype=torch.bool)
    any_bad = param_flags.any().to(torch.int64)
    if params and dist.is_available() and dist.is_initialized():  # pipeline stages hold different params:
        dist.all_reduce(any_bad, op=dist.ReduceOp.MAX)  # every rank stops, or none (all call this together)
    values = torch.stack([f.to(device=device, dtype=torch.int64) for f in (*fields, any_bad, _first(param_flags))])
    total, halted, bad_step, bad_leaf, count, params_bad, param_leaf = values.tolist()  # the one read back
    names = _tensor_paths(state.params) if bad_leaf >= 0 or param_leaf >= 0 else []
    return GuardReading(
        nonfinite_steps=total,
        halted=bool(halted),
        bad_step=bad_step,
        bad_leaf=names[bad_leaf] if 0 <= bad_leaf < len(names) else None,
        params_finite=not params_bad,
        params_bad_leaf=names[param_leaf] if 0 <= param_leaf < len(names) else None,
        steps=count,
    )
