"""clip_by_global_norm."""

from __future__ import annotations

import math

import pytest
import torch

import ftitan.optim as fo
from ftitan import tree

from ._helpers import grad_stream, llama_params


def test_below_max_norm_passes_unchanged():
    grads = grad_stream(llama_params(), 1, scale=1e-3)[0]
    assert tree.global_norm(grads).item() < 1.0
    out, _ = fo.clip_by_global_norm(1.0).update(grads, fo.EmptyState())
    for a, b in zip(tree.leaves(out), tree.leaves(grads), strict=True):
        assert torch.equal(a, b)


def test_above_max_norm_scaled_to_max_norm():
    grads = grad_stream(llama_params(torch.float64), 1)[0]
    norm = tree.global_norm(grads).item()
    assert norm > 10
    out, _ = fo.clip_by_global_norm(2.0).update(grads, fo.EmptyState())
    assert tree.global_norm(out).item() == pytest.approx(2.0, rel=1e-12)
    for a, b in zip(tree.leaves(out), tree.leaves(grads), strict=True):
        torch.testing.assert_close(a, b * (2.0 / norm), rtol=1e-12, atol=0)


def test_matches_torch_clip_grad_norm():
    # torch divides by norm + 1e-6: a relative difference of 1e-6 / norm (norm > 10 here)
    grads = grad_stream(llama_params(), 1)[0]
    ps = [torch.zeros_like(g, requires_grad=True) for g in tree.leaves(grads)]
    for p, g in zip(ps, tree.leaves(grads), strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=False)
    out, _ = fo.clip_by_global_norm(1.0).update(grads, fo.EmptyState())
    for a, b in zip(tree.leaves(out), [p.grad for p in ps], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_bf16_dtype_kept():
    grads = grad_stream(llama_params(torch.bfloat16), 1)[0]
    out, _ = fo.clip_by_global_norm(1.0).update(grads, fo.EmptyState())
    assert {x.dtype for x in tree.leaves(out)} == {torch.bfloat16}
    # norm accumulated in float32: within bf16 rounding of the target
    assert tree.global_norm(out).item() == pytest.approx(1.0, rel=2**-7)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_rejects_bad_max_norm(bad):
    with pytest.raises(ValueError, match="max_norm"):
        fo.clip_by_global_norm(bad)
