"""The fused RoPE Triton kernel (in the interpreter) against its reference and ``ftitan.nn.apply_rope``:
q and k in one launch, cos/sin shared over the batch (T, Dh) or per row (B, T, Dh), a position table,
ragged head counts and widths, fp32 and bf16, compiled gradients, torch.func stepping aside.

Tolerances: fp32 rtol 1e-6, atol 1e-6: kernel and reference do the same two products and one sum per
element in fp32 (measured: bit-identical in the interpreter; a GPU may contract them into an FMA). bf16:
the reference rounds each product to bf16 before the sum, the kernel rounds once: about a bf16 ulp,
rtol 2^-6 (two ulps), atol 2e-2. The reference equals ``nn.apply_rope`` (checked to fp32 rounding).
"""

import pytest
import torch

from ftitan import nn
from ftitan.kernels import op
from ftitan.kernels import rope as K
from tests.kernels._kernel_checks import Spy, assert_steps_aside_under_func, compiled_value_and_grads, value_and_grads

F32 = dict(rtol=1e-6, atol=1e-6)
BF16 = dict(rtol=2**-6, atol=2e-2)


def _case(b=2, t=5, hq=3, hk=1, dh=12, per_row=False, dtype=torch.float32, seed=0):
    """q, k, cos, sin: dh=12 (half 6) and 3 heads are not powers of two (masked tiles)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, hq, dh, generator=g).to(dtype), torch.randn(b, t, hk, dh, generator=g).to(dtype)
    positions = torch.randint(0, 50, (b, t), generator=g) if per_row else torch.arange(3, 3 + t)
    cos, sin = nn.rope_cos_sin(positions, nn.rope_inv_freq(dh, 10_000.0))
    return q, k, cos, sin


def _qk(fn):
    """``fn(q, k, cos, sin) -> (q', k')`` as one tensor (so one cotangent covers both)."""
    return lambda q, k, cos, sin: torch.cat([t.flatten() for t in fn(q, k, cos, sin)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("per_row", [False, True])
def test_reference_is_nn_apply_rope(dtype, per_row):
    q, _, cos, sin = _case(per_row=per_row, dtype=dtype)
    torch.testing.assert_close(K.apply_rope_reference(q, cos, sin), nn.apply_rope(q, cos, sin))


@pytest.mark.parametrize(("hq", "hk", "dh"), [(3, 1, 12), (4, 2, 8), (1, 5, 2)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, F32), (torch.bfloat16, BF16)])
def test_q_and_k_in_one_launch_match_the_reference(hq, hk, dh, per_row, dtype, tol, monkeypatch):
    q, k, cos, sin = _case(hq=hq, hk=hk, dh=dh, per_row=per_row, dtype=dtype)
    cot = torch.randn(q.numel() + k.numel())
    spy = Spy(monkeypatch, K, ("_rope_op",))
    with op.interpret():
        y, (dq, dk) = value_and_grads(lambda q, k: _qk(K.apply_rope_qk)(q, k, cos, sin), (q, k), cot)
    assert spy.total() == 2  # one launch forward, one backward, for q and k together
    ry, (rdq, rdk) = value_and_grads(lambda q, k: _qk(lambda *a: (K.apply_rope_reference(a[0], *a[2:]),
                                                                  K.apply_rope_reference(a[1], *a[2:])))(q, k, cos, sin),
                                     (q, k), cot)  # fmt: skip
    assert y.dtype == dtype and dq.dtype == dk.dtype == dtype
    torch.testing.assert_close((y, dq, dk), (ry, rdq, rdk), **tol)


@pytest.mark.parametrize("sliced", [False, True])
def test_one_tensor_values_and_gradients(sliced, monkeypatch):
    """``apply_rope`` of one tensor (MLA's rope dims, Qwen3-Next's partial RoPE: a strided slice of the heads)."""
    q, _, cos, sin = _case(dh=12)
    x = torch.cat([q, q[..., :4]], dim=-1)[..., :12] if sliced else q  # sliced: not contiguous
    cot = torch.randn(q.shape)
    spy = Spy(monkeypatch, K, ("_rope_op",))
    with op.interpret():
        y, (dx,) = value_and_grads(lambda x: K.apply_rope(x, cos, sin), (x,), cot)
    assert spy.total() == 2
    ry, (rdx,) = value_and_grads(lambda x: K.apply_rope_reference(x, cos, sin), (x,), cot)
    torch.testing.assert_close((y, dx), (ry, rdx), **F32)


def test_nn_apply_rope_dispatches_to_the_kernel(monkeypatch):
    q, _, _, _ = _case(t=6)
    cos, sin = nn.rope_frequencies(12, 32, 10_000.0)  # a table, indexed by positions
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [9, 10, 11, 12, 13, 14]])
    spy = Spy(monkeypatch, K, ("_rope_op",))
    with op.interpret():
        y = nn.apply_rope(q, cos, sin, positions, kernels="triton")
    assert spy.total() == 1
    torch.testing.assert_close(y, nn.apply_rope(q, cos, sin, positions), **F32)
    assert torch.equal(nn.apply_rope(q, cos, sin, positions, kernels="triton"), nn.apply_rope(q, cos, sin, positions))
    with op.interpret():  # angles that want a gradient: the reference (the kernel gives them none)
        nn.apply_rope(q, cos.requires_grad_(), sin, positions, kernels="triton")
    assert spy.total() == 1


def test_compiled_gradients_equal_eager_reference():
    q, k, cos, sin = _case(per_row=True)
    cot = torch.randn(q.numel() + k.numel())
    with op.interpret():
        y, grads, code = compiled_value_and_grads(lambda q, k: _qk(K.apply_rope_qk)(q, k, cos, sin), (q, k), cot)
    assert code.count("ftitan_kernels.rope") >= 2  # the forward and the backward launch
    ry, rgrads = value_and_grads(lambda q, k: torch.cat([K.apply_rope_reference(q, cos, sin).flatten(),
                                                         K.apply_rope_reference(k, cos, sin).flatten()]),
                                 (q, k), cot)  # fmt: skip
    torch.testing.assert_close((y, grads), (ry, rgrads), **F32)


def test_torch_func_transforms_run_the_reference(monkeypatch):
    q, _, cos, sin = _case()
    assert_steps_aside_under_func(lambda x: K.apply_rope(x, cos, sin), lambda x: K.apply_rope_reference(x, cos, sin),
                                  (q,), Spy(monkeypatch, K, ("_rope_op",)))  # fmt: skip
