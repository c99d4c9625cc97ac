"""Sliding-window attention: ``nn.attention(window=)``, the context-parallel seam and the native KV cache.

Reference: a brute-force softmax over the keys HF's ``sliding_window_overlay`` and causal rule allow
(``kv_idx > q_idx - window`` and ``kv_idx <= q_idx``: a query sees its ``window`` most recent keys,
itself included). Tolerance 1e-6 in float32: the same products summed in another order.
"""

import pytest
import torch
from transformers import masking_utils

from ftitan import nn
from ftitan.infer import KVCache
from ftitan.nn.attention import window_mask
from ftitan.parallel import activations as par

IMPLS = ("sdpa", "math", "batch_invariant")


def qkv(b=2, t=9, s=None, h=4, kv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = t if s is None else s
    return (torch.randn(b, t, h, d, generator=g), torch.randn(b, s, kv, d, generator=g),
            torch.randn(b, s, kv, d, generator=g))  # fmt: skip


def reference(q, k, v, allowed):  # allowed: (T, S) | (B, T, S) bool
    b, t, h, d = q.shape
    kk = k.repeat_interleave(h // k.shape[2], dim=2)
    vv = v.repeat_interleave(h // v.shape[2], dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, kk) * d**-0.5
    allowed = allowed if allowed.dim() == 3 else allowed.expand(b, -1, -1)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), vv)


def hf_allowed(t, s, window):
    """HF's sliding-window causal rule, query ``i`` at key position ``i + s - t``."""
    overlay = masking_utils.sliding_window_overlay(window)
    return torch.tensor([[overlay(0, 0, i + s - t, j) and j <= i + s - t for j in range(s)] for i in range(t)])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [1, 3, 9, 20])
def test_window_matches_hf_convention(impl, window):
    q, k, v = qkv()
    assert torch.equal(window_mask(9, 9, window) & nn.causal_mask(9, 9), hf_allowed(9, 9, window))
    got = nn.attention(q, k, v, impl=impl, window=window)
    torch.testing.assert_close(got, reference(q, k, v, hf_allowed(9, 9, window)), rtol=0, atol=1e-6)
    if window >= 9:  # a window as long as the sequence is plain causal attention
        torch.testing.assert_close(got, nn.attention(q, k, v, impl=impl), rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_window_with_fewer_queries_than_keys_and_with_documents(impl):
    q, k, v = qkv(t=3, s=10)  # decoding the last 3 of 10 positions: bottom-right aligned
    got = nn.attention(q, k, v, impl=impl, window=4)
    torch.testing.assert_close(got, reference(q, k, v, hf_allowed(3, 10, 4)), rtol=0, atol=1e-6)
    q, k, v = qkv(t=10)
    segments = torch.tensor([[0] * 6 + [1] * 4, [0] * 2 + [1] * 8])
    allowed = nn.document_mask(segments) & hf_allowed(10, 10, 3)
    got = par.attention(q, k, v, impl=impl, segments=segments, window=3)  # no layout: one process
    torch.testing.assert_close(got, reference(q, k, v, allowed), rtol=0, atol=1e-6)


def test_window_refuses_bad_values():
    q, k, v = qkv()
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match=f"window={bad!r} must be an int >= 1"):
            nn.attention(q, k, v, window=bad)


def empty_cache(b, s, kv=2, d=8):
    layer = {"k": torch.zeros(b, s, kv, d), "v": torch.zeros(b, s, kv, d)}
    zeros = torch.zeros(b, dtype=torch.long)
    return KVCache({"0": layer}, zeros, zeros.clone())


@pytest.mark.parametrize("impl", IMPLS)
def test_cache_prefill_and_decode_with_a_window(impl):
    """Row 0 holds 9 tokens from slot 0; row 1 is left-padded (starts at slot 3, 6 tokens). Prefill the 9
    slots, then decode 4 tokens one by one: each query sees the window of its own row's keys only."""
    window, steps = 3, 4
    q, k, v = qkv(b=2, t=9 + steps, seed=1)
    start = torch.tensor([0, 3])
    cache = empty_cache(2, 16)._replace(start=start)
    o, cache = cache.attend(0, q[:, :9], k[:, :9], v[:, :9], impl=impl, window=window)
    outs = [o]
    for j in range(9, 9 + steps):
        cache = cache._replace(end=torch.full((2,), j))
        o, cache = cache.attend(0, q[:, j : j + 1], k[:, j : j + 1], v[:, j : j + 1], impl=impl, window=window)
        outs.append(o)
    got = torch.cat(outs, dim=1)
    for row, first in enumerate(start.tolist()):  # each row alone, its real tokens only
        sl = slice(first, 9 + steps)
        want = reference(q[row : row + 1, sl], k[row : row + 1, sl], v[row : row + 1, sl],
                         hf_allowed(9 + steps - first, 9 + steps - first, window))  # fmt: skip
        torch.testing.assert_close(got[row : row + 1, sl], want, rtol=0, atol=1e-6)
    assert torch.isfinite(got).all()  # the padding queries of row 1 see themselves
