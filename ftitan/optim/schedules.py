"""Learning-rate schedules: pure functions of a 0-d int64 step tensor.

A schedule maps the step (the number of updates already applied, starting
at 0) to a 0-d float32 tensor. It is built from tensor ops only, with no
Python branching on the step, so a compiled train step calls it with the
step as a graph input and never recompiles as the learning rate moves.

Warmup is linear from ``init_value`` (0 by default: ``lr(0) = 0``,
``lr(warmup) = peak``), as in optax's ``warmup_cosine_decay_schedule``;
``total`` counts the warmup steps. The optax-named schedules
(:func:`polynomial`, :func:`linear`, :func:`exponential_decay`,
:func:`piecewise_constant`, :func:`join_schedules`) follow optax's
definitions; values are float32, within a few float32 roundings of optax's
float64 ones.

>>> import torch
>>> lr = warmup_cosine(1.0, warmup=10, total=110)
>>> [round(lr(torch.tensor(s)).item(), 4) for s in (0, 5, 10, 60, 110, 500)]
[0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "Schedule",
    "constant",
    "cosine_decay",
    "exponential_decay",
    "join_schedules",
    "linear",
    "linear_warmup",
    "piecewise_constant",
    "polynomial",
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


def _warmup(step: torch.Tensor, warmup: int, peak: float, init_value: float) -> torch.Tensor:
    """Linear from ``init_value`` at step 0 to ``peak`` at ``warmup``, then ``peak``."""
    if init_value == 0.0:  # the original form, kept bit for bit
        return peak * _warmup_factor(step, warmup)
    return init_value + (peak - init_value) * _warmup_factor(step, warmup)


def linear_warmup(peak: float, warmup: int, init_value: float = 0.0) -> Schedule:
    """Linear from ``init_value`` (step 0) to ``peak`` (step ``warmup``), then constant ``peak``."""
    peak = _check_value("peak", peak)
    init_value = _check_value("init_value", init_value)
    warmup = _check_steps("warmup", warmup, minimum=0)

    def schedule(step: torch.Tensor) -> torch.Tensor:
        return _warmup(step, warmup, peak, init_value)

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


def warmup_cosine(peak: float, warmup: int, total: int, final: float = 0.0, init_value: float = 0.0) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak`` over ``warmup`` steps, cosine to ``final`` at ``total``.

    ``total`` includes the warmup; after ``total`` the value stays ``final``.
    optax: ``warmup_cosine_decay_schedule(init_value, peak, warmup, total, final)``.
    """
    peak = _check_value("peak", peak)
    init_value = _check_value("init_value", init_value)
    final = _check_value("final", final)
    warmup = _check_steps("warmup", warmup, minimum=0)
    total = _check_steps("total", total, minimum=1)
    if warmup >= total:
        raise ValueError(f"warmup={warmup} must be < total={total}: total counts the warmup steps")

    def schedule(step: torch.Tensor) -> torch.Tensor:
        decay = _cosine((_float(step) - warmup) / (total - warmup), peak, final)
        return torch.where(step < warmup, _warmup(step, warmup, peak, init_value), decay)

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


def polynomial(
    init_value: float, end_value: float, power: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """``(init - end) * (1 - t / transition_steps) ** power + end``, ``t = clip(step - begin, 0, steps)``.

    Constant ``init_value`` before ``transition_begin``, ``end_value`` after
    ``transition_begin + transition_steps``. optax: ``polynomial_schedule``.
    """
    init_value = _check_value("init_value", init_value)
    end_value = _check_value("end_value", end_value)
    power = _check_value("power", power)
    transition_steps = _check_steps("transition_steps", transition_steps, minimum=1)
    transition_begin = _check_steps("transition_begin", transition_begin, minimum=0)

    def schedule(step: torch.Tensor) -> torch.Tensor:
        t = torch.clamp(_float(step) - transition_begin, 0.0, float(transition_steps))
        return (init_value - end_value) * (1.0 - t / transition_steps) ** power + end_value

    return schedule


def linear(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """Linear from ``init_value`` to ``end_value`` over ``transition_steps`` (optax: ``linear_schedule``)."""
    return polynomial(init_value, end_value, 1.0, transition_steps, transition_begin)


def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """``init * decay_rate ** (t / transition_steps)``, ``t = max(step - transition_begin, 0)``.

    ``staircase`` floors the exponent (a decay every ``transition_steps``);
    ``end_value`` bounds the value (below for ``decay_rate < 1``, above for
    growth). optax: ``exponential_decay``.
    """
    init_value = _check_value("init_value", init_value)
    decay_rate = _check_value("decay_rate", decay_rate)
    transition_steps = _check_steps("transition_steps", transition_steps, minimum=1)
    transition_begin = _check_steps("transition_begin", transition_begin, minimum=0)
    if decay_rate <= 0:
        raise ValueError(f"decay_rate={decay_rate}: expected > 0")
    end = None if end_value is None else _check_value("end_value", end_value)

    def schedule(step: torch.Tensor) -> torch.Tensor:
        exponent = torch.clamp(_float(step) - transition_begin, min=0.0) / transition_steps
        if staircase:
            exponent = torch.floor(exponent)
        value = init_value * torch.pow(torch.tensor(decay_rate, dtype=torch.float32, device=step.device), exponent)
        if end is not None:
            value = torch.clamp(value, min=end) if decay_rate < 1 else torch.clamp(value, max=end)
        return value

    return schedule


def piecewise_constant(init_value: float, boundaries_and_scales: dict[int, float] | None = None) -> Schedule:
    """``init_value`` times every ``scale`` whose ``boundary <= step``.

    optax: ``piecewise_constant_schedule`` (boundaries and scales multiply,
    in boundary order).
    """
    init_value = _check_value("init_value", init_value)
    pairs = sorted((boundaries_and_scales or {}).items())
    for b, scale in pairs:
        _check_steps("boundary", b, minimum=0)
        _check_value(f"scale at boundary {b}", scale)

    def schedule(step: torch.Tensor) -> torch.Tensor:
        value = torch.full((), init_value, dtype=torch.float32, device=step.device)
        for b, scale in pairs:
            value = torch.where(step < b, value, value * scale)
        return value

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i](step - boundaries[i - 1])`` on ``[boundaries[i - 1], boundaries[i])``.

    Each schedule after the first restarts its count at its boundary.
    optax: ``join_schedules``.

    >>> import torch
    >>> s = join_schedules([linear_warmup(1.0, 10, init_value=0.1), cosine_decay(1.0, 90)], [10])
    >>> [round(s(torch.tensor(k)).item(), 4) for k in (0, 5, 10, 55, 100)]
    [0.1, 0.55, 1.0, 0.5, 0.0]
    """
    schedules, boundaries = list(schedules), list(boundaries)
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join_schedules: {len(schedules)} schedules need {len(schedules) - 1} boundaries, got {len(boundaries)}"
        )
    for b in boundaries:
        _check_steps("boundary", b, minimum=0)
    if boundaries != sorted(boundaries):
        raise ValueError(f"join_schedules: boundaries {boundaries} must be increasing")

    def schedule(step: torch.Tensor) -> torch.Tensor:
        value = schedules[0](step).to(torch.float32)
        for b, s in zip(boundaries, schedules[1:], strict=True):
            value = torch.where(step < b, value, s(step - b).to(torch.float32))
        return value

    return schedule
