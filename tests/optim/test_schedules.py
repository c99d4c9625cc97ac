"""Schedules: values at key steps against closed forms, argument validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ftitan.optim as fo


def at(schedule, step: int) -> float:
    out = schedule(torch.tensor(step, dtype=torch.int64))
    assert out.shape == () and out.dtype == torch.float32
    return out.item()


# float32 schedules: values within a few float32 ulps of the closed form
approx = lambda x: pytest.approx(x, rel=1e-6, abs=1e-9)  # noqa: E731


def test_constant():
    s = fo.constant(3e-4)
    assert [at(s, k) for k in (0, 1, 10**6)] == [approx(3e-4)] * 3


def test_linear_warmup():
    s = fo.linear_warmup(2.0, warmup=8)
    assert [at(s, k) for k in (0, 1, 4, 8, 100)] == [0.0, approx(0.25), approx(1.0), approx(2.0), approx(2.0)]
    assert at(fo.linear_warmup(2.0, warmup=0), 0) == 2.0


def test_cosine_decay():
    s = fo.cosine_decay(1.0, total=100, final=0.1)
    closed = lambda k: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(k, 100) / 100))  # noqa: E731
    for k in (0, 25, 50, 75, 100, 150):
        assert at(s, k) == approx(closed(k))
    assert at(s, 50) == approx(0.55)


def test_warmup_cosine():
    s = fo.warmup_cosine(1.0, warmup=10, total=110, final=0.0)
    assert at(s, 0) == 0.0
    assert at(s, 5) == approx(0.5)
    assert at(s, 10) == approx(1.0)
    assert at(s, 35) == approx(0.5 * (1 + math.cos(math.pi * 0.25)))
    assert at(s, 60) == approx(0.5)
    assert at(s, 110) == approx(0.0)
    assert at(s, 1000) == approx(0.0)


def test_warmup_from_init_value():
    s = fo.linear_warmup(1.0, warmup=4, init_value=0.2)
    assert [at(s, k) for k in (0, 2, 4, 9)] == [approx(0.2), approx(0.6), approx(1.0), approx(1.0)]
    c = fo.warmup_cosine(1.0, warmup=4, total=8, init_value=0.2)
    assert [at(c, k) for k in (0, 2, 4, 6, 8)] == [approx(0.2), approx(0.6), approx(1.0), approx(0.5), approx(0.0)]


def test_warmup_stable_decay():
    # total 100, decay_fraction 0.2: stable until step 80, linear to final at 100
    s = fo.warmup_stable_decay(1.0, warmup=10, total=100, decay_fraction=0.2, final=0.1)
    assert at(s, 0) == 0.0
    assert at(s, 5) == approx(0.5)
    assert [at(s, k) for k in (10, 50, 80)] == [approx(1.0)] * 3
    assert at(s, 90) == approx(0.55)
    assert at(s, 100) == approx(0.1)
    assert at(s, 200) == approx(0.1)
    no_decay = fo.warmup_stable_decay(1.0, warmup=0, total=10, decay_fraction=0.0)
    assert at(no_decay, 10) == 1.0


@given(
    warmup=st.integers(0, 50),
    extra=st.integers(1, 200),
    step=st.integers(0, 400),
    final=st.floats(0.0, 0.5),
)
@settings(max_examples=60, deadline=None)
def test_warmup_cosine_bounded_and_monotone_after_warmup(warmup, extra, step, final):
    s = fo.warmup_cosine(1.0, warmup=warmup, total=warmup + extra, final=final)
    value = at(s, step)
    assert -1e-6 <= value <= 1.0 + 1e-6
    if step >= warmup:
        assert final - 1e-6 <= value
        assert at(s, step + 1) <= value + 1e-6


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: fo.linear_warmup(1.0, warmup=-1), "warmup"),
        (lambda: fo.linear_warmup(1.0, warmup=2.5), "warmup"),
        (lambda: fo.cosine_decay(1.0, total=0), "total"),
        (lambda: fo.cosine_decay(math.nan, total=10), "peak"),
        (lambda: fo.warmup_cosine(1.0, warmup=10, total=10), "warmup=10 must be < total=10"),
        (lambda: fo.warmup_stable_decay(1.0, warmup=10, total=100, decay_fraction=1.5), "decay_fraction"),
        (lambda: fo.warmup_stable_decay(1.0, warmup=90, total=100, decay_fraction=0.2), "exceed total"),
        (lambda: fo.constant("1e-3"), "value"),
        (lambda: fo.join_schedules([fo.constant(1.0), fo.constant(2.0)], []), "2 schedules need 1 boundaries"),
        (lambda: fo.join_schedules([fo.constant(1.0)] * 3, [5, 2]), "must be increasing"),
        (lambda: fo.exponential_decay(1.0, 10, 0.0), "decay_rate"),
        (lambda: fo.polynomial(1.0, 0.0, 1.0, transition_steps=0), "transition_steps"),
        (lambda: fo.linear_warmup(1.0, 10, init_value=math.inf), "init_value"),
    ],
)
def test_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()
