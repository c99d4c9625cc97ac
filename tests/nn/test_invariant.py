"""Batch-invariant ops: a row alone, in a bigger batch, at another position, or with more (masked) keys
gives the same bits (``torch.equal``); the values equal the default ops to float32 rounding (1e-5 of
values of order 1: other summation orders), and gradients flow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftitan import nn
from ftitan.nn import invariant as inv


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_tree_sum_ignores_trailing_zeros():
    for n in (1, 2, 3, 7, 16, 33):
        x = _randn(4, n, seed=n)
        s = inv.tree_sum(x)
        for pad in (1, 5, 64):
            assert torch.equal(inv.tree_sum(F.pad(x, (0, pad))), s)
        torch.testing.assert_close(s, x.sum(-1), rtol=1e-5, atol=1e-5)
    x = _randn(3, 5, 6)
    torch.testing.assert_close(inv.tree_sum(x, dim=1, keepdim=True), x.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("k", "n"), [(256, 768), (64, 300), (768, 256), (32, 2048), (1024, 256), (4096, 64)])
def test_linear_row_alone_equals_row_in_any_batch(k: int, n: int):
    x, w, b = _randn(300, k, seed=1), _randn(n, k, seed=2) * k**-0.5, _randn(n, seed=3)
    alone = torch.stack([inv.linear(x[i : i + 1], w, b)[0] for i in range(8)])
    for m in (1, 2, 3, 5, 15, 16, 17, 64, 300, 500, 1000):  # 1 tile of 16 (beside a zero one), 3 of 144, 2 / 4 of 256
        rows = _randn(m, k, seed=m)
        where = torch.randperm(m, generator=torch.Generator().manual_seed(m))[: min(m, 8)]
        rows[where] = x[: len(where)]
        assert torch.equal(inv.linear(rows, w, b)[where], alone[: len(where)]), m
    torch.testing.assert_close(inv.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # nn.linear routes there, leading dims kept
    assert torch.equal(nn.linear(x.view(3, 100, k), w, b, invariant=True), inv.linear(x, w, b).view(3, 100, n))


def test_exp_log_cos_sin_are_accurate_and_do_not_depend_on_the_place_in_the_tensor():
    """Cephes' float32 formulas: within 2e-7 relative (exp, log) / 1e-7 absolute (cos, sin, long-context RoPE
    angles) of float64, where float32 ``torch.*`` is within 1 ulp; and each element the same wherever it sits."""
    x = _randn(70001, seed=14) * 20
    angles = (torch.arange(0, 131072, 7)[:, None].float() * nn.rope_inv_freq(128, 500000.0)).flatten()
    e, lg = inv.exp(x), inv.log(x.abs() + 1e-3)
    c, s = inv.cos_sin(angles)
    torch.testing.assert_close(e.double(), x.double().exp(), rtol=2e-7, atol=0)
    torch.testing.assert_close(lg.double(), (x.abs() + 1e-3).double().log(), rtol=2e-7, atol=1e-7)
    torch.testing.assert_close(c.double(), angles.double().cos(), rtol=0, atol=1e-7)
    torch.testing.assert_close(s.double(), angles.double().sin(), rtol=0, atol=1e-7)
    assert torch.equal(inv.exp(torch.tensor([float("-inf"), -100.0])), torch.zeros(2))
    for n, off in ((1, 0), (7, 5), (57, 13), (40001, 1)):
        part = slice(off, off + n)
        assert torch.equal(inv.exp(x[part].clone()), e[part])
        assert torch.equal(inv.log(x[part].abs() + 1e-3), lg[part])
        assert all(torch.equal(a, b[part]) for a, b in zip(inv.cos_sin(angles[part].clone()), (c, s), strict=True))


def test_sigmoid_does_not_depend_on_the_place_in_the_tensor():
    """``torch.sigmoid``'s vectorized body and scalar tail differ by an ulp (why ``invariant.sigmoid`` exists)."""
    x = _randn(70001, seed=13) * 3
    full = inv.sigmoid(x)
    for n, off in ((1, 0), (7, 5), (57, 13), (40001, 1)):
        assert torch.equal(inv.sigmoid(x[off : off + n].clone()), full[off : off + n])
    torch.testing.assert_close(full, torch.sigmoid(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "rms_norm"])
def test_row_ops_alone_equal_in_batch(op: str):
    x, w = _randn(40, 300, seed=4) * 3, _randn(300, seed=5)
    f = {"softmax": lambda y: inv.softmax(y, dim=-1), "log_softmax": lambda y: inv.log_softmax(y, dim=-1),
         "rms_norm": lambda y: inv.rms_norm(y, w, 1e-6)}[op]  # fmt: skip
    ref = {"softmax": lambda y: torch.softmax(y, -1), "log_softmax": lambda y: torch.log_softmax(y, -1),
           "rms_norm": lambda y: nn.rms_norm(y, w, 1e-6)}[op]  # fmt: skip
    full = f(x)
    for i in (0, 17, 39):
        assert torch.equal(f(x[i : i + 1])[0], full[i])
    assert torch.equal(f(x.view(4, 10, 300)).view(40, 300), full)
    torch.testing.assert_close(full, ref(x), rtol=1e-5, atol=1e-5)


def test_attention_prefill_decode_and_padding_give_the_same_bits():
    b, t, h, kv, dh = 3, 37, 4, 2, 16
    q, k, v = _randn(b, t, h, dh, seed=6), _randn(b, t, kv, dh, seed=7), _randn(b, t, kv, dh, seed=8)
    full = nn.attention(q, k, v, impl="batch_invariant")
    torch.testing.assert_close(full, nn.attention(q, k, v, impl="math"), rtol=1e-5, atol=1e-5)
    for s in (t, 48, 64, 129):  # decode: one query against a cache of s slots, the slots after it masked
        keys = torch.cat([k, _randn(b, s - t, kv, dh, seed=s)], 1)
        vals = torch.cat([v, _randn(b, s - t, kv, dh, seed=s + 1)], 1)
        for p in (0, 5, 16, 36):
            mask = (torch.arange(s) <= p)[None, None].expand(b, 1, s)
            one = nn.attention(q[:, p : p + 1], keys, vals, impl="batch_invariant", causal=False, mask=mask)
            assert torch.equal(one[:, 0], full[:, p]), (s, p)
    # a row alone equals the row in the batch; a prefix of the row equals the row's first queries
    assert torch.equal(nn.attention(q[1:2], k[1:2], v[1:2], impl="batch_invariant"), full[1:2])
    assert torch.equal(nn.attention(q[:, :20], k[:, :20], v[:, :20], impl="batch_invariant"), full[:, :20])


def test_grouped_mm_rows_do_not_depend_on_the_routing():
    from ftitan.kernels.grouped_mm import grouped_mm_reference

    g, k, n = 4, 32, 24
    w = _randn(g, k, n, seed=9)
    x = _randn(50, k, seed=10)
    ref_counts = [10, 0, 23, 17]
    offs = torch.tensor(ref_counts).cumsum(0).to(torch.int32)
    full = inv.grouped_mm(x, w, offs)
    torch.testing.assert_close(full, grouped_mm_reference(x, w, offs), rtol=1e-5, atol=1e-5)
    # row 12 (group 2) alone, and with other group sizes around it
    alone = inv.grouped_mm(x[12:13], w, torch.tensor([0, 0, 1, 1], dtype=torch.int32))
    assert torch.equal(alone[0], full[12])
    some = inv.grouped_mm(x[5:40], w, torch.tensor([5, 5, 28, 35], dtype=torch.int32))
    assert torch.equal(some, full[5:40])
    # one expert, K >= 1024: a row alone (one tile of real rows) equals the row among many
    w1, x1 = _randn(1, 1024, 64, seed=11), _randn(40, 1024, seed=12)
    many = inv.grouped_mm(x1, w1, torch.tensor([40], dtype=torch.int32))
    for i in (0, 17, 39):
        assert torch.equal(inv.grouped_mm(x1[i : i + 1], w1, torch.tensor([1], dtype=torch.int32))[0], many[i])


def test_gradients_flow_and_match_the_default_ops():
    x, w = _randn(20, 32, seed=11).requires_grad_(), _randn(48, 32, seed=12).requires_grad_()

    def loss(x, w, invariant):
        y = nn.linear(nn.rms_norm(x, torch.ones(32), 1e-6, invariant=invariant), w, invariant=invariant)
        y = y.view(2, 10, 6, 8)
        o = nn.attention(y[..., :2, :], y[..., 2:4, :], y[..., 4:, :], impl="batch_invariant" if invariant else "math")
        lsm = inv.log_softmax(o.flatten(2), -1) if invariant else torch.log_softmax(o.flatten(2), -1)
        return lsm[..., 0].sum()

    want = torch.autograd.grad(loss(x, w, False), (x, w))
    got = torch.autograd.grad(loss(x, w, True), (x, w))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)  # other summation orders, through 4 ops
    func = torch.func.grad(lambda x, w: loss(x, w, True), argnums=(0, 1))(x.detach(), w.detach())
    for a, e in zip(func, got, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_computes_the_same_bits_as_eager():
    """Compiled, every op gives the eager bits (``torch.exp``/``log``/``cos``/``sin``/``sigmoid`` do not:
    inductor has its own vectorized ones); about 60 s of inductor compiles."""
    x, w, nw = _randn(37, 300, seed=15) * 3, _randn(128, 300, seed=16) * 0.05, _randn(300, seed=17)
    q, k, v = _randn(2, 9, 4, 16, seed=18), _randn(2, 9, 2, 16, seed=19), _randn(2, 9, 2, 16, seed=20)

    def ops(x, w, nw, q, k, v):
        return (inv.log_softmax(inv.linear(inv.rms_norm(x, nw, 1e-6), w)), inv.softmax(x), inv.sigmoid(x),
                nn.attention(q, k, v, impl="batch_invariant"), *inv.cos_sin(x * 100))  # fmt: skip

    for got, want in zip(torch.compile(ops, fullgraph=True)(x, w, nw, q, k, v), ops(x, w, nw, q, k, v), strict=True):
        assert torch.equal(got, want)
