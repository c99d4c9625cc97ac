"""Layers under torch.func transforms: the automatic fallbacks (attention, grouped matmul, MoE routing).

References are independent: the math attention form written against SDPA
itself, central finite differences in float64, the naive per-group loop,
and an MoE layer run on each example alone.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jvp, vmap

import ftitan as ft
from ftitan.kernels.grouped_mm import grouped_mm, grouped_mm_dense, grouped_mm_reference
from ftitan.nn import attention, moe

F64 = {"rtol": 1e-7, "atol": 1e-9}  # central differences, h = 1e-6, float64


def _qkv(dtype=torch.float64, b=2, t=5, h=4, kv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, t, n, d, generator=g, dtype=dtype) for n in (h, kv, kv)]


def _fd(f, x, v, h=1e-6):
    return (f(x + h * v) - f(x - h * v)) / (2 * h)


def test_sdpa_attention_jvp_falls_back_and_matches_finite_differences():
    q, k, v = _qkv()
    dq = torch.randn_like(q)
    f = lambda q_: attention(q_, k, v, impl="sdpa")  # noqa: E731
    out, tangent = jvp(f, (q,), (dq,))  # the CPU flash kernel has no forward-AD formula
    torch.testing.assert_close(out, attention(q, k, v, impl="sdpa"), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tangent, _fd(f, q, dq), **F64)


def test_sdpa_attention_under_forward_ad_dual_tensors():
    q, k, v = _qkv()
    dk = torch.randn_like(k)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(attention(q, fwAD.make_dual(k, dk), v, impl="sdpa")).tangent
    torch.testing.assert_close(tangent, _fd(lambda k_: attention(q, k_, v, impl="sdpa"), k, dk), **F64)


def test_sdpa_attention_grad_of_grad_matches_math():
    q, k, v = _qkv()
    u = torch.randn_like(q)

    def second(impl):
        inner = lambda q_: (attention(q_, k, v, impl=impl) ** 2).sum()  # noqa: E731
        return grad(lambda q_: (grad(inner)(q_) * u).sum())(q)

    torch.testing.assert_close(second("sdpa"), second("math"), rtol=1e-10, atol=1e-10)


def _groups(m=11, k=6, n=5, e=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=dtype)
    w = torch.randn(e, k, n, generator=g, dtype=dtype)
    offs = torch.tensor([3, 3, 8, m], dtype=torch.int32)  # one empty group
    return x, w, offs


def test_grouped_mm_dense_equals_the_loop():
    x, w, offs = _groups()
    torch.testing.assert_close(grouped_mm_dense(x, w, offs), grouped_mm_reference(x, w, offs))


def test_grouped_mm_jvp_is_not_zero_and_matches_finite_differences():
    # ATen's op has no forward-AD formula (and a custom op would give a silent zero tangent)
    x, w, offs = (a.float() if a.is_floating_point() else a for a in _groups())
    dx, dw = torch.randn_like(x), torch.randn_like(w)
    _, tangent = jvp(lambda x_, w_: grouped_mm(x_, w_, offs), (x, w), (dx, dw))
    want = grouped_mm_reference(dx, w, offs) + grouped_mm_reference(x, dw, offs)  # linear in each
    torch.testing.assert_close(tangent, want, rtol=1e-5, atol=1e-5)


def test_grouped_mm_under_vmap_per_example_offsets():
    x, w, offs = (a.float() if a.is_floating_point() else a for a in _groups())
    xs = torch.stack([x, 2 * x])
    offss = torch.stack([offs, torch.tensor([1, 5, 9, 11], dtype=torch.int32)])
    got = vmap(grouped_mm, in_dims=(0, None, 0))(xs, w, offss)
    for i in range(2):
        torch.testing.assert_close(got[i], grouped_mm_reference(xs[i], w, offss[i]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_moe_under_vmap_routes_each_example_alone(score_func):
    cfg = moe.MoEConfig(
        n_experts=4, top_k=2, expert_dim=8, n_shared_experts=1, score_func=score_func,
        n_groups=2, topk_groups=1, score_bias=score_func == "sigmoid",
    )  # fmt: skip
    p = ft.nn.init(moe.moe_params(16, cfg), ft.random.key(0))
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(0))
    out, stats = vmap(lambda xi: moe.moe(xi, p, cfg))(x)
    for i in range(3):
        alone, s = moe.moe(x[i], p, cfg)
        torch.testing.assert_close(out[i], alone, rtol=1e-5, atol=1e-6)  # dense vs grouped matmul: fp32 rounding
        torch.testing.assert_close(stats.counts[i], s.counts)  # per-example routing counts, exact
        assert stats.counts[i].sum() == 7 * cfg.top_k
