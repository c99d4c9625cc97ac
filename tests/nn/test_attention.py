"""GQA attention: the SDPA and math paths agree with each other and with a float64 reference."""

import pytest
import torch

from ftitan import nn
from ftitan.nn.attention import causal_mask


def reference(q, k, v, *, causal):
    # float64, K/V repeated per query head as HF's repeat_kv does, explicit bottom-right mask
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        t, s = q.shape[2], k.shape[2]
        allowed = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def qkv(b=2, t=7, s=7, h=4, kv=2, dh=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, t, h, dh, generator=g).to(dtype),
        torch.randn(b, s, kv, dh, generator=g).to(dtype),
        torch.randn(b, s, kv, dh, generator=g).to(dtype),
    )


@pytest.mark.parametrize("h,kv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t,s", [(7, 7), (3, 7), (1, 7)])
def test_sdpa_and_math_match_reference(h, kv, causal, t, s):
    # fp32 vs fp64: 1e-5 absolute leaves room for a few ulps on O(1) outputs
    q, k, v = qkv(t=t, s=s, h=h, kv=kv)
    want = reference(q, k, v, causal=causal).float()
    for impl in ("sdpa", "math"):
        got = nn.attention(q, k, v, impl=impl, causal=causal)
        assert got.shape == q.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=impl)


def test_gradients_agree():
    q, k, v = qkv()
    grads = {}
    for impl in ("sdpa", "math"):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = nn.attention(*xs, impl=impl)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[impl] = [x.grad for x in xs]
    for a, b in zip(grads["sdpa"], grads["math"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_causal_ignores_the_future():
    q, k, v = qkv(t=6, s=6)
    k2, v2 = k.clone(), v.clone()
    k2[:, 4:] += 10.0
    v2[:, 4:] -= 10.0
    for impl in ("sdpa", "math"):
        a = nn.attention(q, k, v, impl=impl)
        b = nn.attention(q, k2, v2, impl=impl)
        torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=1e-6)
        assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_decode_query_matches_last_row_of_prefill():
    # the KV-cache case: one query against all keys is the last row of full causal attention
    q, k, v = qkv(t=9, s=9)
    for impl in ("sdpa", "math"):
        full = nn.attention(q, k, v, impl=impl)
        last = nn.attention(q[:, -1:], k, v, impl=impl)
        torch.testing.assert_close(last, full[:, -1:], rtol=0, atol=1e-6)


def test_bfloat16_paths_agree():
    # bf16 has ~3 significant digits; both paths accumulate in fp32, so 2e-2 on O(1) outputs
    q, k, v = qkv(dtype=torch.bfloat16)
    a = nn.attention(q, k, v, impl="sdpa")
    b = nn.attention(q, k, v, impl="math")
    assert a.dtype == b.dtype == torch.bfloat16
    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2)


def test_errors_name_the_problem():
    q, k, v = qkv(h=4, kv=3)
    with pytest.raises(ValueError, match="not a multiple"):
        nn.attention(q, k, v)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="impl='flash'"):
        nn.attention(q, k, v, impl="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="more queries"):
        nn.attention(*qkv(t=5, s=3))


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_explicit_mask_matches_causal_and_permuted_positions(impl):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    mask = causal_mask(6, 6)
    causal = nn.attention(q, k, v, impl=impl, causal=True)
    torch.testing.assert_close(nn.attention(q, k, v, impl=impl, causal=False, mask=mask), causal)
    # keys in another order (context parallelism's head-tail chunks): masking by true positions is the same
    order = torch.tensor([0, 5, 1, 4, 2, 3])
    pos = torch.arange(6)
    got = nn.attention(q, k[:, order], v[:, order], impl=impl, causal=False,
                                 mask=pos[order][None, :] <= pos[:, None])  # fmt: skip
    torch.testing.assert_close(got, causal)
    with pytest.raises(ValueError, match="comes with causal=False"):
        nn.attention(q, k, v, impl=impl, causal=True, mask=mask)
