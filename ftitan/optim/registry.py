"""Every named optimizer with sane defaults, for generic tests and recipes.

Each factory takes the learning rate (a float or a schedule) first and
returns a :class:`~ftitan.optim.Transform`. ``tests/optim/test_invariants.py``
runs every entry through the same checks (dtype kept, state structure
stable, chainable, compiled == eager without recompiles), so a new
optimizer added here gets them for free.
"""

from __future__ import annotations

from collections.abc import Callable

from ftitan.optim.adam import adam, adamw
from ftitan.optim.muon import muon
from ftitan.optim.muon_adamw import muon_with_adamw
from ftitan.optim.schedules import Schedule
from ftitan.optim.sgd import sgd
from ftitan.optim.transform import Transform

__all__ = ["MATRIX_ONLY", "OPTIMIZERS"]


def _sgd(lr: float | Schedule = 1e-2) -> Transform:
    return sgd(lr)


def _sgd_momentum(lr: float | Schedule = 1e-2) -> Transform:
    return sgd(lr, momentum=0.9, nesterov=True)


def _adam(lr: float | Schedule = 3e-4) -> Transform:
    return adam(lr)


def _adamw(lr: float | Schedule = 3e-4) -> Transform:
    return adamw(lr, weight_decay=0.1)


def _muon(lr: float | Schedule = 2e-2) -> Transform:
    return muon(lr)


def _muon_with_adamw(lr: float | Schedule = 1e-3) -> Transform:
    return muon_with_adamw(None, lr=lr, shape_scaling="match_rms_adamw")


OPTIMIZERS: dict[str, Callable[..., Transform]] = {
    "sgd": _sgd,
    "sgd-momentum": _sgd_momentum,
    "adam": _adam,
    "adamw": _adamw,
    "muon": _muon,
    "muon_with_adamw": _muon_with_adamw,
}
"""Optimizer name -> factory ``(lr) -> Transform``."""

MATRIX_ONLY = frozenset({"muon"})
"""Registry names that accept only matrices (ndim >= 2) as params."""
