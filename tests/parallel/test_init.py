"""Per-rank init (``parallel.init_params``) and streaming HF loads into a layout (``hf.load_hf_sharded``).

- Blocks: ``local_block`` names the indices ``local_slice`` takes; ``nn.init(specs, key, blocks=...)``
  equals the slices of the whole init, bit for bit, for every built-in initializer, and an
  initializer without ``block=`` falls back to drawing whole and slicing.
- Every rank of dp_shard 2 x tp 2, ep 2 x dp_shard 2 and pp 2 x tp 2, in one process with a fake process
  group (``_fake_ranks.py``, run in a subprocess so the group cannot leak into other tests): every
  registered family, values bit-equal to ``shard_params(stage_params(model.init(key)))`` and to
  ``shard_params(stage_params(load_hf(dir)))``; each rank reads exactly its local elements.
- llama3-8b under dp_shard 8 (rank 3 of a fake group of 8, the meta device): the tensors created are this
  rank's shards and nothing bigger.
- Real gloo ranks: the ``_checks_init.py`` checks of the ``_parity.py`` launch.
"""

from __future__ import annotations

import pytest
import torch

import ftitan as ft
from ftitan import nn
from ftitan.parallel import Sharding
from ftitan.parallel.init import local_block
from ftitan.parallel.rules import local_slice


# ---------------------------------------------------------------- blocks


@pytest.mark.parametrize(
    ("shape", "dims", "sizes"),
    [
        ((8, 12), (("tp",), ("dp_shard",)), {"tp": 2, "dp_shard": 4}),
        ((4, 6, 8), (("ep",), ("tp",), ("dp_shard",)), {"ep": 2, "tp": 3, "dp_shard": 2}),
        ((16, 4), (("dp_shard", "tp"), ()), {"dp_shard": 2, "tp": 4}),  # one dim over two axes, row-major
        ((5,), ((),), {}),
    ],
)
def test_local_block_is_the_slice_local_slice_takes(shape, dims, sizes):
    sizes = {a: sizes.get(a, 1) for a in ft.parallel.AXES}
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    s = Sharding(dims)
    axes = [a for d in dims for a in d]
    for flat in range(max(1, torch.Size([sizes[a] for a in axes]).numel())):
        coords, rest = dict.fromkeys(ft.parallel.AXES, 0), flat
        for a in reversed(axes):
            coords[a], rest = rest % sizes[a], rest // sizes[a]
        block = local_block(shape, s, coords, sizes)
        assert torch.equal(x[tuple(slice(lo, hi) for lo, hi in block)], local_slice(x, s, coords, sizes))


def _specs():
    return {
        "w": nn.Param(shape=(12, 10), axes=("mlp", "embed"), init=nn.truncated_normal_init(0.02)),
        "e": nn.Param(shape=(4, 6, 10), axes=("experts", "mlp", "embed"), init=nn.normal_init(1.0)),
        "n": nn.norm_param(10),
        "b": nn.Param(shape=(12,), axes=("mlp",), init=nn.zeros_init),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_init_blocks_equal_slices_of_the_whole_init(dtype):
    specs, key = _specs(), ft.random.key(7)
    full = nn.init(specs, key, dtype=dtype)
    blocks = {"w": ((3, 9), (2, 7)), "e": ((1, 3), (0, 6), (5, 10)), "n": ((4, 8),), "b": ((0, 0),)}
    got = nn.init(specs, key, dtype=dtype, blocks=blocks)
    for path, block in blocks.items():
        want = full[path][tuple(slice(lo, hi) for lo, hi in block)]
        assert got[path].dtype == dtype and torch.equal(got[path], want), path
    assert torch.equal(nn.init(specs, key, dtype=dtype, blocks={"w": ((0, 12),)})["w"], full["w"])
    assert nn.init(specs, key, device="meta", blocks={"e": ((0, 2),)})["e"].shape == (2, 6, 10)


def test_an_initializer_without_block_falls_back_to_slicing():
    calls = []

    def plain(key, shape, dtype, device):  # no block= parameter: drawn whole, then sliced
        calls.append(shape)
        return ft.random.uniform(key, shape, dtype=dtype, device=device)

    specs = {"u": nn.Param(shape=(6, 4), axes=("mlp", "embed"), init=plain)}
    assert not nn.param.takes_block(plain) and nn.param.takes_block(nn.ones_init)
    full = nn.init(specs, ft.random.key(1))["u"]
    part = nn.init(specs, ft.random.key(1), blocks={"u": ((2, 5), (1, 3))})["u"]
    assert torch.equal(part, full[2:5, 1:3]) and part.is_contiguous() and calls == [(6, 4), (6, 4)]


def test_bad_blocks_are_clear_errors():
    with pytest.raises(ValueError, match=r"not leaves of the specs: x\.y"):
        nn.init(_specs(), ft.random.key(0), blocks={"x.y": ((0, 1),)})
    with pytest.raises(ValueError, match=r"w: block dim 1 is \(2, 11\) but shape \(12, 10\) has 10"):
        nn.init(_specs(), ft.random.key(0), blocks={"w": ((0, 1), (2, 11))})


def test_without_a_layout_it_is_model_init():
    model = ft.models.llama.model(ft.models.llama.Config.debug())
    got = ft.parallel.init_params(model, ft.random.key(2), None, dtype=torch.bfloat16, device="meta")
    want = model.init(ft.random.key(2), dtype=torch.bfloat16, device="meta")
    assert ft.tree.paths(got) == ft.tree.paths(want) and got["embed"].device.type == "meta"


# ---------------------------------------------------------------- every rank, one process (fake group)


@pytest.mark.parametrize("layout", ["dp_shard2_tp2", "ep2_dp_shard2", "pp2_tp2"])
@pytest.mark.parametrize("kind", ["init", "hf"])
def test_every_rank_equals_shard_params_of_the_single_process_tensors(fake_ranks, kind, layout):
    r = fake_ranks[f"{kind}_{layout}"]
    assert "error" not in r, r["error"]
    assert r["n_bad"] == 0, r["bad"]
    assert r["leaves"] > 0
    # families without pipeline stages (they refuse pp > 1 by name); every other family is checked
    assert r["no_stage"] == (["deepseek_v4"] if layout.startswith("pp") else []), r["no_stage"]


def test_llama3_8b_dp_shard8_rank_creates_only_its_shards(run_checks):
    """Bytes and sizes of every tensor an op creates during ``init_params`` on rank 3 of dp_shard 8 (bf16,
    meta: the sizes are those a real device would allocate). The same count on the full-init fallback
    (a transformed ``init``) sees full-size tensors: the count would catch a full draw."""
    r = run_checks("_fake_ranks.py", "llama3_8b_memory", nproc=0, timeout=120)["llama3_8b_memory"]
    assert "error" not in r, r["error"]
    assert r["model_bytes"] > 16e9  # the 8B shape, bf16
    assert r["local_bytes"] <= r["model_bytes"] / 8 + r["replicated_bytes"]
    assert r["created_bytes"] == r["local_bytes"]  # nothing but the shards themselves was created
    assert r["max_created_numel"] == r["max_local_numel"] < r["full_max_numel"] / 7
    assert r["other_devices_max_numel"] <= 1  # keys only (0-d int64 on the CPU)
    assert r["fallback_max_created_numel"] == r["full_max_numel"]


# ---------------------------------------------------------------- real gloo ranks (_checks_init.py)

GLOO_CHECKS = [
    "init_dp_shard2_tp2_llama",
    "init_pp2_dp_shard2_qwen3_moe",
    "init_ep2_tp2_deepseek_v3",  # bf16: the routing bias stays float32
    "hf_dp_shard2_tp2_qwen3_moe",  # hub per-expert bf16 checkpoint -> fp32
    "hf_pp2_ep2_deepseek_v3_fused",  # transformers-5 fused fp32, index-sharded -> bf16; from_pretrained(layout=)
]


@pytest.mark.parametrize("name", GLOO_CHECKS)
def test_gloo_ranks_equal_shard_params(parity_results, name):
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert r["n_bad"] == 0, r["bad"]
    assert r["leaves"] > 0 and r["local_numel"] > 0
