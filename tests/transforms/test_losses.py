"""The chunked cross-entropy under every torch.func transform, against a plain log_softmax CE.

The reference is ``-log_softmax(h @ w.T)[target]`` in float64 written out here:
independent of both the fused Function and the plain chunked path. Inputs are
float64, so the loss computes its logits in float64 too and agreement is to
float64 rounding (1e-10); second derivatives are where a fused path that kept
its forward-formed gradients as constants would be silently wrong.
"""

import pytest
import torch
from torch.func import grad, jacrev, jvp, linearize, vmap

from ftitan.train import IGNORE_INDEX, chunked_cross_entropy
from ftitan.train import losses

TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64 on both sides, same maths in a different order


def _data(b=3, n=9, d=6, v=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, v, (b, n), generator=g)
    t[:, ::4] = IGNORE_INDEX
    return h, w, t


def _reference(h, w, t):  # mean over non-ignored targets of -log p(target)
    logp = torch.log_softmax(h @ w.T, dim=-1)
    valid = t != IGNORE_INDEX
    nll = -logp.gather(-1, torch.where(valid, t, 0)[..., None]).squeeze(-1)
    return (nll * valid).sum() / valid.sum()


def _ours(h, w, t):
    return chunked_cross_entropy(h, w, t, chunk_size=4)


def test_per_example_grad_under_vmap_of_grad():
    h, w, t = _data()
    got = vmap(grad(_ours, argnums=(0, 1)), in_dims=(0, None, 0))(h, w, t)
    want = [torch.func.grad(_reference, argnums=(0, 1))(h[i], w, t[i]) for i in range(h.shape[0])]
    torch.testing.assert_close(got[0], torch.stack([g[0] for g in want]), **TOL)
    torch.testing.assert_close(got[1], torch.stack([g[1] for g in want]), **TOL)


@pytest.mark.parametrize("how", ["jvp_of_grad", "jacrev_of_grad", "grad_of_grad"])
def test_second_derivatives_match_the_reference(how):
    # the fused Function's gradients are formed in forward: a second derivative through them
    # would drop the softmax curvature; the plain path must be chosen and be exact
    h, w, t = _data()
    h, t = h[0], t[0]
    v = torch.randn_like(w)
    if how == "jvp_of_grad":
        got = jvp(grad(lambda w_: _ours(h, w_, t)), (w,), (v,))[1]
        want = jvp(grad(lambda w_: _reference(h, w_, t)), (w,), (v,))[1]
    elif how == "jacrev_of_grad":
        got = jacrev(grad(lambda w_: _ours(h, w_, t)))(w)
        want = torch.autograd.functional.hessian(lambda w_: _reference(h, w_, t), w)
    else:
        got = grad(lambda w_: (grad(lambda u: _ours(h, u, t))(w_) * v).sum())(w)
        want = grad(lambda w_: (grad(lambda u: _reference(h, u, t))(w_) * v).sum())(w)
    torch.testing.assert_close(got, want, **TOL)
    assert got.abs().max() > 1e-3  # a constant-gradient path would give zeros here


def test_jvp_and_linearize_of_the_loss():
    h, w, t = _data()
    h, t = h[0], t[0]
    v = torch.randn_like(h)
    val, tan = jvp(lambda h_: _ours(h_, w, t), (h,), (v,))
    rval, rtan = jvp(lambda h_: _reference(h_, w, t), (h,), (v,))
    torch.testing.assert_close((val, tan), (rval, rtan), **TOL)
    out, fn = linearize(lambda h_: _ours(h_, w, t), h)
    torch.testing.assert_close((out, fn(v)), (rval, rtan), **TOL)


def test_forward_ad_dual_tensors():
    import torch.autograd.forward_ad as fwAD

    h, w, t = _data()
    v = torch.randn_like(w)
    with fwAD.dual_level():
        tan = fwAD.unpack_dual(_ours(h[0], fwAD.make_dual(w, v), t[0])).tangent
    torch.testing.assert_close(tan, jvp(lambda w_: _reference(h[0], w_, t[0]), (w,), (v,))[1], **TOL)


def test_outer_autograd_over_torch_func_grad_is_exact():
    # autograd.grad(create_graph) over a torch.func.grad whose inputs autograd tracks: the fused
    # Function would hand back constants; the plain path is taken and the Hessian is right
    h, w, t = _data()
    h, t = h[0], t[0]
    v = torch.randn_like(w)
    wr = w.clone().requires_grad_(True)
    g = grad(lambda w_: _ours(h, w_, t))(wr)
    hvp = torch.autograd.grad((g * v).sum(), wr)[0]
    want = jvp(grad(lambda w_: _reference(h, w_, t)), (w,), (v,))[1]
    torch.testing.assert_close(hvp, want, **TOL)


def test_plain_double_backward_through_the_fused_path_raises():
    h, w, t = _data()
    w = w.clone().requires_grad_(True)
    loss = _ours(h[0], w, t[0])
    with pytest.raises(RuntimeError, match="fused=False"):
        torch.autograd.grad(loss, w, create_graph=True)
    # the fix the error names: fused=False gives the exact Hessian-vector product
    loss = chunked_cross_entropy(h[0], w, t[0], chunk_size=4, fused=False)
    (g,) = torch.autograd.grad(loss, w, create_graph=True)
    v = torch.randn_like(w)
    hvp = torch.autograd.grad((g * v).sum(), w)[0]
    torch.testing.assert_close(hvp, jvp(grad(lambda w_: _reference(h[0], w_, t[0])), (w.detach(),), (v,))[1], **TOL)


def _fused_calls(monkeypatch):
    calls = []
    forward = losses._LinearCrossEntropy.forward

    def counting(*args):
        calls.append(1)
        return forward(*args)

    monkeypatch.setattr(losses._LinearCrossEntropy, "forward", staticmethod(counting))
    return calls


def test_fused_path_kept_for_plain_autograd_and_one_grad_level(monkeypatch):
    calls = _fused_calls(monkeypatch)
    h, w, t = _data()
    h, t = h[0].float(), t[0]
    w = w.float()
    grad(lambda w_: _ours(h, w_, t))(w)
    assert len(calls) == 1
    _ours(h, w.clone().requires_grad_(True), t).backward()
    assert len(calls) == 2
    vmap(grad(lambda w_, h_, t_: _ours(h_, w_, t_)), in_dims=(None, 0, 0))(w, h[None], t[None])
    assert len(calls) == 2  # under vmap: the plain path


def _compile_recording(fn, ops):
    def backend(gm, _example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    return torch.compile(fn, backend=backend, fullgraph=True)


def test_compiled_grad_keeps_the_fused_path_and_compiled_vmap_falls_back():
    # as in the train step, h comes out of the differentiated params (here h = x @ a)
    x, w, t = (z.float() if z.is_floating_point() else z for z in _data())
    a = torch.eye(x.shape[-1])

    def loss(a_, w_, x_, t_):
        return _ours(x_ @ a_, w_, t_)

    def reference(a_, w_, x_, t_):
        return _reference((x_ @ a_).double(), w_.double(), t_)

    torch._dynamo.reset()
    ops: list[str] = []
    step = _compile_recording(lambda a_, w_, x_, t_: grad(loss, argnums=(0, 1))(a_, w_, x_, t_), ops)
    got = step(a, w, x[0], t[0])
    assert "autograd_function_apply" in ops  # dynamo traced the fused Function into the one graph
    want = grad(reference, argnums=(0, 1))(a, w, x[0], t[0])
    torch.testing.assert_close(got, tuple(g.float() for g in want), rtol=1e-5, atol=1e-6)  # float32 logits

    ops.clear()
    per_example = _compile_recording(
        lambda a_, w_, x_, t_: vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(a_, w_, x_, t_), ops
    )
    got = per_example(a, w, x, t)
    assert ops and "autograd_function_apply" not in ops  # under vmap: the plain path, still one graph
    for i in range(x.shape[0]):
        want = grad(reference, argnums=(0, 1))(a, w, x[i], t[i])
        torch.testing.assert_close((got[0][i], got[1][i]), tuple(g.float() for g in want), rtol=1e-5, atol=1e-6)
