"""Sampling rules: greedy, temperature, top-k, top-p, per-row settings and keys."""

import pytest
import torch

import ftitan as ft
from ftitan.infer import GREEDY, Sampling, sample


def keys(n, seed=0):
    return ft.random.split(ft.random.key(seed), n)


def test_greedy_topk1_and_tiny_topp_pick_the_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1)
    assert torch.equal(sample(logits, None, GREEDY), want)
    assert torch.equal(sample(logits, keys(16), Sampling(top_k=1)), want)
    assert torch.equal(sample(logits, keys(16), Sampling(top_p=1e-6)), want)


def test_sampling_is_seeded_and_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20_000, 4)
    a = sample(logits, keys(20_000, 1), Sampling())
    assert torch.equal(a, sample(logits, keys(20_000, 1), Sampling()))
    assert not torch.equal(a, sample(logits, keys(20_000, 2), Sampling()))
    freq = torch.bincount(a, minlength=4).float() / a.numel()
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)  # ~4 sigma at n=20k


def test_temperature_sharpens_as_softmax_of_scaled_logits():
    logits = torch.tensor([0.0, 1.0, 2.0]).expand(20_000, 3)
    a = sample(logits, keys(20_000, 3), Sampling(temperature=0.5))
    freq = torch.bincount(a, minlength=3).float() / a.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.5, -1), atol=0.015, rtol=0)


def test_top_k_and_top_p_remove_the_tail():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # not sorted: the filters must sort
    logits = probs.log().expand(5_000, 4)
    assert set(sample(logits, keys(5_000), Sampling(top_k=2)).tolist()) == {1, 3}
    # mass before token 2 (0.15) is 0.8 >= 0.75, so it and token 0 are dropped
    assert set(sample(logits, keys(5_000), Sampling(top_p=0.75)).tolist()) == {1, 3}
    assert set(sample(logits, keys(5_000), Sampling(top_p=0.85)).tolist()) == {1, 2, 3}
    # top-k first, then top-p over the renormalized top 3: 0.5/0.95, 0.3/0.95 -> 0.842 >= 0.8
    assert set(sample(logits, keys(5_000), Sampling(top_k=3, top_p=0.8)).tolist()) == {1, 3}


def test_a_rows_draw_depends_only_on_its_logits_settings_and_key():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 40, generator=g)
    rows = [Sampling(), GREEDY, Sampling(temperature=0.7, top_k=5), Sampling(top_p=0.9), Sampling(), GREEDY]
    ks = keys(6, 9)
    batch = sample(logits, ks, rows)
    for i in range(6):
        assert sample(logits[i : i + 1], [ks[i]], rows[i]) == batch[i]
    assert batch[1] == logits[1].argmax() and batch[5] == logits[5].argmax()


@pytest.mark.parametrize(
    ("settings", "message"),
    [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k")],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**settings)


def test_sampling_needs_one_key_per_row():
    with pytest.raises(ValueError, match="one key per row"):
        sample(torch.zeros(3, 5), keys(2), Sampling())
    with pytest.raises(ValueError, match="2 Sampling settings for 3 rows"):
        sample(torch.zeros(3, 5), keys(3), [Sampling(), GREEDY])
