"""The blockwise int8 / fp8 (e4m3) quantize and dequantize Triton kernels (interpreter) against
``ftitan.flexshard.quant``'s torch reference: bit-identical values, scales and dequantized values on ragged
shapes and several block shapes, zero blocks and signed zeros, every rounding tie of both formats and
e4m3's subnormals; the FlexShard quantized gather sends the same bytes and passes the same gradients; the
ops compile (aot_eager) and step aside under torch.func."""

from __future__ import annotations

import pytest
import torch

import ftitan as ft
from ftitan import flexshard as fs
from ftitan.flexshard import packed, quant
from ftitan.kernels import op
from ftitan.kernels import quantize as K


class _Spy:
    """Counts calls of the quantize and dequantize ops (the kernel path) while patched in."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in ("quantize_op", "dequantize_op"):
            original = getattr(K, name)

            def counted(*args, _original=original):
                self.calls += 1
                return _original(*args)

            monkeypatch.setattr(K, name, counted)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so -0.0 != 0.0 and NaN == NaN: bit-identity, not value equality)."""
    return x.contiguous().reshape(-1).view(torch.uint8)


def _data(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[-1], base=10.0)  # 4 decades along rows
    n = shape[-1]
    x[..., : 40 if n > 100 else n // 3] = 0.0  # zero values, and whole zero blocks for blocks of <= 40 columns
    x[..., n // 2] = -0.0
    return x


def _assert_same_as_reference(x, fmt, block, dtype=torch.float32):
    rq, rs = quant.quantize_reference(x, fmt, block)
    ry = quant.dequantize_reference(rq, rs, block, dtype)
    with op.interpret():
        q, s = quant.quantize(x, fmt, block)
        y = quant.dequantize(rq, rs, block, dtype)
    assert q.dtype == rq.dtype and q.shape == rq.shape and s.shape == rs.shape and y.dtype == dtype
    assert torch.equal(_bits(q), _bits(rq)), int((_bits(q) != _bits(rq)).sum())
    assert torch.equal(_bits(s), _bits(rs))
    assert torch.equal(_bits(y), _bits(ry))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize(("shape", "block"), [((30, 300), 128), ((3, 17, 64), (16, 16)), ((3, 17, 64), 32),
                                              ((9, 50), (4, 24)), ((1000,), 128), ((7,), 5)])  # fmt: skip
def test_bit_identical_to_reference(monkeypatch, fmt, shape, block):
    spy = _Spy(monkeypatch)
    _assert_same_as_reference(_data(*shape), fmt, block)
    assert spy.calls == 2  # the kernels gave these


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_bf16_input_and_non_float32_outputs(fmt):
    x = _data(12, 70, seed=1).bfloat16()
    for dtype in (torch.bfloat16, torch.float64):  # the float32 products cast by torch, as the reference
        _assert_same_as_reference(x, fmt, 32, dtype)


def test_every_rounding_tie_and_subnormal():
    """Blocks whose amax is the format's qmax (scale 1), holding every tie: int8's half-integers (to even), and
    every midpoint of adjacent e4m3 values (subnormals and the binade carries included), both signs, plus
    values just past qmax (clamped)."""
    halves = torch.arange(-127.5, 128.0, 0.5)  # every half step, the +-127.5 ends clamp to +-127
    int8 = torch.cat([halves, torch.tensor([127.0])])  # amax 127.5: scale 127.5 / 127
    int8_exact = torch.cat([torch.arange(-126.5, 127.0, 1.0), torch.tensor([127.0, -0.0])])  # amax 127: scale 1
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, every value
    mids = (grid[1:] + grid[:-1]) / 2  # exact in float32
    fp8 = torch.cat([mids, -mids, grid, -grid, torch.tensor([448.0])])  # amax 448: scale 1
    for x, fmt in ((int8, "int8"), (int8_exact, "int8"), (fp8, "fp8")):
        _assert_same_as_reference(x, fmt, x.numel())  # one block
        _assert_same_as_reference(x, fmt, 16)  # blocks of 16: other scales, values in other places
    with op.interpret():
        q, s = quant.quantize(fp8, "fp8", fp8.numel())
    assert float(s[0]) == 1.0 and (q.float() != fp8).any()  # the midpoints did round


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_whole_float32_range_and_subnormal_inputs(fmt):
    """Magnitudes from 2 ** -149 to 2 ** 120 (so scales from subnormal to huge), and rows of subnormals only."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(24, 96, generator=g) * torch.exp2(torch.randint(-149, 121, (24, 96), generator=g).float())
    x[:4] = torch.randn(4, 96, generator=g) * 1e-40
    for block in (32, (4, 16)):
        _assert_same_as_reference(x, fmt, block)


def test_all_zero_tensor_and_empty():
    for x in (torch.zeros(5, 40), -torch.zeros(3, 8)):
        for fmt in ("int8", "fp8"):
            _assert_same_as_reference(x, fmt, (2, 16))
    with op.interpret():
        q, s = quant.quantize(torch.zeros(0, 8), "int8", 4)
    assert q.shape == (0, 8) and s.numel() == 0
    _assert_same_as_reference(torch.tensor(-3.0), "fp8", 4)  # a 0-d tensor: one block (the reference's path)


def test_flexshard_quantized_gather_same_bytes_and_gradients(monkeypatch):
    """FlexShard's quantized bucket in one process: the packed buffers (what the all-gather sends) are the same
    bytes with the kernels as without, and so are the gathered leaves and their straight-through gradients."""
    params = {"w": _data(50, 300, seed=2), "v": _data(7, 64, seed=3), "n": torch.ones(64)}
    buckets = [fs.Bucket("n", fs.Replicate()), fs.Bucket("**", fs.Shard(0), quantize="fp8", quant_block=(8, 32),
                                                         name="q")]  # fmt: skip
    plans = [fs.plan(params, buckets, world=2, rank=r) for r in range(2)]
    paths = [lp.path for lp in plans[0].members["q"]]
    shapes = plans[0].part_shapes("q")
    one = fs.plan(params, [fs.Bucket("**", quantize="int8")])
    weights = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(5)) for k, v in params.items()}

    def run():
        bufs = [packed.pack([p.shard(params)[k] for k in paths], shapes, torch.float32, "fp8", (8, 32)) for p in plans]
        local = ft.tree.map(lambda x: x.clone().requires_grad_(), one.shard(params))
        full = one.gather(local, "**")
        sum((full[k] * weights[k]).sum() for k in full).backward()
        return bufs, full, {k: v.grad for k, v in local.items()}

    want = run()
    spy = _Spy(monkeypatch)
    with op.interpret():
        got = run()
    assert spy.calls > 0
    for a, b in zip(got[0], want[0], strict=True):
        assert a.dtype == torch.uint8 and torch.equal(a, b)
    for k in want[1]:
        assert torch.equal(_bits(got[1][k].detach()), _bits(want[1][k].detach()))
        assert torch.equal(got[2][k], want[2][k]) and torch.equal(got[2][k], weights[k])


def test_compiles_and_steps_aside_under_torch_func(monkeypatch):
    x = _data(6, 48, seed=4)

    def roundtrip(x):
        q, s = quant.quantize(x, "fp8", (2, 16))
        return q, s, quant.dequantize(q, s, (2, 16))

    ref = roundtrip(x)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm.print_readable(print_output=False))
        return torch._dynamo.backends.debugging.aot_eager(gm, inputs)

    torch._dynamo.reset()
    with op.interpret():
        got = torch.compile(roundtrip, fullgraph=True, backend=backend)(x)
    assert any("ftitan_kernels.quantize" in g and "ftitan_kernels.dequantize" in g for g in graphs)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    spy = _Spy(monkeypatch)
    with op.interpret():
        batched = torch.func.vmap(lambda r: roundtrip(r)[2])(x.reshape(3, 2, 48))
        _, tangent = torch.func.jvp(lambda r: roundtrip(r)[2], (x,), (torch.ones_like(x),))
    assert spy.calls == 0  # the transforms saw the reference
    assert torch.equal(batched.reshape(6, 48), ref[2])  # (2, 16) blocks never straddle the vmapped pairs
    assert torch.count_nonzero(tangent) == 0  # quantize detaches: no derivative through the rounding
