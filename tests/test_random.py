"""Explicit keys: determinism, independence, and no dependence on device count."""

import subprocess
import sys

import pytest
import torch

import ftitan.random as R


def test_same_key_same_bits_and_different_keys_differ():
    k = R.key(0)
    a, b = R.normal(k, (64,)), R.normal(k, (64,))
    assert torch.equal(a, b)
    k1, k2 = R.split(k)
    assert not torch.equal(R.normal(k1, (64,)), R.normal(k2, (64,)))
    assert not torch.equal(R.normal(R.key(1), (64,)), a)


def test_fold_in_strings_and_ints_are_distinct_and_stable():
    k = R.key(7)
    keys = {R.key_data(R.fold_in(k, s)) for s in ["layers.0.attn.wq", "layers.0.attn.wk", 0, 1, 2]}
    assert len(keys) == 5
    assert R.key_data(R.fold_in(k, "x")) == R.key_data(R.fold_in(R.key(7), "x"))


def test_bits_identical_across_processes():
    code = "import ftitan.random as R; print(R.normal(R.fold_in(R.key(3), 'w'), (4,)).tolist())"
    outs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    here = R.normal(R.fold_in(R.key(3), "w"), (4,)).tolist()
    assert outs[0] == outs[1] == f"{here}\n"


def test_global_rng_state_is_untouched():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    R.normal(R.key(0), (10,))
    R.truncated_normal(R.key(0), (10,))
    assert torch.equal(torch.rand(3), expected)


def test_meta_device_gives_shape_only():
    x = R.normal(R.key(0), (1 << 20, 1 << 20), device="meta")
    assert x.is_meta and x.shape == (1 << 20, 1 << 20)


def test_truncated_normal_bounds_and_uniform_range():
    x = R.truncated_normal(R.key(0), (10_000,), std=0.02, bound=2.0)
    assert x.abs().max() <= 0.04 + 1e-7
    assert 0.015 < x.std() < 0.02
    u = R.uniform(R.key(0), (10_000,), low=-1.0, high=3.0)
    assert u.min() >= -1.0 and u.max() < 3.0


def test_bad_key_is_a_clear_error():
    with pytest.raises(TypeError, match="seed must be an int"):
        R.key(1.5)
    with pytest.raises(TypeError, match="expected a key"):
        R.fold_in(torch.zeros(2), 0)
