"""The chunked cross-entropy with a logit soft-cap (``logit_softcap``, Gemma 2's ``cap * tanh(z / cap)``)
against ``F.cross_entropy`` of the capped full logits, for the fused Function and the plain path, under
``torch.func`` transforms, with one chunk of logits at a time.

Tolerances: float64 inputs and float64 logits on both sides, the same arithmetic summed in another
order, so 1e-10 on values and gradients; under the transforms (float32) 1e-5 relative.
"""

import pytest
import torch
import torch.nn.functional as F

from ftitan.models.base import soft_cap
from ftitan.train import IGNORE_INDEX, chunked_cross_entropy

CAP = 2.0


def _data(n=37, d=16, v=50, dtype=torch.float64, seed=0):
    # w scaled so that |logits| reaches ~3 cap: the tanh is far from linear there
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype)
    w = torch.randn(v, d, generator=g, dtype=dtype) * 1.5
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = IGNORE_INDEX
    return h, w, t


def _reference(h, w, t, reduction="mean", cap=CAP):
    logits = soft_cap((h @ w.T).to(torch.promote_types(h.dtype, torch.float32)), cap)
    return F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction=reduction)


def test_soft_cap_is_the_formula_and_none_is_identity():
    z = torch.linspace(-50, 50, 101, dtype=torch.float64)
    torch.testing.assert_close(soft_cap(z, 3.0), 3.0 * torch.tanh(z / 3.0), rtol=0, atol=0)
    assert soft_cap(z, None) is z
    assert float(soft_cap(z, 3.0).abs().max()) < 3.0  # bounded by the cap


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("chunk", [1, 8, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_value_and_grads_match_capped_full_logits(fused, chunk, reduction):
    h, w, t = _data()
    assert float((h @ w.T).abs().max()) > 3 * CAP  # the cap bends these logits hard
    h.requires_grad_(True)
    w.requires_grad_(True)
    ours = chunked_cross_entropy(h, w, t, chunk_size=chunk, reduction=reduction, fused=fused, logit_softcap=CAP)
    ref = _reference(h, w, t, reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    gh, gw = torch.autograd.grad(ours * 3.0, (h, w))
    rh, rw = torch.autograd.grad(ref * 3.0, (h, w))
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-10)
    # and the cap matters here: the uncapped loss is another number
    with torch.no_grad():
        assert abs(float(chunked_cross_entropy(h, w, t, reduction=reduction)) - float(ref)) > 1e-1


def test_fused_grads_equal_torch_func_grad_of_the_plain_formula():
    h, w, t = (x.float() if x.is_floating_point() else x for x in _data())
    h.requires_grad_(True)
    w.requires_grad_(True)
    loss = chunked_cross_entropy(h, w, t, chunk_size=8, logit_softcap=CAP)  # fused (plain autograd)
    fused = torch.autograd.grad(loss, (h, w))
    want = torch.func.grad(lambda hw: _reference(hw[0], hw[1], t))((h.detach(), w.detach()))
    for a, b in zip(fused, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # one torch.func.grad level also takes the fused Function; compiled (aot_eager) it is the same
    inner = torch.func.grad(lambda hw: chunked_cross_entropy(hw[0], hw[1], t, chunk_size=8, logit_softcap=CAP))
    for a, b in zip(inner((h.detach(), w.detach())), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    compiled = torch.compile(inner, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled((h.detach(), w.detach())), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_transforms_see_the_capped_loss():
    h, w, t = _data(n=12, v=20)

    def loss(hw, tt):
        return chunked_cross_entropy(hw[0], hw[1], tt, chunk_size=5, logit_softcap=CAP)

    def ref(hw, tt):
        return _reference(hw[0], hw[1], tt)

    # per-example gradients (vmap of grad) over 3 examples of 4 rows
    hb, tb = h.reshape(3, 4, -1), t.reshape(3, 4)
    per = torch.func.vmap(torch.func.grad(lambda hh, tt: loss((hh, w), tt)))(hb, tb)
    per_ref = torch.func.vmap(torch.func.grad(lambda hh, tt: ref((hh, w), tt)))(hb, tb)
    torch.testing.assert_close(per, per_ref, rtol=1e-10, atol=1e-10)
    # Hessian-vector product (jvp of grad) and grad of grad
    v = (torch.randn_like(h), torch.randn_like(w))
    _, hvp = torch.func.jvp(torch.func.grad(lambda hw: loss(hw, t)), ((h, w),), (v,))
    _, hvp_ref = torch.func.jvp(torch.func.grad(lambda hw: ref(hw, t)), ((h, w),), (v,))
    for a, b in zip(hvp, hvp_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    gg = torch.func.grad(lambda hh: torch.func.grad(lambda x: loss((x, w), t))(hh).square().sum())(h)
    gg_ref = torch.func.grad(lambda hh: torch.func.grad(lambda x: ref((x, w), t))(hh).square().sum())(h)
    torch.testing.assert_close(gg, gg_ref, rtol=1e-9, atol=1e-10)
    # plain autograd double backward through the plain path (fused=False)
    hh = h.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(chunked_cross_entropy(hh, w, t, logit_softcap=CAP, fused=False), hh, create_graph=True)
    (g2,) = torch.autograd.grad(g.square().sum(), hh)
    torch.testing.assert_close(g2, gg_ref, rtol=1e-9, atol=1e-10)


def test_never_more_than_one_chunk_of_logits_with_the_cap():
    h, w, t = (x.float() if x.is_floating_point() else x for x in _data(n=64, v=97))
    h.requires_grad_(True)
    rows = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and o.dim() == 2 and o.shape[1] == 97:
                    rows.append(o.shape[0])
            return out

    with Spy():
        chunked_cross_entropy(h, w, t, chunk_size=16, logit_softcap=CAP).backward()
    assert rows and max(rows) <= 16, f"saw logits blocks of {sorted(set(rows))} rows"


def test_bad_cap_is_named():
    h, w, t = _data()
    for cap in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match=f"logit_softcap={cap}"):
            chunked_cross_entropy(h, w, t, logit_softcap=cap)
