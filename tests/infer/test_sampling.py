"""Sampling rules and full-recompute generation."""

import attrs
import pytest
import torch

import ftitan as ft
from ftitan.infer import generate_tokens, sample_logits
from ftitan.models import llama


def test_greedy_topk1_and_tiny_topp_pick_the_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1)
    k = ft.random.key(0)
    assert torch.equal(sample_logits(logits, k, temperature=0), want)
    assert torch.equal(sample_logits(logits, k, top_k=1), want)
    assert torch.equal(sample_logits(logits, k, top_p=1e-6), want)


def test_sampling_is_seeded_and_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20_000, 4)
    a = sample_logits(logits, ft.random.key(1))
    assert torch.equal(a, sample_logits(logits, ft.random.key(1)))
    assert not torch.equal(a, sample_logits(logits, ft.random.key(2)))
    freq = torch.bincount(a, minlength=4).float() / a.numel()
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)  # ~4 sigma at n=20k


def test_top_k_and_top_p_remove_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(5_000, 4)
    assert set(sample_logits(logits, ft.random.key(0), top_k=2).tolist()) == {0, 1}
    # mass before token 2 is 0.8 >= 0.75, so tokens 2 and 3 are dropped
    assert set(sample_logits(logits, ft.random.key(0), top_p=0.75).tolist()) == {0, 1}
    with pytest.raises(ValueError, match="top_p"):
        sample_logits(logits, ft.random.key(0), top_p=0.0)


def test_greedy_generation_equals_argmax_of_full_forwards():
    cfg = attrs.evolve(llama.Config.debug(), vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    model = llama.model(cfg)
    params = model.init(ft.random.key(0))
    out = generate_tokens(model, params, [1, 2, 3], max_new_tokens=6, key=ft.random.key(0), temperature=0)
    seq = [1, 2, 3]
    for _ in range(6):
        logits, _ = model.apply(params, torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
    assert out == seq
    stop = generate_tokens(model, params, [1, 2, 3], max_new_tokens=6, key=ft.random.key(0), temperature=0, eos_id=seq[3])
    assert stop == seq[:4]
