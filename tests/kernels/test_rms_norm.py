"""The RMSNorm Triton kernel (in the interpreter) against its reference and ``ftitan.nn.rms_norm``: values and
gradients (dx, dw) for ragged rows, fp32 and bf16 (fp32 master scale with bf16 rows too), compiled gradients,
torch.func stepping aside.

Tolerances: fp32 rtol 1e-5, atol 1e-5: the kernel and the reference differ in the summation order of the
mean of squares and of dw (measured ~5e-7). bf16: both compute the statistics in fp32 and round the
normalized value to bf16, the reference rounds every product in bf16 where the kernel rounds once, so
they differ by about a bf16 ulp of the output: rtol 2^-6 (two ulps), atol 2e-2. The reference equals
``nn.rms_norm`` to fp32 rounding (rtol 1.3e-6, torch's default; another engineer tunes nn's body for speed,
so not bit for bit).
"""

import pytest
import torch

from ftitan import nn
from ftitan.kernels import op
from ftitan.kernels import rms_norm as K
from tests.kernels._kernel_checks import Spy, assert_steps_aside_under_func, compiled_value_and_grads, value_and_grads

EPS = 1e-6
F32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2**-6, atol=2e-2)
SHAPES = [(3, 5, 37), (7, 16), (1, 130)]  # rows x width: widths not powers of two, one wider than a 128 block


def _case(shape, dtype=torch.float32, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(w_dtype or dtype)
    return x, w, torch.randn(shape, generator=g)


def _kernel(x, w):
    return K.rms_norm(x, w, EPS)


def _reference(x, w):
    return K.rms_norm_reference(x, w, EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_is_nn_rms_norm(dtype):
    x, w, _ = _case((4, 37), dtype)
    torch.testing.assert_close(_reference(x, w), nn.rms_norm(x, w, EPS))
    torch.testing.assert_close(_reference(x, w.float()), nn.rms_norm(x, w.float(), EPS))  # fp32 scale


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("dtype", "w_dtype", "tol"), [(torch.float32, None, F32), (torch.bfloat16, None, BF16),
                                                        (torch.bfloat16, torch.float32, BF16)])  # fmt: skip
def test_values_and_gradients_match_the_reference(shape, dtype, w_dtype, tol, monkeypatch):
    x, w, cot = _case(shape, dtype, w_dtype)
    spy = Spy(monkeypatch, K, ("_fwd_op", "_bwd_op"))
    with op.interpret():
        y, (dx, dw) = value_and_grads(_kernel, (x, w), cot)
    assert spy.calls == {"_fwd_op": 1, "_bwd_op": 1}
    ry, (rdx, rdw) = value_and_grads(_reference, (x, w), cot)
    assert y.dtype == ry.dtype == dtype and dx.dtype == dtype and dw.dtype == w.dtype
    torch.testing.assert_close(y, ry, **tol)
    torch.testing.assert_close(dx, rdx, **tol)
    torch.testing.assert_close(dw, rdw, **{**tol, "atol": tol["atol"] * shape[0]})  # a sum over the rows


def test_nn_rms_norm_dispatches_to_the_kernel(monkeypatch):
    x, w, _ = _case((5, 24))
    spy = Spy(monkeypatch, K, ("_fwd_op",))
    with op.interpret():
        y = nn.rms_norm(x, w, EPS, kernels="triton")
        assert spy.total() == 1
        nn.rms_norm(x, w, EPS, kernels="triton", invariant=True)  # the batch-invariant form wins
        nn.rms_norm(x.double(), w.double(), EPS, kernels="triton")  # float64: the reference
    assert spy.total() == 1
    torch.testing.assert_close(y, nn.rms_norm(x, w, EPS), **F32)
    assert torch.equal(nn.rms_norm(x, w, EPS, kernels="triton"), _reference(x, w))  # CPU, no interpret()


def test_compiled_gradients_equal_eager_reference():
    x, w, cot = _case((6, 37))
    with op.interpret():
        y, (dx, dw), code = compiled_value_and_grads(_kernel, (x, w), cot)
    assert "ftitan_kernels.rms_norm_fwd" in code and "ftitan_kernels.rms_norm_bwd" in code
    ry, (rdx, rdw) = value_and_grads(_reference, (x, w), cot)
    torch.testing.assert_close((y, dx, dw), (ry, rdx, rdw), **F32)


def test_torch_func_transforms_run_the_reference(monkeypatch):
    x, w, _ = _case((4, 19))
    assert_steps_aside_under_func(_kernel, _reference, (x, w), Spy(monkeypatch, K, ("_fwd_op", "_bwd_op")))
