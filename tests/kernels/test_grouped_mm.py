"""grouped_mm against the naive per-group loop: values, gradients (autograd and torch.func), compile."""

import pytest
import torch

from ftitan.kernels.grouped_mm import grouped_mm, grouped_mm_reference

# fp32: the op and the loop both run one GEMM per group on the same
# rows, so values and gradients agree to float rounding (exact in practice)
TOL = dict(rtol=1e-6, atol=1e-6)


def _case(sizes: list[int], k: int = 8, n: int = 5, seed: int = 0):  # n=5: odd width (fallback path)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), k, generator=g)
    w = torch.randn(len(sizes), k, n, generator=g)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    return x, w, offs


@pytest.mark.parametrize("n", [5, 8])  # 8 fp32 = 32 bytes: torch._grouped_mm; 5: per-group fallback
@pytest.mark.parametrize("sizes", [[3, 4, 3], [0, 7, 0, 3], [10], [0, 0, 5]])
def test_forward_matches_loop(sizes, n):
    x, w, offs = _case(sizes, n=n)
    torch.testing.assert_close(grouped_mm(x, w, offs), grouped_mm_reference(x, w, offs), **TOL)


@pytest.mark.parametrize("n", [5, 8])
@pytest.mark.parametrize("sizes", [[3, 4, 3], [0, 7, 0, 3]])
def test_grads_match_loop_autograd_and_func(sizes, n):
    x, w, offs = _case(sizes, n=n, seed=1)
    dy = torch.randn(x.shape[0], w.shape[-1])

    def loss(fn, x, w):
        return (fn(x, w, offs) * dy).sum()

    ref = torch.func.grad(lambda x, w: loss(grouped_mm_reference, x, w), argnums=(0, 1))(x, w)
    got_func = torch.func.grad(lambda x, w: loss(grouped_mm, x, w), argnums=(0, 1))(x, w)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    got_autograd = torch.autograd.grad(loss(grouped_mm, xa, wa), (xa, wa))
    for r, a, b in zip(ref, got_func, got_autograd, strict=True):
        torch.testing.assert_close(a, r, **TOL)
        torch.testing.assert_close(b, r, **TOL)
    # an empty group's weight gets an exactly zero gradient
    for gi, size in enumerate(sizes):
        if size == 0:
            assert torch.count_nonzero(got_func[1][gi]) == 0


def test_sum_backward_with_broadcast_grad():
    x, w, offs = _case([2, 3])
    w.requires_grad_()
    grouped_mm(x, w, offs).sum().backward()  # a zero-stride incoming grad
    torch.testing.assert_close(w.grad[0], x[:2].sum(0)[:, None].expand(-1, w.shape[-1]), **TOL)


@pytest.mark.parametrize(("backend", "n"), [("aot_eager", 8), ("aot_eager", 5), ("inductor", 8)])
def test_compiles_fullgraph_in_fp32(backend, n):
    x, w, offs = _case([3, 0, 5], n=n, seed=2)

    def f(x, w, offs):
        return torch.func.grad(lambda w: grouped_mm(x, w, offs).square().sum())(w)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend=backend)(x, w, offs)
    torch.testing.assert_close(got, f(x, w, offs), **TOL)


def test_bf16_matches_fp32_loop_within_bf16_rounding():
    x, w, offs = _case([4, 0, 4], n=8, seed=3)
    got = grouped_mm(x.bfloat16(), w.bfloat16(), offs).float()
    ref = grouped_mm_reference(x.bfloat16().float(), w.bfloat16().float(), offs)
    # inputs identical after rounding; the bf16 output rounding (2^-8 relative) dominates
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=1e-2)


def test_bad_inputs_name_the_shape():
    x, w, offs = _case([2, 2])
    with pytest.raises(ValueError, match="int32"):
        grouped_mm(x, w, offs.long())
    with pytest.raises(ValueError, match=r"w \(G, K, N\)"):
        grouped_mm(x, w[0], offs)
