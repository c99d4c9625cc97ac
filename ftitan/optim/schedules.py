"""Learning-rate schedules: pure functions of a 0-d int64 step tensor.

A schedule maps the step (the number of updates already applied, starting
at 0) to a 0-d float32 tensor. It is built from tensor ops only, with no
Python branching on the step, so a compiled train step calls it with the
step as a graph input and never recompiles as the learning rate moves.

Warmup is linear from 0 (``lr(0) = 0``, ``lr(warmup) = peak``), as in
optax's ``warmup_cosine_decay_schedule``; ``total`` counts the warmup steps.

>>> import torch
>>> lr = warmup_cosine(1.0, warmup=10, total=110)
>>> [round(lr(torch.tensor(s)).item(), 4) for s in (0, 5, 10, 60, 110, 500)]
[0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = [
    "Schedule",
    "constant",
    "cosine_decay",
    "linear_warmup",
    "warmup_cosine",
    "warmup_stable_decay",
]

Schedule = Callable[[torch.Tensor], torch.Tensor]
"""``step (0-d int64) -> lr (0-d float32)``."""


def _check_value(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: expected a finite number")
    return float(value)


def _check_steps(name: str, value: int, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    return value


def _float(step: torch.Tensor) -> torch.Tensor:
    # float32 is exact for steps below 2**24 (16.7M), far past any run here
    return step.to(torch.float32)


def _warmup_factor(step: torch.Tensor, warmup: int) -> torch.Tensor:
    """``min(step / warmup, 1)``; 1 everywhere when ``warmup == 0``."""
    if warmup == 0:
        return torch.ones_like(_float(step))
    return torch.clamp(_float(step) / warmup, max=1.0)


def _cosine(progress: torch.Tensor, peak: float, final: float) -> torch.Tensor:
    """Half cosine from ``peak`` (progress 0) to ``final`` (progress >= 1)."""
    progress = torch.clamp(progress, 0.0, 1.0)
    return final + (peak - final) * 0.5 * (1.0 + torch.cos(math.pi * progress))


def constant(value: float) -> Schedule:
    """``lr(step) = value``."""
    value = _check_value("value", value)

    def schedule(step: torch.Tensor) -> torch.Tensor:
        return torch.full((), value, dtype=torch.float32, device=step.device)

    return schedule


def linear_warmup(peak: float, warmup: int) -> Schedule:
    """``peak * min(step / warmup, 1)``: linear from 0 to ``peak``, then constant."""
    peak = _check_value("peak", peak)
    warmup = _check_steps("warmup", warmup, minimum=0)

    def schedule(step: torch.Tensor) -> torch.Tensor:
        return peak * _warmup_factor(step, warmup)

    return schedule


def cosine_decay(peak: float, total: int, final: float = 0.0) -> Schedule:
    """Cosine from ``peak`` at step 0 to ``final`` at ``total``, then ``final``.

    SGDR: Loshchilov & Hutter 2017 (without restarts).
    """
    peak = _check_value("peak", peak)
    final = _check_value("final", final)
    total = _check_steps("total", total, minimum=1)

    def schedule(step: torch.Tensor) -> torch.Tensor:
        return _cosine(_float(step) / total, peak, final)

    return schedule


def warmup_cosine(peak: float, warmup: int, total: int, final: float = 0.0) -> Schedule:
    """Linear warmup to ``peak`` over ``warmup`` steps, cosine to ``final`` at ``total``.

    ``total`` includes the warmup; after ``total`` the value stays ``final``.
    """
    peak = _check_value("peak", peak)
    final = _check_value("final", final)
    warmup = _check_steps("warmup", warmup, minimum=0)
    total = _check_steps("total", total, minimum=1)
    if warmup >= total:
        raise ValueError(f"warmup={warmup} must be < total={total}: total counts the warmup steps")

    def schedule(step: torch.Tensor) -> torch.Tensor:
        decay = _cosine((_float(step) - warmup) / (total - warmup), peak, final)
        return torch.where(step < warmup, peak * _warmup_factor(step, warmup), decay)

    return schedule


def warmup_stable_decay(
    peak: float, warmup: int, total: int, decay_fraction: float = 0.2, final: float = 0.0
) -> Schedule:
    """Warmup-stable-decay (WSD): linear warmup, constant ``peak``, linear decay.

    The last ``round(decay_fraction * total)`` steps decay linearly to
    ``final`` (reached at ``total`` and kept after). MiniCPM: Hu et al. 2024;
    Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond
    Fixed Training Durations".
    """
    peak = _check_value("peak", peak)
    final = _check_value("final", final)
    warmup = _check_steps("warmup", warmup, minimum=0)
    total = _check_steps("total", total, minimum=1)
    decay_fraction = _check_value("decay_fraction", decay_fraction)
    if not 0.0 <= decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction={decay_fraction}: expected a fraction of total in [0, 1]")
    decay = round(decay_fraction * total)
    if warmup + decay > total:
        raise ValueError(
            f"warmup={warmup} + decay steps {decay} (decay_fraction={decay_fraction} * total={total}) "
            f"exceed total={total}; shorten the warmup or the decay"
        )
    decay_start = total - decay

    def schedule(step: torch.Tensor) -> torch.Tensor:
        stable = peak * _warmup_factor(step, warmup)
        if decay == 0:
            return stable
        progress = torch.clamp((_float(step) - decay_start) / decay, 0.0, 1.0)
        return torch.where(step < decay_start, stable, peak + (final - peak) * progress)

    return schedule
