"""Newton-Schulz: batching, expert stacks, agreement with a float64 reference."""

from __future__ import annotations

import pytest
import torch

import ftitan.optim as fo

from ._reference import newton_schulz_f64

SHAPES = [(16, 16), (12, 32), (40, 10), (1, 8)]

# float32 vs exact: a rounding error made at iteration t is amplified by at most
# max |p'(s)| = p'(0) = a = 3.4445 per remaining iteration (p(s) = a s + b s^3 + c s^5),
# so a few float32 ulps (6e-8) per step can grow by sum_k a^k ~ 200: ~4e-5 worst case.
# Observed here <= 9e-7 (sizes up to 256); 1e-5 keeps headroom for other BLAS while a
# wrong coefficient, transpose or matrix mix-up shows as >= 1e-2.
NS_F32_ATOL = 1e-5
# bf16 vs exact: observed <= 1.5e-2 ~ 2^-6 (a few bf16 eps 2^-8 at |x| <= 0.6); two bf16
# computations of the same matrix then differ by at most 2 * 2^-6.
NS_BF16_ATOL = 2 * 2**-6


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_matches_float64_reference(shape):
    G = randn(*shape)
    got = fo.newton_schulz(G, dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == G.shape and got.is_contiguous()
    torch.testing.assert_close(got.double(), newton_schulz_f64(G), rtol=0, atol=NS_F32_ATOL)


def test_orthogonalizes():
    # many steps of the quintic iteration put all singular values in ~[0.68, 1.13] (Jordan 2024)
    G = randn(24, 48)
    s = torch.linalg.svdvals(fo.newton_schulz(G, steps=5, dtype=torch.float32).double())
    assert s.min() > 0.5 and s.max() < 1.3
    assert torch.linalg.svdvals(G.double()).max() / torch.linalg.svdvals(G.double()).min() > 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_equals_per_matrix(dtype):
    # mathematically identical; a batched kernel may round differently (bitwise equal on
    # this CPU), so each side is only known to be within its dtype's error of the exact result
    atol = NS_BF16_ATOL if dtype == torch.bfloat16 else NS_F32_ATOL
    for shape in SHAPES:
        Gs = randn(5, *shape)
        batched = fo.newton_schulz(Gs, dtype=dtype)
        for i in range(5):
            torch.testing.assert_close(batched[i], fo.newton_schulz(Gs[i], dtype=dtype), rtol=0, atol=atol)


def test_expert_stack_and_leading_dims_are_per_matrix():
    stack = randn(2, 3, 12, 20)  # e.g. (layers, experts, out, in)
    out = fo.newton_schulz(stack, dtype=torch.float32)
    assert out.shape == stack.shape
    for i in range(2):
        for j in range(3):
            expected = fo.newton_schulz(stack[i, j], dtype=torch.float32)
            torch.testing.assert_close(out[i, j], expected, rtol=0, atol=NS_F32_ATOL)


def test_zero_matrix_stays_zero_and_bad_input():
    assert torch.equal(fo.newton_schulz(torch.zeros(4, 6)), torch.zeros(4, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\(\.\.\., m, n\)"):
        fo.newton_schulz(torch.ones(3))
