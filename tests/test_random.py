"""Explicit keys: determinism, independence, counter-based blocks, vmap/compile, statistics."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy import stats

import ftitan.random as R

DRAWS = {
    "normal": lambda k, shape, **kw: R.normal(k, shape, std=0.5, **kw),
    "truncated_normal": lambda k, shape, **kw: R.truncated_normal(k, shape, std=0.02, bound=2.0, **kw),
    "uniform": lambda k, shape, **kw: R.uniform(k, shape, low=-1.0, high=3.0, **kw),
    "exponential": lambda k, shape, **kw: R.exponential(k, shape, **kw),
    "bits": lambda k, shape, **kw: R.bits(k, shape, **kw),
}
MASK = (1 << 64) - 1


def _ref_mix(z: int) -> int:
    # SplitMix64 (Steele et al. 2014) written out independently of ftitan.random, on Python ints
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_same_key_same_bits_and_different_keys_differ():
    k = R.key(0)
    a, b = R.normal(k, (64,)), R.normal(k, (64,))
    assert torch.equal(a, b)
    k1, k2 = R.split(k)
    assert not torch.equal(R.normal(k1, (64,)), R.normal(k2, (64,)))
    assert not torch.equal(R.normal(R.key(1), (64,)), a)


def test_fold_in_strings_ints_and_tensors_are_distinct_and_stable():
    k = R.key(7)
    keys = {R.key_data(R.fold_in(k, s)) for s in ["layers.0.attn.wq", "layers.0.attn.wk", 0, 1, 2]}
    assert len(keys) == 5
    assert R.key_data(R.fold_in(k, "x")) == R.key_data(R.fold_in(R.key(7), "x"))
    for i in [0, 3, -3, 2**40]:
        assert torch.equal(R.fold_in(k, i), R.fold_in(k, torch.tensor(i)))
    assert torch.equal(R.fold_in(k, 5), R.fold_in(k, torch.tensor(5, dtype=torch.int32)))
    three = R.split(k, 3)
    assert three.shape == (3,) and three.dtype == torch.int64
    assert all(torch.equal(three[i], R.fold_in(k, i)) for i in range(3))


def test_keys_kept_their_values_across_the_2026_12_04_change():
    # golden numbers from the Python-int implementation before keys became tensor arithmetic
    k = R.key(7)
    assert R.key_data(R.key(0)) == 16294208416658607535
    assert R.key_data(R.fold_in(k, "layers.0.attn.wq")) == 12832506905977899304
    assert [R.key_data(x) for x in R.split(k, 3)] == [5802186646602307193, 3804069750978119562, 1935967939234621812]
    assert R.key_data(R.fold_in(k, -3)) == 8071156467829568886


def test_bits_are_the_documented_counter_hash():
    # element i of a draw is mix(mix((k + i) * G) ^ k), checked against Python-int arithmetic:
    # this pins the int64 wrap-around and the masked (logical) right shifts
    k = R.fold_in(R.key(11), "w")
    kd = R.key_data(k)
    got = R.bits(k, (2, 3)).flatten().tolist()
    want = [_ref_mix(_ref_mix(((kd + i) * 0x9E3779B97F4A7C15) & MASK) ^ kd) for i in range(6)]
    assert [g & MASK for g in got] == want


def test_bits_identical_across_processes():
    code = "import ftitan.random as R; print(R.normal(R.fold_in(R.key(3), 'w'), (4,)).tolist())"
    outs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    here = R.normal(R.fold_in(R.key(3), "w"), (4,)).tolist()
    assert outs[0] == outs[1] == f"{here}\n"


def test_global_rng_state_is_untouched():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    R.normal(R.key(0), (10,))
    R.truncated_normal(R.key(0), (10,))
    assert torch.equal(torch.rand(3), expected)


def test_meta_device_gives_shape_only():
    x = R.normal(R.key(0), (1 << 20, 1 << 20), device="meta")
    assert x.is_meta and x.shape == (1 << 20, 1 << 20)
    y = R.truncated_normal(R.key(0), (1 << 20, 1 << 20), device="meta", block=((5, 9),), dtype=torch.bfloat16)
    assert y.is_meta and y.shape == (4, 1 << 20) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_a_block_equals_that_block_of_the_full_draw(name):
    draw, k = DRAWS[name], R.key(5)
    full = draw(k, (10, 6, 7))
    assert torch.equal(draw(k, (10, 6, 7), block=((3, 8),)), full[3:8])
    assert torch.equal(draw(k, (10, 6, 7), block=((3, 8), (1, 4), (2, 7))), full[3:8, 1:4, 2:7])
    assert draw(k, (10, 6, 7), block=((4, 4),)).shape == (0, 6, 7)
    if name != "bits":  # dtype: the float32 draw, then cast
        assert torch.equal(draw(k, (10, 6, 7), dtype=torch.bfloat16, block=((3, 8),)), full[3:8].bfloat16())


def test_big_eager_draws_are_computed_in_bounded_pieces(monkeypatch):
    k, shape = R.key(2), (7, 3, 50)
    one_piece = R.truncated_normal(k, shape, std=0.1)
    sizes = []
    real_hash = R._hash
    monkeypatch.setattr(R, "_hash", lambda key, index: sizes.append(index.numel()) or real_hash(key, index))
    monkeypatch.setattr(R, "_CPU_CHUNK", 40)  # smaller than one row (150): pieces split dim 1, then dim 2
    assert torch.equal(R.truncated_normal(k, shape, std=0.1), one_piece)
    assert max(sizes) <= 40 and sum(sizes) == one_piece.numel()
    sizes.clear()
    assert torch.equal(R.normal(k, shape, block=((2, 6), (1, 3))), R.normal(k, shape)[2:6, 1:3])
    assert max(sizes) <= 40


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_vmap_over_keys_equals_stacked_draws(name):
    draw = DRAWS[name]
    keys = R.split(R.key(9), 4)
    batched = torch.func.vmap(lambda k: draw(R.fold_in(k, "leaf"), (3, 4), block=((1, 3),)))(keys)
    stacked = torch.stack([draw(R.fold_in(k, "leaf"), (3, 4), block=((1, 3),)) for k in keys])
    assert torch.equal(batched, stacked)


def test_vmap_of_split_and_tensor_fold_in_equals_the_loop():
    keys, steps = R.split(R.key(1), 3), torch.tensor([0, 7, 7])
    got = torch.func.vmap(lambda k, s: R.split(R.fold_in(k, s), 2))(keys, steps)
    want = torch.stack([R.split(R.fold_in(k, int(s)), 2) for k, s in zip(keys, steps, strict=True)])
    assert torch.equal(got, want)


def _everything(k: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a, b = R.split(R.fold_in(R.fold_in(k, "layers.0.w"), step))
    return (
        R.normal(a, (16, 12), std=0.5),
        R.truncated_normal(b, (16, 12), std=0.02, block=((4, 10),), dtype=torch.bfloat16),
        R.uniform(a, (33,), low=-1.0, high=2.0),
        R.exponential(b, (5, 7)),
        R.bits(a, (9,)),
    )


def test_compiled_fullgraph_equals_eager_bit_for_bit():
    compiled = torch.compile(_everything, fullgraph=True, backend="aot_eager")
    k, step = R.key(3), torch.tensor(5)
    for got, want in zip(compiled(k, step), _everything(k, step), strict=True):
        assert torch.equal(got, want)


def test_string_data_is_a_constant_to_dynamo_without_importing_it():
    """``fold_in(k, "name")`` hashes the string in Python: marked as a constant result to dynamo (the test above
    traces it with fullgraph) by the attribute ``torch.compiler.assume_constant_result`` sets, so that
    ``import ftitan`` does not import torch._dynamo (~2 s of every process's start)."""

    def f():
        return 0

    marked = {"_dynamo_marked_constant": True}
    assert vars(torch.compiler.assume_constant_result(f)) == vars(R._str_int) == marked
    code = "import sys, ftitan; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.slow
def test_inductor_gives_the_same_bits_and_floats_within_two_ulp():
    # inductor's vectorized log/cos/ndtri may round the last bit differently from eager's kernels;
    # the integer hashes are exact
    k, step = R.key(3), torch.tensor(5)
    got, want = torch.compile(_everything, fullgraph=True)(k, step), _everything(k, step)
    assert torch.equal(got[-1], want[-1])
    for g, w in zip(got[:-1], want[:-1], strict=True):
        ulp = torch.finfo(w.dtype).eps * w.abs().clamp_min(1e-3)
        assert ((g - w).abs() <= 2 * ulp).all()


# ---- statistics: n = 200k draws; KS critical value at alpha = 1e-3 is 1.95 / sqrt(n) ~ 0.0044 -----------
N = 200_000
KS_MAX = 1.95 / math.sqrt(N)


def _ks(x: torch.Tensor, cdf) -> float:
    return float(stats.kstest(x.double().numpy(), cdf).statistic)


def test_normal_matches_the_normal_distribution():
    x = R.normal(R.key(21), (N,), std=2.0)
    assert _ks(x, stats.norm(scale=2.0).cdf) < KS_MAX
    assert abs(float(x.mean())) < 4 * 2.0 / math.sqrt(N)  # 4 sigma of the mean
    assert abs(float(x.std()) / 2.0 - 1) < 4 / math.sqrt(2 * N)  # 4 sigma of the std
    tail = float((x.abs() > 2 * 3.0).double().mean())  # |z| > 3: 0.27%
    assert abs(tail - 0.0027) < 4 * math.sqrt(0.0027 / N)


def test_truncated_normal_respects_bounds_and_matches_scipy():
    std, bound = 0.02, 2.0
    x = R.truncated_normal(R.key(22), (N,), std=std, bound=bound)
    assert float(x.abs().max()) <= bound * std
    ref = stats.truncnorm(-bound, bound, scale=std)
    assert _ks(x, ref.cdf) < KS_MAX
    assert abs(float(x.std()) / ref.std() - 1) < 4 / math.sqrt(2 * N)


def test_uniform_and_exponential_match_their_distributions():
    u = R.uniform(R.key(23), (N,), low=-1.0, high=3.0)
    assert float(u.min()) >= -1.0 and float(u.max()) < 3.0
    assert _ks(u, stats.uniform(loc=-1.0, scale=4.0).cdf) < KS_MAX
    e = R.exponential(R.key(24), (N,))
    assert float(e.min()) > 0 and bool(torch.isfinite(e).all())
    assert _ks(e, stats.expon.cdf) < KS_MAX
    assert abs(float(e.mean()) - 1) < 4 / math.sqrt(N)


def test_hash_bits_are_balanced_and_neighbours_uncorrelated():
    # every one of the 64 bits is set half the time, across a draw and across consecutive seeds
    h = R.bits(R.key(25), (N,))
    keys = torch.stack([R.key(s) for s in range(20_000)])
    seeds = torch.func.vmap(lambda k: R.bits(k, ()))(keys)
    for sample, n in [(h, N), (seeds, 20_000)]:
        ones = torch.stack([((sample >> b) & 1).double().mean() for b in range(64)])
        assert float((ones - 0.5).abs().max()) < 4.5 * 0.5 / math.sqrt(n)
    x = R.normal(R.key(26), (N,)).double().numpy()
    k1, k2 = R.split(R.key(27))
    y1, y2 = R.normal(k1, (N,)).double().numpy(), R.normal(k2, (N,)).double().numpy()
    for a, b in [(x[:-1], x[1:]), (y1, y2)]:
        assert abs(np.corrcoef(a, b)[0, 1]) < 4 / math.sqrt(N)


def test_extreme_hashes_give_finite_values():
    # the all-zero and all-one hashes are the extreme uniforms: u = 0 must not reach log(0)
    h = torch.tensor([0, -1, 1 << 62, -(1 << 63), (1 << 63) - 1], dtype=torch.int64)
    assert float(R._unit(h).min()) >= 0 and float(R._unit(h).max()) < 1
    u = R._open_unit(h)
    assert float(u.min()) > 0 and float(u.max()) < 1
    z = R._standard_normal(h)
    assert bool(torch.isfinite(z).all()) and float(z.abs().max()) <= math.sqrt(48 * math.log(2)) + 1e-5
    assert bool(torch.isfinite(-torch.log(u)).all()) and float((-torch.log(u)).min()) > 0


def test_bad_keys_shapes_and_blocks_are_clear_errors():
    with pytest.raises(TypeError, match="seed must be an int"):
        R.key(1.5)
    with pytest.raises(TypeError, match="expected a key"):
        R.fold_in(torch.zeros(2), 0)
    with pytest.raises(TypeError, match=r"normal: expected a key .*keys\[i\]"):
        R.normal(R.split(R.key(0), 2), (3,))
    with pytest.raises(TypeError, match="0-d integer tensor"):
        R.fold_in(R.key(0), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"block dim 1 is \(2, 9\) but shape \(4, 5\) has 5"):
        R.uniform(R.key(0), (4, 5), block=((0, 1), (2, 9)))
    with pytest.raises(ValueError, match="bound=0.0 must be finite"):
        R.truncated_normal(R.key(0), (3,), bound=0.0)

