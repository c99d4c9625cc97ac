"""SGD and momentum parity with torch.optim.SGD."""

from __future__ import annotations

import pytest
import torch

import ftitan.optim as fo
from ftitan import tree

from ._helpers import grad_stream, llama_params, max_abs_diff, run


def torch_sgd(params, grads, **kw):
    _, leaves, treedef = tree.flatten_with_paths(params)
    ps = [x.clone().requires_grad_(True) for x in leaves]
    opt = torch.optim.SGD(ps, foreach=False, **kw)
    for g in grads:
        for p, gl in zip(ps, tree.leaves(g), strict=True):
            p.grad = gl.clone()
        opt.step()
    return tree.unflatten(treedef, [p.detach() for p in ps])


@pytest.mark.parametrize(
    "kw",
    [
        dict(momentum=0.0, nesterov=False, weight_decay=0.0),
        dict(momentum=0.9, nesterov=False, weight_decay=0.0),
        dict(momentum=0.9, nesterov=True, weight_decay=0.0),
        dict(momentum=0.9, nesterov=True, weight_decay=0.05),
    ],
    ids=["plain", "momentum", "nesterov", "nesterov-wd"],
)
def test_sgd_matches_torch_float64(kw):
    # float64, same operation order up to fused multiply-adds: ~1e-16 relative per
    # op over 15 steps, so 1e-12 has four orders of magnitude of headroom
    params = llama_params(torch.float64)
    grads = grad_stream(params, 15)
    ours, _ = run(fo.sgd(0.05, **kw), params, grads)
    ref = torch_sgd(params, grads, lr=0.05, **kw)
    assert max_abs_diff(ours, ref) <= 1e-12
    assert max_abs_diff(ours, params) > 0.1


def test_trace_closed_form():
    # t1 = g1, t2 = 0.5 t1 + g2; nesterov update 2 = g2 + 0.5 t2
    g1, g2 = {"x": torch.tensor([1.0])}, {"x": torch.tensor([2.0])}
    for nesterov, expected in [(False, 2.5), (True, 3.25)]:
        t = fo.trace(0.5, nesterov=nesterov)
        s = t.init(g1)
        _, s = t.update(g1, s)
        u, s = t.update(g2, s)
        assert u["x"].item() == expected
        assert s.trace["x"].item() == 2.5


def test_trace_rejects_nesterov_without_momentum():
    with pytest.raises(ValueError, match="nesterov"):
        fo.trace(0.0, nesterov=True)
