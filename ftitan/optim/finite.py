"""``apply_if_finite``: skip updates whose gradients hold a NaN or an inf (optax's), and say where they began."""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch
from torch.distributed.tensor import DTensor

from ftitan import tree
from ftitan.optim.transform import Params, State, Transform, Updates, state_device

__all__ = ["ApplyIfFiniteState", "all_finite", "apply_if_finite", "find_finite_guard", "nonfinite_counts",
           "nonfinite_leaves"]


class ApplyIfFiniteState(NamedTuple):
    notfinite_count: torch.Tensor  # () int64: consecutive non-finite gradients, reset by a finite one
    last_finite: torch.Tensor  # () bool: whether the last gradients were finite
    total_notfinite: torch.Tensor  # () int64: non-finite gradients seen in all
    inner_state: State  # the inner transform's state, unchanged by a skipped update
    # ftitan's additions (optax has none), so a trainer that reads the state now and then can say what happened:
    count: torch.Tensor  # () int64: gradients seen; the latest is number ``count`` (1-based)
    bad_step: torch.Tensor  # () int64: number of the first gradient of the latest non-finite run (0: none yet)
    bad_leaf: torch.Tensor  # () int64: its first non-finite leaf, in tree.leaves order (-1: none, or unknown)
    halted: torch.Tensor  # () bool: ``halt=True`` and a run passed max_consecutive_errors; no update since


def all_finite(t: Updates) -> torch.Tensor:
    """A 0-d bool tensor: every element of every tensor leaf is finite (True for no leaves)."""
    whole = tree.whole_of(t, "nonfinite")  # inside tree.as_part_of: the whole tree's verdict
    if whole is not None:
        return ~whole.any()
    flags = [torch.isfinite(x).all() for x in tree.leaves(t) if tree.is_tensor(x)]
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool)


def nonfinite_leaves(t: Updates) -> torch.Tensor:
    """``(n_leaves,)`` bool, a plain tensor: which tensor leaves (``tree.leaves`` order) hold a NaN or an inf.

    DTensor leaves are judged whole, so every rank gets the same answer: each leaf's count of
    non-finite elements is a partial sum over its shards (a replicated leaf's is whole), and the
    stacked counts are combined at once, the way ``tree.global_norm`` combines squares.
    """
    whole = tree.whole_of(t, "nonfinite")  # inside tree.as_part_of: the whole tree's flags
    if whole is not None:
        return whole
    counts = nonfinite_counts([x for x in tree.leaves(t) if tree.is_tensor(x)])
    if not counts:
        return torch.zeros(0, dtype=torch.bool)
    stacked = torch.stack(counts)
    if isinstance(stacked, DTensor):
        stacked = stacked.full_tensor()
    return stacked > 0


def nonfinite_counts(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's count of NaN and inf elements (0-d int64): what :func:`nonfinite_leaves` flags."""
    return [(~torch.isfinite(x)).sum() for x in xs]


def _agreed(finite: torch.Tensor) -> torch.Tensor:
    # inside tree.norm_across (pipeline stages, each holding part of the tree) global_norm combines every
    # stage's sum of squares: a NaN marker from any stage makes every stage see this step as non-finite
    marker = torch.where(finite, 0.0, torch.nan).to(torch.float32)
    return torch.isfinite(tree.global_norm({"finite": marker}))


def apply_if_finite(inner: Transform, max_consecutive_errors: int, *, halt: bool = False) -> Transform:
    """Applies ``inner`` only when the incoming gradients are all finite.

    A non-finite gradient gives zero updates and leaves ``inner``'s state as
    it was; ``notfinite_count`` counts such gradients in a row,
    ``total_notfinite`` in all. After more than ``max_consecutive_errors`` in
    a row the update is applied anyway (optax's semantics: the run is
    broken, so stop hiding it). Both branches are computed and selected with
    ``torch.where``: no data-dependent branch under ``torch.compile``.
    optax: ``optax.apply_if_finite``.

    ``halt=True``: where optax would apply a non-finite update, halt
    instead: ``halted`` turns True and no update is applied from then on,
    so the params stay the last finite ones until the caller, reading the
    state when it likes (a trainer on its record steps), stops the run.
    ``halt=True, max_consecutive_errors=0`` halts at the first non-finite
    gradient. The state also records where the latest run of non-finite
    gradients began (``bad_step``, ``bad_leaf``; frozen once halted): map
    ``bad_leaf`` to a dotted path with ``tree.flatten_with_paths`` of the
    gradients' tree. Gradients that are DTensors are judged whole, so every
    rank agrees; inside ``tree.norm_across`` (pipeline stages, each holding
    part of the tree) the verdict is combined across stages too, and
    ``bad_leaf`` stays -1 (every process must hold the same state).
    """
    if not isinstance(inner, Transform):
        raise TypeError(f"apply_if_finite: inner is a {type(inner).__name__}, not a Transform")
    n = max_consecutive_errors
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"max_consecutive_errors={max_consecutive_errors!r}: expected an int >= 0")
    if not isinstance(halt, bool):
        raise TypeError(f"apply_if_finite: halt={halt!r}, expected a bool")

    def init(params: Params) -> ApplyIfFiniteState:
        device = state_device(params)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        finite = torch.ones((), dtype=torch.bool, device=device)
        return ApplyIfFiniteState(zero, finite, zero.clone(), inner.init(params), zero.clone(), zero.clone(),
                                  torch.full((), -1, dtype=torch.int64, device=device), ~finite)  # fmt: skip

    def update(
        grads: Updates, state: ApplyIfFiniteState, params: Params | None = None
    ) -> tuple[Updates, ApplyIfFiniteState]:
        device = state.last_finite.device
        bad_leaves = nonfinite_leaves(grads).to(device)  # (n_leaves,)
        finite = _agreed(~bad_leaves.any()).to(device)
        bad = (~finite).to(torch.int64)
        notfinite_count = (state.notfinite_count + 1) * bad  # 0 after a finite gradient
        over = notfinite_count > max_consecutive_errors
        halted = (state.halted | over) if halt else state.halted  # halt: where optax would give in, stop
        apply = (finite & ~halted) if halt else (finite | over)
        updates, inner_state = inner.update(grads, state.inner_state, params)
        updates = tree.map(lambda u: torch.where(apply, u, torch.zeros_like(u)), updates)
        inner_state = tree.map(lambda new, old: torch.where(apply, new, old), inner_state, state.inner_state)
        count = state.count + 1
        begins = (~finite) & (state.notfinite_count == 0) & ~state.halted  # a run of non-finite gradients begins
        if bad_leaves.numel() and not tree.norm_is_combined():
            first = torch.where(bad_leaves.any(), torch.argmax(bad_leaves.to(torch.int32)), -1)
        else:  # no leaves; or pipeline stages, each seeing its part: the state must agree, so no index
            first = torch.full((), -1, dtype=torch.int64, device=device)
        bad_step = torch.where(begins, count, state.bad_step)
        bad_leaf = torch.where(begins, first.to(torch.int64), state.bad_leaf)
        new = ApplyIfFiniteState(notfinite_count, finite, state.total_notfinite + bad, inner_state, count, bad_step,
                                 bad_leaf, halted)  # fmt: skip
        return updates, new

    return Transform(init, update, leafwise=inner.leafwise)


def find_finite_guard(opt_state: State) -> ApplyIfFiniteState | None:
    """The outermost :class:`ApplyIfFiniteState` in an optimizer state tree (``None`` when there is none)."""
    if isinstance(opt_state, ApplyIfFiniteState):
        return opt_state
    is_guard = lambda x: isinstance(x, ApplyIfFiniteState)  # noqa: E731
    found = [s for s in optree.tree_leaves(opt_state, is_leaf=is_guard, namespace=tree.NAMESPACE) if is_guard(s)]
    return found[0] if found else None
