"""Blockwise quantization (int8, fp8 e4m3; 1 x B rows or B x B tiles): each value within its block's half
step of the unquantized one, the encoded buffer carries the scales, and a quantized bucket's gather (every
rank's encoded parts, simulated) gives the dequantized parts, straight-through gradients in one rank."""

from __future__ import annotations

import pytest
import torch

import ftitan as ft
from ftitan import flexshard as fs
from ftitan.flexshard import packed
from ftitan.flexshard import quant


def _data(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 1, shape[-1], base=10.0)  # magnitudes spread over 4 decades along the rows
    return torch.randn(*shape, generator=g) * scale


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("block", [128, 32, (16, 16)])
@pytest.mark.parametrize("shape", [(40, 300), (3, 17, 64), (1000,)])
def test_dequantized_values_are_within_half_a_step(fmt, block, shape):
    x = _data(*shape)
    x[..., :5] = 0.0  # zero values (and, for some blocks, zero blocks)
    q, scales = quant.quantize(x, fmt, block)
    assert q.dtype == quant.FORMATS[fmt][0] and q.shape == x.shape and scales.numel() == quant.n_scales(shape, block)
    y = quant.dequantize(q, scales, block)
    err = (y - x).abs()
    assert bool((err <= quant.error_bound(x, fmt, block)).all()), float((err - quant.error_bound(x, fmt, block)).max())
    assert float(err.max()) > 0  # it does round
    assert torch.equal(quant.decode(quant.encode(x, fmt, block), shape, fmt, block), y)
    assert quant.encode(x, fmt, block).numel() == quant.encoded_bytes(shape, block)


def test_int8_with_128_blocks_sends_about_half_of_bf16():
    n = 4096 * 4096
    assert quant.encoded_bytes((4096, 4096), 128) / (2 * n) == pytest.approx((1 + 4 / 128) / 2)  # 0.516


def test_quantized_bucket_gathers_every_ranks_dequantized_parts():
    params = {"w": _data(50, 300, seed=1), "v": _data(7, 64, seed=2), "n": torch.ones(64)}
    buckets = [fs.Bucket("n", fs.Replicate()), fs.Bucket("**", fs.Shard(0), quantize="int8", name="q")]
    world = 4
    plans = [fs.plan(params, buckets, world=world, rank=r) for r in range(world)]
    paths = [lp.path for lp in plans[0].members["q"]]
    shapes, dims = plans[0].part_shapes("q"), [plans[0].leaves[p].dim for p in paths]
    encoded = [packed.pack([p.shard(params)[k] for k in paths], shapes, torch.float32, "int8") for p in plans]
    assert len({e.numel() for e in encoded}) == 1 and encoded[0].dtype == torch.uint8  # padded alike: one all-gather
    full = dict(zip(paths, packed.unpack(torch.stack(encoded), shapes, dims, torch.float32, "int8"), strict=True))
    for path in ("w", "v"):
        # each rank quantized its own rows; rows are the blocks' direction, so it is the whole tensor's quantization
        want = quant.dequantize(*quant.quantize(params[path], "int8"), 128)
        assert torch.equal(full[path], want)
        assert bool(((full[path] - params[path]).abs() <= quant.error_bound(params[path], "int8")).all())


@pytest.mark.parametrize("fmt, block", [("int8", 128), ("fp8", 32), ("int8", (16, 16))])
def test_even_parts_are_dequantized_in_one_call_with_the_per_rank_values(monkeypatch, fmt, block):
    """Where every rank's part of a leaf has one shape and offset (even shards), ``unpack`` decodes them
    together (one ``quant.decode_rows`` call of 4 rows a leaf): the values of decoding each rank's part alone.
    An uneven leaf first ("a": 5 rows over 4 ranks) shifts the later offsets apart, and the per-rank path
    (one row a call) takes over."""
    world = 4
    calls: list[int] = []  # rows decoded by each decode_rows call inside unpack
    decode_rows = quant.decode_rows
    monkeypatch.setattr(quant, "decode_rows", lambda bufs, *a: calls.append(bufs.shape[0]) or decode_rows(bufs, *a))
    for params, want_calls in (
        ({"e": _data(8, 300, seed=5), "u": _data(256, seed=6), "t": _data(4, 6, 64, seed=7)}, [world] * 3),
        ({"a": _data(5, 64, seed=8), "e": _data(8, 300, seed=5)}, [1] * 2 * world),
    ):
        plans = [fs.plan(params, [fs.Bucket("**", fs.Shard(0), quantize=fmt, quant_block=block, name="q")],
                         world=world, rank=r) for r in range(world)]  # fmt: skip
        paths = [lp.path for lp in plans[0].members["q"]]
        shapes, dims = plans[0].part_shapes("q"), [plans[0].leaves[p].dim for p in paths]
        parts = [p.shard(params) for p in plans]
        every = torch.stack([packed.pack([pt[k] for k in paths], shapes, torch.float32, fmt, block) for pt in parts])
        calls.clear()
        got = dict(zip(paths, packed.unpack(every, shapes, dims, torch.float32, fmt, block), strict=True))
        assert calls == want_calls
        for k, path in enumerate(paths):
            per_rank = [quant.dequantize(*quant.quantize(pt[path], fmt, block), block) for pt in parts]
            assert torch.equal(got[path], torch.cat(per_rank, dim=dims[k])), path
        rows = torch.stack([quant.encode(pt["e"], fmt, block) for pt in parts])
        want = torch.stack([quant.decode(r, parts[0]["e"].shape, fmt, block) for r in rows])
        assert torch.equal(quant.decode_rows(rows, parts[0]["e"].shape, fmt, block), want)


def test_quantized_gather_passes_full_precision_gradients_through():
    params = {"w": _data(20, 256, seed=3)}
    plan = fs.plan(params, [fs.Bucket("**", quantize="fp8")])
    local = ft.tree.map(lambda x: x.clone().requires_grad_(), plan.shard(params))
    full = plan.gather(local, "**")["w"]
    assert not torch.equal(full, params["w"]) and full.dtype == torch.float32
    weights = torch.randn(20, 256, generator=torch.Generator().manual_seed(4))
    (full * weights).sum().backward()
    assert torch.equal(local["w"].grad, weights)


def test_a_bad_format_is_refused():
    with pytest.raises(ValueError, match="expected one of"):
        fs.Bucket("**", quantize="int4")
