"""The SwiGLU gating Triton kernel (in the interpreter) against its reference and ``ftitan.nn.swiglu``: values
and gradients for ragged sizes, fp32 and bf16, the MLP through ``nn.swiglu(kernels="triton")``, compiled
gradients, torch.func stepping aside.

Tolerances: fp32 rtol 1e-5, atol 1e-6: Triton's ``1 / (1 + exp(-g))`` and torch's sigmoid differ by an ulp
or two (measured 5e-7 on values of order 1). bf16: the reference rounds ``g * s`` to bf16 before ``* up``,
the kernel computes in fp32 and rounds once, so they differ by about a bf16 ulp: rtol 2^-6 (two ulps),
atol 2e-2. The reference is ``nn.swiglu``'s gating, checked through the whole MLP to fp32 rounding.
"""

import pytest
import torch

from ftitan import nn, random
from ftitan.kernels import op
from ftitan.kernels import swiglu as K
from tests.kernels._kernel_checks import Spy, assert_steps_aside_under_func, compiled_value_and_grads, value_and_grads

F32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2**-6, atol=2e-2)
SHAPES = [(3, 5, 37), (1100,), (2, 1025)]  # not multiples of the 1024-element block


def _case(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up, cot = (3 * torch.randn(shape, generator=g) for _ in range(3))
    return gate.to(dtype), up.to(dtype), cot


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, F32), (torch.bfloat16, BF16)])
def test_values_and_gradients_match_the_reference(shape, dtype, tol, monkeypatch):
    gate, up, cot = _case(shape, dtype)
    spy = Spy(monkeypatch, K, ("_fwd_op", "_bwd_op"))
    with op.interpret():
        y, grads = value_and_grads(K.swiglu, (gate, up), cot)
    assert spy.calls == {"_fwd_op": 1, "_bwd_op": 1}
    ry, rgrads = value_and_grads(K.swiglu_reference, (gate, up), cot)
    assert y.dtype == dtype and all(g.dtype == dtype for g in grads)
    torch.testing.assert_close(y, ry, **tol)
    torch.testing.assert_close(grads, rgrads, **{**tol, "atol": 3 * tol["atol"]})  # |dgate| reaches ~3x |dy up|


@pytest.mark.parametrize("fused", [False, True])
def test_nn_swiglu_with_triton_kernels_is_nn_swiglu(fused, monkeypatch):
    d, f = 24, 40
    p = nn.init_swiglu(random.key(0), d, f)
    if fused:  # ftitan.infer.fuse_projections' one gate-and-up matrix
        p = {"w13": torch.cat([p["w1"], p["w3"]]), "w2": p["w2"]}
    x, cot = torch.randn(2, 7, d), torch.randn(2, 7, d)
    spy = Spy(monkeypatch, K, ("_fwd_op", "_bwd_op"))
    params = sorted(p)

    def mlp(kernels):
        return lambda x, *ws: nn.swiglu(x, **dict(zip(params, ws, strict=True)), kernels=kernels)

    with op.interpret():
        y, grads = value_and_grads(mlp("triton"), (x, *p.values()), cot)
    assert spy.calls == {"_fwd_op": 1, "_bwd_op": 1}
    ry, rgrads = value_and_grads(mlp("torch"), (x, *p.values()), cot)
    torch.testing.assert_close((y, grads), (ry, rgrads), **F32)
    assert torch.equal(mlp("triton")(x, *p.values()), ry)  # CPU, no interpret(): the reference, bit for bit


def test_compiled_gradients_equal_eager_reference():
    gate, up, cot = _case((5, 37))
    with op.interpret():
        y, grads, code = compiled_value_and_grads(K.swiglu, (gate, up), cot)
    assert "ftitan_kernels.swiglu_fwd" in code and "ftitan_kernels.swiglu_bwd" in code
    ry, rgrads = value_and_grads(K.swiglu_reference, (gate, up), cot)
    torch.testing.assert_close((y, grads), (ry, rgrads), **F32)


def test_torch_func_transforms_run_the_reference(monkeypatch):
    gate, up, _ = _case((4, 19))
    assert_steps_aside_under_func(K.swiglu, K.swiglu_reference, (gate, up), Spy(monkeypatch, K, ("_fwd_op", "_bwd_op")))
