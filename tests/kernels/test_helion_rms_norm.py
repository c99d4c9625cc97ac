"""The Helion RMSNorm kernels against nn.norm.rms_norm's definition: the kernels compiled to Triton (run by
the Triton interpreter on CPU tensors, inside op.interpret()) and the same bodies in Helion's eager
reference mode (ref_mode=EAGER, what HELION_INTERPRET=1 runs; it cannot be set next to TRITON_INTERPRET).

Tolerances: fp32 1e-6 forward / 1e-5 gradients (the same float32 formula, summation order aside; measured
<= 1.2e-6). bf16: the eager mode equals the reference exactly; the Triton interpreter casts fp32 to bf16
by truncation (measured: half of 1024 random casts differ from torch's round-to-nearest, which a GPU
does), and the kernel rounds twice (normed, then the product), so within 2 bf16 ulps (rtol 2^-6).
"""

import attrs
import pytest
import torch

from ftitan import random
from ftitan.kernels import helion_rms_norm as hr
from ftitan.kernels import op
from ftitan.models import llama
from ftitan.nn import norm

EPS = 1e-6
TOL = dict(rtol=1e-6, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-5)


def _case(shape=(3, 13, 20), dtype=torch.float32, seed=0):
    """39 rows (two blocks of 16 and a ragged 7) of width 20 (not a power of two: masked columns)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    w = 1 + 0.1 * torch.randn(shape[-1], generator=g)
    return x.to(dtype), w.to(dtype)


class _Spy:
    """Counts the forward and backward op calls (patched over the module's globals)."""

    def __init__(self, monkeypatch):
        self.fwd = self.bwd = 0
        fwd, bwd = hr._FWD, hr._BWD

        def spy_fwd(*a):
            self.fwd += 1
            return fwd(*a)

        def spy_bwd(*a):
            self.bwd += 1
            return bwd(*a)

        monkeypatch.setattr(hr, "_FWD", spy_fwd)
        monkeypatch.setattr(hr, "_BWD", spy_bwd)


def test_forward_and_gradients_match_the_reference(monkeypatch):
    x, w = _case()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    spy = _Spy(monkeypatch)
    with op.interpret():
        y = hr.rms_norm(xs, ws, EPS)
        got = torch.autograd.grad((y * dy).sum(), (xs, ws))
    assert (spy.fwd, spy.bwd) == (1, 1)
    want_y = norm.rms_norm(xs, ws, EPS)
    want = torch.autograd.grad((want_y * dy).sum(), (xs, ws))
    torch.testing.assert_close(y, want_y, **TOL)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_reference_mode_matches_the_reference(dtype):
    x, w = _case(dtype=dtype, seed=2)
    x2 = x.reshape(-1, x.shape[-1])
    y, rstd = hr.KERNELS["eager"][0](x2, w, EPS)
    # the same ops in the same order, but the row sums' association follows the CPU's vector width
    # (bitwise on an AVX512 Xeon, an ulp apart on an AVX2 EPYC): one float32 rounding apart at most
    torch.testing.assert_close(y, hr.rms_norm_reference(x2, w, EPS), **TOL)
    torch.testing.assert_close(rstd, torch.rsqrt(x2.float().pow(2).mean(-1) + EPS), **TOL)
    dy = torch.randn(x2.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    xs, ws = x2.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.autograd.grad((hr.rms_norm_reference(xs, ws, EPS) * dy).sum(), (xs, ws))
    dx, dw_part = hr.KERNELS["eager"][1](dy, x2, w, rstd)
    tol = GRAD_TOL if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-6)  # bf16: one rounding of dx
    torch.testing.assert_close(dx, want[0], **tol)
    torch.testing.assert_close(dw_part.sum(0).to(dtype), want[1], **tol)


def test_bf16_through_the_interpreter_within_two_ulps():
    x, w = _case(dtype=torch.bfloat16, seed=4)
    with op.interpret():
        y = hr.rms_norm(x, w, EPS)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), hr.rms_norm_reference(x, w, EPS).float(), rtol=2**-6, atol=2**-8)


def test_compiled_gradients_with_autograd_grad_inside(monkeypatch):
    x, w = _case(seed=5)

    def grads(fn, x, w):
        xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
        return torch.autograd.grad(fn(xs, ws, EPS).square().sum(), (xs, ws))

    want = grads(hr.rms_norm_reference, x, w)
    graphs = []

    def backend(gm, example_inputs):  # aot_eager, recording the code dynamo captured (submodules included)
        graphs.append(gm.print_readable(print_output=False))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    # set and restored, not monkeypatched: undoing a monkeypatch of a dynamo config deletes the flag
    before, torch._dynamo.config.trace_autograd_ops = torch._dynamo.config.trace_autograd_ops, True
    try:
        with op.interpret():
            got = torch.compile(lambda x, w: grads(hr.rms_norm, x, w), fullgraph=True, backend=backend)(x, w)
    finally:
        torch._dynamo.config.trace_autograd_ops = before
    code = "".join(graphs)
    assert "ftitan_kernels.helion_rms_norm_fwd" in code and "ftitan_kernels.helion_rms_norm_bwd" in code
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def test_torch_func_transforms_and_float64_step_aside(monkeypatch):
    x, w = _case(seed=6)
    spy = _Spy(monkeypatch)
    ref = hr.rms_norm_reference
    tangent = torch.randn_like(x)
    with op.interpret():
        got_grad = torch.func.grad(lambda x: hr.rms_norm(x, w, EPS).square().sum())(x)
        got_vmap = torch.func.vmap(lambda x: hr.rms_norm(x, w, EPS))(x)
        got_jvp = torch.func.jvp(lambda x: hr.rms_norm(x, w, EPS), (x,), (tangent,))
        got_f64 = hr.rms_norm(x.double(), w.double(), EPS)
    assert (spy.fwd, spy.bwd) == (0, 0)
    torch.testing.assert_close(got_grad, torch.func.grad(lambda x: ref(x, w, EPS).square().sum())(x), **GRAD_TOL)
    torch.testing.assert_close(got_vmap, ref(x, w, EPS), **TOL)
    for a, b in zip(got_jvp, torch.func.jvp(lambda x: ref(x, w, EPS), (x,), (tangent,)), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert got_f64.dtype == torch.float64


def test_nn_rms_norm_and_a_model_dispatch_on_kernels_helion(monkeypatch):
    x, w = _case(seed=7)
    spy = _Spy(monkeypatch)
    on_cpu = norm.rms_norm(x, w, EPS, kernels="helion")  # no interpreter: the reference
    assert spy.fwd == 0
    with op.interpret():
        got = norm.rms_norm(x, w, EPS, kernels="helion")
    assert spy.fwd == 1
    torch.testing.assert_close(got, norm.rms_norm(x, w, EPS), **TOL)
    torch.testing.assert_close(on_cpu, norm.rms_norm(x, w, EPS), rtol=0, atol=0)
    cfg = llama.Config(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48, max_seq_len=32)
    params = llama.model(cfg).init(random.key(0))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    want, _ = llama.model(cfg).apply(params, tokens)
    with op.interpret():
        got, _ = llama.model(attrs.evolve(cfg, kernels="helion")).apply(params, tokens)
    assert spy.fwd >= 3  # the block's two norms and the final norm
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
