"""Rules -> placements, the degree check, the placement dump (golden) and the sharding check. Single process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ftitan as ft
from ftitan import parallel
from ftitan.models import deepseek_v3, llama
from ftitan.parallel.rules import local_slice

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SIZES = {"dp_shard": 2, "tp": 2}


def test_degrees_must_multiply_to_world_size_and_the_error_names_the_product():
    dims = parallel.ParallelDims(dp_shard=2, tp=2)
    dims.check(4)
    with pytest.raises(ValueError, match=r"dp_shard 2 \* tp 2 = 4, but 8 processes were launched") as e:
        dims.check(8)
    assert "--nproc-per-node 4" in str(e.value)
    with pytest.raises(ValueError, match="parallel.tp=0"):
        parallel.ParallelDims(tp=0)


def test_activation_axes_skip_mesh_axes_an_earlier_dim_took():
    rules = parallel.default_rules()
    weight = parallel.resolve_one((64, 32), ("heads", "embed"), rules, SIZES)
    assert weight.dims == (("tp",), ("dp_shard",))  # TP on heads, FSDP on embed
    act = parallel.resolve_one((8, 16, 32), ("batch", "seq", "embed"), rules, SIZES)
    assert act.dims == (("dp_shard",), (), ())  # batch took dp_shard: embed stays whole
    several = parallel.resolve_one((8, 4), ("batch", None), rules, {"dp_replicate": 2, "dp_shard": 2, "ep": 2})
    assert several.dims == (("dp_replicate", "dp_shard", "ep"), ())


def test_size_one_axes_are_not_used_and_mesh_order_is_kept():
    rules = parallel.default_rules().with_rule("mlp", ("tp", "dp_shard"))
    s = parallel.resolve_one((8, 4), ("mlp", None), rules, {"dp_shard": 2, "tp": 2})
    assert s.dims == (("dp_shard", "tp"), ())  # mesh order, outermost first, whatever the rule's order
    assert parallel.resolve_one((8, 4), ("mlp", None), rules, {"tp": 2}).dims == (("tp",), ())


def test_missing_rule_names_the_leaf_and_the_fix():
    with pytest.raises(ValueError, match=r"layers.0.foo: logical axis 'bogus' has no rule; add \('bogus'"):
        parallel.resolve_one((4,), ("bogus",), parallel.default_rules(), SIZES, path="layers.0.foo")
    with pytest.raises(ValueError, match="unknown mesh axis 'fsdp'"):
        parallel.default_rules().with_rule("embed", "fsdp")


def test_uneven_split_names_the_leaf_and_suggests_an_override():
    with pytest.raises(ValueError, match=r"layers.0.attn.wk: dim 0 \(logical axis 'kv_heads'\) has size 6") as e:
        parallel.resolve_one((6, 32), ("kv_heads", "embed"), parallel.default_rules(), {"tp": 4}, path="layers.0.attn.wk")
    assert "with_override('layers.0.attn.wk'" in str(e.value)


def test_override_wins_for_matching_paths():
    rules = parallel.default_rules().with_override("layers.*.attn.wo", [(), ("tp",)])
    assert parallel.resolve_one((32, 64), ("embed", "heads"), rules, SIZES, path="layers.3.attn.wo").dims == ((), ("tp",))
    assert parallel.resolve_one((32, 64), ("embed", "heads"), rules, SIZES, path="layers.3.mlp.w2").dims == (
        ("dp_shard",),
        ("tp",),
    )


def test_placements_follow_dtensor_conventions():
    s = parallel.resolve_one((64, 32), ("heads", "embed"), parallel.default_rules(), SIZES)
    names = [type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "") for p in s.placements()]
    assert names == ["Replicate", "Replicate", "Shard(1)", "Replicate", "Replicate", "Shard(0)"]  # AXES order


def test_local_slice_splits_a_dim_over_several_axes_row_major():
    x = torch.arange(16).reshape(8, 2)
    s = parallel.Sharding((("dp_shard", "tp"), ()))
    sizes = {a: 1 for a in parallel.AXES} | SIZES
    blocks = [local_slice(x, s, {**{a: 0 for a in parallel.AXES}, "dp_shard": d, "tp": t}, sizes) for d in (0, 1) for t in (0, 1)]
    torch.testing.assert_close(torch.cat(blocks), x)  # outer axis dp_shard, inner tp: blocks in rank order


def _golden(name: str, dump: dict[str, str]) -> None:
    path = GOLDEN / name
    if os.environ.get("FTITAN_REGEN_GOLDEN"):
        path.write_text(json.dumps(dump, indent=1, sort_keys=True) + "\n")
    assert dump == json.loads(path.read_text()), f"placements changed; regenerate with FTITAN_REGEN_GOLDEN=1 if intended ({path})"


@pytest.mark.parametrize(
    "family,cfg,sizes",
    [
        ("llama", llama.Config.debug(), {"dp_shard": 2, "tp": 2}),
        ("deepseek_v3", deepseek_v3.Config.debug(), {"dp_shard": 2, "ep": 2, "tp": 2}),
    ],
)
def test_placement_dump_matches_golden(family, cfg, sizes):
    model = {"llama": llama, "deepseek_v3": deepseek_v3}[family].model(cfg)
    params = model.init(ft.random.key(0), device="meta")
    shardings = parallel.resolve(params, model.param_axes, parallel.default_rules(), sizes)
    dump = parallel.dump(shardings)
    # written by hand, not by the code under test (the golden file is): Megatron's column-parallel
    # projections split their output rows over tp and row-parallel ones their input columns, FSDP takes
    # the model dim, the vocabulary splits over tp, norms stay whole, routed experts split over ep first
    column = "(tp, dp_shard)"
    want = {"embed": column, "head": column, "norm": "(-)", "layers.0.attn_norm": "(-)", "layers.0.mlp_norm": "(-)",
            "layers.0.attn.wo": "(dp_shard, tp)", "layers.0.mlp.w1": column, "layers.0.mlp.w3": column,
            "layers.0.mlp.w2": "(dp_shard, tp)"}  # fmt: skip
    if family == "llama":
        want |= {"layers.0.attn.wq": column, "layers.0.attn.wk": column, "layers.0.attn.wv": column}
    else:  # MLA: the low-rank down projections are FSDP only, their up projections column-parallel
        want |= {"layers.0.attn.wq_a": "(dp_shard, -)", "layers.0.attn.wkv_a": "(dp_shard, -)",
                 "layers.0.attn.wq_b": column, "layers.0.attn.wkv_b": column, "layers.1.moe.shared.w1": column,
                 "layers.1.moe.shared.w2": "(dp_shard, tp)", "layers.1.moe.experts.w1": "(ep, tp, dp_shard)",
                 "layers.1.moe.experts.w3": "(ep, tp, dp_shard)", "layers.1.moe.experts.w2": "(ep, dp_shard, tp)"}  # fmt: skip
    assert {k: dump[k] for k in want} == want
    tag = "_".join(f"{k}{v}" for k, v in sizes.items())
    _golden(f"placements_{family}_debug_{tag}.json", dump)


def test_insufficiently_sharded_check_lists_replicated_large_leaves():
    model = llama.model(llama.Config.debug())
    params = model.init(ft.random.key(0), device="meta")
    rules = parallel.default_rules().with_rule("embed", ())  # FSDP turned off by mistake
    shardings = parallel.resolve(params, model.param_axes, rules, {"dp_shard": 4})
    with pytest.raises(ValueError, match=r"insufficiently sharded: \d+ leaves .* layers.0.attn.wq \(256, 256\)"):
        parallel.check_sharded(params, shardings, {"dp_shard": 4})
    good = parallel.resolve(params, model.param_axes, parallel.default_rules(), {"dp_shard": 4})
    parallel.check_sharded(params, good, {"dp_shard": 4})  # every large leaf is split over dp_shard


def test_cp_positions_are_a_balanced_permutation():
    t, cp = 32, 4
    chunks = [parallel.cp_positions(t, cp, r) for r in range(cp)]
    torch.testing.assert_close(torch.cat(chunks).sort().values, torch.arange(t))
    work = [int((c + 1).sum()) for c in chunks]  # keys each rank's queries see under a causal mask
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="multiple of 2 \\* cp = 8"):
        parallel.cp_positions(12, 4, 0)


def test_seams_are_no_ops_without_a_layout():
    x = torch.randn(2, 8, 4)
    assert parallel.current() is None
    assert parallel.shard_as(x, ("batch", "seq", "embed")) is x
    assert parallel.activations.column_input(x) is x and parallel.activations.row_output(x) is x


def test_mesh_is_made_once_per_shape_and_process_group(tmp_path):
    """Each ``init_device_mesh`` makes new gloo groups, and each group keeps polling threads for the life of
    the process: ``parallel.mesh`` hands back the mesh it made for the same degrees, and a new one after the
    process group was made again."""
    import torch.distributed as dist

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    assert not dist.is_initialized(), "an earlier test left a process group up"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg1'}", rank=0, world_size=1)
    try:
        first = parallel.mesh(dp_shard=1)
        after_first = threads()
        assert parallel.mesh(parallel.ParallelDims()) is first
        assert threads() == after_first  # no new groups, no new threads
        assert first.mesh_dim_names == parallel.AXES
    finally:
        parallel.shutdown()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg2'}", rank=0, world_size=1)
    try:
        again = parallel.mesh()
        assert again is not first  # the old mesh's groups died with the old process group
        assert parallel.mesh() is again
    finally:
        parallel.shutdown()
