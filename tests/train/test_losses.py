"""The chunked linear cross-entropy against F.cross_entropy on full logits."""

import pytest
import torch
import torch.nn.functional as F

from ftitan.train import IGNORE_INDEX, chunked_cross_entropy


def _data(n=37, d=16, v=50, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype)
    w = torch.randn(v, d, generator=g, dtype=dtype) * 0.3
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = IGNORE_INDEX
    return h, w, t


def _reference(h, w, t, reduction="mean"):
    # logits in float32 for low precision, float64 for float64 inputs (as the loss computes them)
    logits = (h @ w.T).to(torch.promote_types(h.dtype, torch.float32))
    return F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction=reduction)


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_value_and_grads_match_full_logits(chunk, reduction):
    # float64 inputs, float64 logits on both sides: same arithmetic, so a tight 1e-5
    h, w, t = _data()
    h.requires_grad_(True)
    w.requires_grad_(True)
    ours = chunked_cross_entropy(h, w, t, chunk_size=chunk, reduction=reduction)
    ref = _reference(h, w, t, reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    gh, gw = torch.autograd.grad(ours * 3.0, (h, w))
    rh, rw = torch.autograd.grad(ref * 3.0, (h, w))
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


def test_under_torch_func_grad_and_compile():
    h, w, t = (x.float() if x.is_floating_point() else x for x in _data())

    def loss(hw):
        return chunked_cross_entropy(hw[0], hw[1], t, chunk_size=8)

    g_func = torch.func.grad(loss)((h, w))
    g_ref = torch.func.grad(lambda hw: _reference(hw[0], hw[1], t))((h, w))
    for a, b in zip(g_func, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    compiled = torch.compile(torch.func.grad_and_value(loss), fullgraph=True, backend="aot_eager")
    g_c, v_c = compiled((h, w))
    torch.testing.assert_close(v_c, loss((h, w)))
    for a, b in zip(g_c, g_func, strict=True):
        torch.testing.assert_close(a, b)


def test_never_more_than_one_chunk_of_logits():
    # count the largest (rows, V) float32 tensor allocated while the loss runs forward+backward
    h, w, t = (x.float() if x.is_floating_point() else x for x in _data(n=64, v=97))
    h.requires_grad_(True)
    biggest = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and o.dim() == 2 and o.shape[1] == 97:
                    biggest.append(o.shape[0])
            return out

    with Spy():
        loss = chunked_cross_entropy(h, w, t, chunk_size=16)
        loss.backward()
    assert biggest and max(biggest) <= 16, f"saw logits blocks of {sorted(set(biggest))} rows"
    # and the spy can see a violation: the reference materializes all 64 rows
    biggest.clear()
    with Spy():
        _reference(h, w, t).backward()
    assert max(biggest) == 64


def test_bf16_hidden_states_keep_their_dtype():
    h, w, t = (x.to(torch.bfloat16) if x.is_floating_point() else x for x in _data())
    h.requires_grad_(True)
    w.requires_grad_(True)
    loss = chunked_cross_entropy(h, w, t, chunk_size=8)
    assert loss.dtype == torch.float32
    loss.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_no_grad_path_matches_and_bad_shapes_are_named():
    h, w, t = _data()
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(h, w, t, chunk_size=7), _reference(h, w, t), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"targets \(36,\) must be \(N,\) = \(37,\)"):
        chunked_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="reduction"):
        chunked_cross_entropy(h, w, t, reduction="max")
