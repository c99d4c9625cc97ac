"""The fused linear + cross-entropy Triton kernels (interpreter) against the plain ``F.cross_entropy`` of the
float32 logits: the summed loss and dh / dW (scaled by an incoming gradient), ragged N, V, D (not multiples
of the tiles), ignored rows (a whole row block of them), soft-cap, fp32 and bf16; compiled (aot_eager, the
gradient by ``torch.autograd.grad`` inside); the reference under ``torch.func``; the loss's dispatch."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ftitan.kernels import linear_cross_entropy as L
from ftitan.kernels import op
from ftitan.train import losses

TILES = (16, 32, 16)  # (BLOCK_N, BLOCK_V, BLOCK_D): several tiles of each dim at the sizes below
N, V, D = 53, 101, 40  # 4 row blocks (the last ragged), 4 vocab tiles (ragged), 3 hidden steps (ragged)
G = 0.7  # the incoming gradient of the loss (the kernels scale d_logits by it)
# fp32: the tiles' float32 dots and the online logsumexp differ from the reference's one GEMM and
# log_softmax only by summation order (measured: loss 3e-5 of ~270, grads <= 1.2e-6)
F32 = dict(rtol=1e-5, atol=1e-5)
# bf16 inputs: the logits are exact products summed in float32 as in the reference (loss to F32), but
# d_logits enters the gradient dots rounded to bf16 and the gradients are returned in bf16: within a few
# bf16 steps (2 ** -8 relative) of the float32 reference gradient (measured: <= 1 step)
BF16_GRAD = dict(rtol=2**-6, atol=2**-6)


class _Spy:
    """Counts calls of the forward and backward ops (the kernel path) while patched in."""

    def __init__(self, monkeypatch):
        self.fwd = self.bwd = 0
        fwd, bwd = L.fwd_op, L.bwd_op

        def counted_fwd(*args):
            self.fwd += 1
            return fwd(*args)

        def counted_bwd(*args):
            self.bwd += 1
            return bwd(*args)

        monkeypatch.setattr(L, "fwd_op", counted_fwd)
        monkeypatch.setattr(L, "bwd_op", counted_bwd)


@contextlib.contextmanager
def _trace_autograd_ops():
    """dynamo traces ``torch.autograd.grad`` inside the block, and the flag is restored after (set, not patched:
    a ``monkeypatch.setattr`` of a dynamo config elsewhere deletes it on undo, and ``config.patch`` then fails)."""
    before = getattr(torch._dynamo.config, "trace_autograd_ops", False)
    torch._dynamo.config.trace_autograd_ops = True
    try:
        yield
    finally:
        torch._dynamo.config.trace_autograd_ops = before


def _case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = -100  # scattered ignored rows
    t[16:32] = -100  # and a whole row block of them
    return h, w, t


def _reference(h, w, t, cap):
    """The loss and (G-scaled) float32 gradients of the reference on float32 copies of the inputs."""
    hr, wr = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()  # (.float() of fp32 is itself)
    loss = L.linear_cross_entropy_reference(hr, wr, t, softcap=cap)
    return (loss.detach(), *torch.autograd.grad(loss * G, (hr, wr)))


@pytest.mark.parametrize("cap", [None, 2.0])  # 2.0: |logits| reach ~4, well into tanh's curve
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_grads_match_reference(monkeypatch, dtype, cap):
    h, w, t = _case(dtype)
    ref_loss, ref_dh, ref_dw = _reference(h, w, t, cap)
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
    spy = _Spy(monkeypatch)
    with op.interpret():
        loss = L.linear_cross_entropy(hk, wk, t, softcap=cap, tiles=TILES)
        dh, dw = torch.autograd.grad(loss * G, (hk, wk))
    assert (spy.fwd, spy.bwd) == (1, 1)  # the kernels gave these
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, **F32)
    tol = F32 if dtype == torch.float32 else BF16_GRAD
    torch.testing.assert_close(dh.float(), ref_dh, **tol)
    torch.testing.assert_close(dw.float(), ref_dw, **tol)
    assert torch.count_nonzero(dh[t == -100]) == 0  # ignored rows: exactly no gradient


def test_saturated_soft_cap_and_forward_without_grad(monkeypatch):
    """Logits far past the cap (|z / cap| of tens: tanh saturates, its chain factor underflows to 0) match
    the reference; under no_grad only the forward kernel runs."""
    h, w, t = _case(seed=5)
    w = w * 8
    ref_loss, ref_dh, ref_dw = _reference(h, w, t, 1.0)
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
    spy = _Spy(monkeypatch)
    with op.interpret():
        loss = L.linear_cross_entropy(hk, wk, t, softcap=1.0, tiles=TILES)
        dh, dw = torch.autograd.grad(loss * G, (hk, wk))
        with torch.no_grad():
            again = L.linear_cross_entropy(h, w, t, softcap=1.0, tiles=TILES)
    assert (spy.fwd, spy.bwd) == (2, 1)
    for a, b in ((loss, ref_loss), (again, ref_loss), (dh, ref_dh), (dw, ref_dw)):
        torch.testing.assert_close(a, b, **F32)


def test_frozen_head_or_hidden_skips_that_gradient(monkeypatch):
    """Only the gradients autograd asks for are computed: a frozen head (LoRA) launches no dW kernel."""
    h, w, t = _case(seed=6)
    _, ref_dh, ref_dw = _reference(h, w, t, None)
    launches = {"_lce_bwd_dh": 0, "_lce_bwd_dw": 0}

    class Counted:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(L, name)

        def __getitem__(self, grid):
            launches[self.name] += 1
            return self.kernel[grid]

    for name in launches:
        monkeypatch.setattr(L, name, Counted(name))
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
    with op.interpret():
        (dh,) = torch.autograd.grad(L.linear_cross_entropy(hk, w, t, tiles=TILES) * G, hk)
        assert launches == {"_lce_bwd_dh": 1, "_lce_bwd_dw": 0}
        (dw,) = torch.autograd.grad(L.linear_cross_entropy(h, wk, t, tiles=TILES) * G, wk)
        assert launches == {"_lce_bwd_dh": 1, "_lce_bwd_dw": 1}
    torch.testing.assert_close(dh, ref_dh, **F32)
    torch.testing.assert_close(dw, ref_dw, **F32)


def test_all_rows_ignored_gives_zero_loss_and_grads():
    h, w, t = _case()
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
    with op.interpret():
        loss = L.linear_cross_entropy(hk, wk, torch.full_like(t, -100), tiles=TILES)
        dh, dw = torch.autograd.grad(loss, (hk, wk))
    assert float(loss.detach()) == 0.0 and torch.count_nonzero(dh) == 0 and torch.count_nonzero(dw) == 0


def test_chunked_cross_entropy_dispatches_for_triton_kernels(monkeypatch):
    """``losses.chunked_cross_entropy(kernels="triton")`` runs the kernels (default tiles) and gives the
    fused chunked path's mean loss and gradients; ``kernels="torch"`` never calls them."""
    h, w, t = _case(seed=1)
    spy = _Spy(monkeypatch)

    def run(kernels):
        hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = losses.chunked_cross_entropy(hk, wk, t, chunk_size=16, logit_softcap=3.0, kernels=kernels)
        return (loss, *torch.autograd.grad(loss, (hk, wk)))

    with op.interpret():
        plain = run("torch")
        assert (spy.fwd, spy.bwd) == (0, 0)
        got = run("triton")
    assert (spy.fwd, spy.bwd) == (1, 1)
    for a, b in zip(got, plain, strict=True):
        torch.testing.assert_close(a, b, **F32)


def test_next_token_loss_reads_the_model_configs_kernels(monkeypatch):
    """``next_token_loss`` of a model whose config says ``kernels="triton"``: the train step's autograd path
    (``value_and_grad(impl="autograd")``) runs the kernels, ``impl="func"`` the reference; the same mean loss
    and gradients as the ``kernels="torch"`` model."""
    from types import SimpleNamespace

    from ftitan.train import value_and_grad

    def model(kernels):
        return SimpleNamespace(apply=lambda p, x, logits, **_: (p["emb"][x], None), apply_with_aux=None,
                               head=lambda p: p["head"], logit_softcap=3.0,
                               config=SimpleNamespace(kernels=kernels))  # fmt: skip

    g = torch.Generator().manual_seed(4)
    params = {"emb": torch.randn(V, D, generator=g), "head": torch.randn(V, D, generator=g) * 0.5}
    inputs = torch.randint(0, V, (3, 13), generator=g)
    batch = {"inputs": inputs, "targets": inputs.roll(-1, 1).masked_fill(inputs % 7 == 0, -100)}
    want_grads, (want, _) = value_and_grad(losses.next_token_loss(model("torch")))(params, batch)
    spy = _Spy(monkeypatch)
    with op.interpret(), _trace_autograd_ops():  # (restores the flag impl="autograd" sets)
        func_grads, (func, _) = value_and_grad(losses.next_token_loss(model("triton")))(params, batch)
        assert (spy.fwd, spy.bwd) == (0, 0)  # torch.func: the reference
        got_grads, (got, _) = value_and_grad(losses.next_token_loss(model("triton")), impl="autograd")(params, batch)
    assert (spy.fwd, spy.bwd) == (1, 1)
    for loss, grads in ((func, func_grads), (got, got_grads)):
        torch.testing.assert_close(loss, want, **F32)
        for k in params:
            torch.testing.assert_close(grads[k], want_grads[k], **F32)


def test_compiled_gradients_match_eager_reference(monkeypatch):
    h, w, t = _case(seed=2)
    ref_loss, ref_dh, ref_dw = _reference(h, w, t, 3.0)

    def loss_and_grads(h, w):
        loss = L.linear_cross_entropy(h, w, t, softcap=3.0, tiles=TILES)
        return loss.detach(), *torch.autograd.grad(loss * G, (h, w))

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm.print_readable(print_output=False))
        return torch._dynamo.backends.debugging.aot_eager(gm, inputs)

    torch._dynamo.reset()
    compiled = torch.compile(loss_and_grads, fullgraph=True, backend=backend)
    with op.interpret(), _trace_autograd_ops():
        loss, dh, dw = compiled(h.clone().requires_grad_(), w.clone().requires_grad_())
    assert any("linear_cross_entropy_fwd" in g and "linear_cross_entropy_bwd" in g for g in graphs)
    torch.testing.assert_close(loss, ref_loss, **F32)
    torch.testing.assert_close(dh, ref_dh, **F32)
    torch.testing.assert_close(dw, ref_dw, **F32)


def test_steps_aside_under_torch_func_transforms(monkeypatch):
    h, w, t = _case(seed=3)

    def f(fn):
        return lambda h, w: fn(h, w, t, softcap=3.0)

    spy = _Spy(monkeypatch)
    with op.interpret():
        grad = torch.func.grad(f(L.linear_cross_entropy), argnums=(0, 1))(h, w)
        _, tangent = torch.func.jvp(f(L.linear_cross_entropy), (h, w), (torch.ones_like(h), torch.ones_like(w)))
        batched = torch.func.vmap(f(L.linear_cross_entropy), in_dims=(0, None))(torch.stack([h, 2 * h]), w)
    assert (spy.fwd, spy.bwd) == (0, 0)  # each transform saw the reference's plain ops
    ref = f(L.linear_cross_entropy_reference)
    for a, b in zip(grad, torch.func.grad(ref, argnums=(0, 1))(h, w), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(tangent, torch.func.jvp(ref, (h, w), (torch.ones_like(h), torch.ones_like(w)))[1])
    torch.testing.assert_close(batched[1], ref(2 * h, w))


def test_double_backward_and_bad_tiles_are_refused():
    h, w, t = _case()
    hk = h.clone().requires_grad_()
    with op.interpret():
        loss = L.linear_cross_entropy(hk, w, t, tiles=TILES)
        with pytest.raises(RuntimeError, match="fused=False"):
            torch.autograd.grad(loss, hk, create_graph=True)
        with pytest.raises(ValueError, match="power of 2 >= 16"):
            L.linear_cross_entropy(hk, w, t, tiles=(16, 24, 16))
