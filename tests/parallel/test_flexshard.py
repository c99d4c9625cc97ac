"""FlexShard on real gloo ranks (checks in ``_checks_flexshard.py``, in the one torchrun launch of every
parity check): a plan's buckets (BlockShard heads, Owned MLP matrices, replicated norms, a Shard bucket per
layer) gather the exact params with one all-gather per bucket, and the parts' gradients, by autograd
through the gather or by ``reduce_grads``, are each rank's part of the single-process gradient, with one
reduce-scatter per bucket and one all-reduce for the replicated bucket."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("name", ["flexshard_dp4", "flexshard_dp2_tp2"])
def test_flexshard_gathers_and_reduces_one_collective_per_bucket(parity_results, name):
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert r["gathered_diff"] == 0.0 and r["loss_diff"] < 1e-6
    # float32 sums in another order (reduce-scatter over ranks vs one batch): rounding, far below the scale
    assert r["grad_diff"] < 1e-6 * max(1.0, r["grad_scale"] * 100) and r["reduce_diff"] < 1e-6
    assert r["forward_calls"] == {"all_gather": r["packed_buckets"]}
    want = {"reduce_scatter": r["packed_buckets"], "all_reduce": r["replicated_buckets"]}
    assert r["backward_calls"] == want and r["reduce_calls"] == want
    assert r["owners"] == list(range(r["world"]))  # the Owned matrices spread over every rank


@pytest.mark.parametrize("name", ["flexshard_muon_dp4", "flexshard_muon_dp2", "flexshard_muon_moe_dp4"])
def test_distributed_muon_equals_single_process_muon_with_the_same_blocks(parity_results, name):
    """Three steps of distributed Muon + AdamW against ``muon_with_adamw(blocks=...)`` on the full params fed
    the same gradients (Newton-Schulz in fp32): bit-exact on the Owned path, within 1e-6 elsewhere.

    Llama: per-head BlockShard (wq, wk), Owned matrices (MLP, wv), replicated norms, row-sharded wo / embed /
    head: only the row-sharded Muon matrices (wo) are all-gathered, once per step each. Qwen3-MoE: per-head
    rows of q / k / v and columns of o, whole experts per rank (6 over 4 ranks: 2, 2, 1, 1), Owned routers:
    no collective at all."""
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert r["moved"] > 1e-3  # the optimizer did move the params
    assert r["owned_diff"] == 0.0 and r["other_diff"] <= 1e-6  # (measured: 0.0 too, one thread per rank)
    if "moe" in name:
        assert r["gathered_leaves"] == [] and r["calls_per_step"] == {}
    else:
        assert r["gathered_leaves"] == ["layers.0.attn.wo", "layers.1.attn.wo"]
        assert r["calls_per_step"] == {"all_gather": 2.0}
    assert 0 < r["owned_here"] < r["owned"]  # rank 0 orthogonalizes some of the Owned matrices, not all


def test_quantized_gathers_send_half_of_bf16_in_one_collective_and_train_alike(parity_results):
    """int8 / fp8 blockwise gathers (values and float32 scales in one buffer): one all-gather per bucket, the
    bytes of a byte per value plus a scale per row block (this model's rows are 64 wide, so 1 + 4/64 bytes
    per value: 0.53x of bf16; 0.516x with 128-value blocks), each value within its format's bound, and 35
    AdamW steps on 4 ranks whose losses stay within 2% of the unquantized run's (100 in the slow tier)."""
    _assert_quantized(parity_results["flexshard_quantized_dp4"], steps=35)


@pytest.mark.slow
def test_quantized_gathers_train_alike_over_a_long_curve(slow_checks):
    """The same over 100 steps, down to a loss below a tenth of the first (the late steps, where the loss
    is small and a quantization error weighs most)."""
    name = "flexshard_quantized_dp4_100_steps"
    _assert_quantized(slow_checks(name)[name], steps=100)


def _assert_quantized(r: dict, steps: int) -> None:
    assert "error" not in r, r["error"]
    for fmt in ("bf16", "int8", "fp8"):
        assert r[f"{fmt}_calls"] == {"all_gather": r["buckets"]}
    for fmt in ("int8", "fp8"):
        assert r[f"{fmt}_within_bound"]
        assert r[f"{fmt}_bytes"] / r["bf16_bytes"] <= (1 + 4 / 64) / 2 + 0.005
    full, int8 = r["losses_fp32"], r["losses_int8"]
    assert len(full) == len(int8) == steps and full[-1] < 0.1 * full[0]  # it trains
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert abs(mean(int8[-10:]) - mean(full[-10:])) <= 0.02 * mean(full[-10:])
    assert abs(mean(int8) - mean(full)) <= 0.02 * mean(full)


def test_flexshard_state_saved_on_four_ranks_loads_resharded_on_two(parity_results):
    """Parts, distributed Muon + AdamW state and the step, saved by a 4-rank plan (``Plan.parts``: each block
    once, as ``ftitan.checkpoint.Part`` chunks) and loaded by a 2-rank plan of another mesh: the state that
    plan reaches on its own, bit for bit, and the next step from either is the same."""
    r = parity_results["flexshard_checkpoint_4_to_2"]
    assert "error" not in r, r["error"]
    assert r["files"] == 4 and r["world_b"] == 2 and r["step"] == 2 and r["leaves"] > 40
    assert r["state_diff"] == 0.0 and r["next_diff"] == 0.0


@pytest.mark.parametrize("name", ["flexshard_buckets_dp_shard2_tp2", "flexshard_buckets_ep2_dp_shard2"])
def test_dp_shard_runs_on_flexshard_buckets(parity_results, name):
    """``--parallel.dp-shard`` gathers through FlexShard: per-layer buckets (the default) give the per-leaf
    gathers' loss and gradients bit for bit, with a collective per layer (and kind: an MoE layer's experts,
    stored over ep, form their own) instead of one per leaf; the tp / ep activation collectives are the same."""
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert r["per_layer_loss"] == r["per_leaf_loss"] and r["grad_diff"] == 0.0
    layer, leaf = r["per_layer_calls"], r["per_leaf_calls"]
    saved = leaf["all_gather"] - layer["all_gather"]
    assert saved >= r["dp_shard_leaves"] - 2 * (r["layers"] + 1) > 0
    assert leaf["reduce_scatter"] - layer["reduce_scatter"] == saved
    assert layer.get("all_to_all") == leaf.get("all_to_all") and layer["all_reduce"] < leaf["all_reduce"]


def test_the_trainers_dp_shard_gathers_can_be_int8(parity_results):
    """``--flexshard.quantize int8`` (``parallel.make_train_step(quantize=...)``): the per-layer gathers send
    blockwise-quantized parts (this model's 64-wide rows: a scale per 64 values, ~0.3x of float32), the
    same collectives, 30 AdamW steps within 2% of the float32 gathers' losses. The compiled step is in the
    slow tier below (the quantized gathers' compile: ``tests/flexshard/test_plan.py``)."""
    r = parity_results["flexshard_trainer_int8_dp4"]
    assert "error" not in r, r["error"]
    assert r["int8_calls"] == r["fp32_calls"]
    assert r["int8_gather_bytes"] <= 0.31 * r["fp32_gather_bytes"]
    full, int8 = r["losses_fp32"], r["losses_int8"]
    assert full[-1] < 0.2 * full[0]  # it trains
    assert all(abs(a - b) <= 0.02 * a for a, b in zip(full, int8, strict=True))


@pytest.mark.slow
def test_the_trainers_int8_gathers_compile_to_the_eager_losses(slow_checks):
    """The same step compiled (aot_eager, the layered update too): four steps, the eager int8 losses."""
    name = "flexshard_trainer_int8_dp4_compiled"
    r = slow_checks(name)[name]
    assert "error" not in r, r["error"]
    assert len(r["losses_int8"]) == 4 and r["losses_int8_compiled"] == r["losses_int8"]


@pytest.mark.slow
def test_a_compiled_evaluation_of_a_sharded_model_is_the_eager_one(slow_checks):
    """The parallel loss under ``torch.no_grad`` compiled with fullgraph (aot_eager) on dp_shard 4,
    dp_shard 2 x tp 2 and tp 2 x cp 2, per-leaf and per-layer gathers, float32 and int8: the eager loss
    (the same ops; measured 0.0). The one-process form of this is tests/flexshard/test_plan.py's."""
    name = "flexshard_compiled_eval_layouts"
    r = slow_checks(name)[name]
    assert "error" not in r, r["error"]
    assert len(r["diffs"]) == 9 and max(r["diffs"].values()) <= 1e-6, r["diffs"]


@pytest.mark.parametrize("name", ["mesh_muon_dp_shard4", "mesh_muon_dp_shard2_tp2", "mesh_muon_block_dp_shard4",
                                  "mesh_muon_block_deepseek_dp_shard4"])
def test_trainers_distributed_muon_equals_single_process_muon(parity_results, name):
    """The trainer's Muon on DTensor state (``flexshard.mesh_muon_with_adamw``), three steps fed the same
    gradients as single-process ``muon_with_adamw`` with per-head blocks (Newton-Schulz in fp32, and in bf16
    for dp_shard 2 x tp 2: the shards then travel in bf16): bit-exact, with two all-to-alls a step (shards
    to owners, orthogonalized shards back) and no gather of every matrix.

    FSDP rows (dp_shard 4; dp_shard 2 x tp 2: the matrices split over both axes, one group of 4): every
    matrix is owned. Block placement: whole heads per rank, so q and o are orthogonalized where they are
    (one of 4 heads a rank); wk / wv have 2 kv heads for 4 ranks, so they are owned. DeepSeek-V3 with block
    placement: MLA's up-projections and output per head, and the expert stacks per expert, are local."""
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert r["moved"] > 1e-3 and r["diff"] == 0.0 and r["muon_diff"] == 0.0
    assert r["calls_per_step"] == {"all_to_all": 2.0}
    want = ("wq_b", "wkv_b", "wo") if "deepseek" in name else ("wq", "wk", "wv", "wo")
    assert sorted(r["blocks"]) == sorted(f"layers.*.attn.{w}" for w in want)
    if name in ("mesh_muon_dp_shard4", "mesh_muon_dp_shard2_tp2"):
        assert r["local"] == [] and len(r["owned"]) == 14
    elif name == "mesh_muon_block_dp_shard4":
        assert r["local"] == ["layers.0.attn.wo", "layers.0.attn.wq", "layers.1.attn.wo", "layers.1.attn.wq"]
    else:
        local = set(r["local"])
        for i in (1, 2):
            assert {f"layers.{i}.attn.wq_b", f"layers.{i}.attn.wkv_b", f"layers.{i}.attn.wo"} <= local
            assert {f"layers.{i}.moe.experts.w{j}" for j in (1, 2, 3)} <= local
        assert "layers.1.moe.shared.w1" in r["owned"] and "layers.1.attn.wq_a" in r["owned"]


def test_trainers_distributed_muon_trains_with_int8_gathers(parity_results):
    """``parallel.make_train_step`` on dp_shard 4 with distributed Muon (per head), float32 and int8 gathers,
    against the single-process Muon step on the same batch: 12 steps, losses within 2%."""
    r = parity_results["mesh_muon_train_dp_shard4"]
    assert "error" not in r, r["error"]
    ref = r["ref"]
    assert ref[-1] < 0.75 * ref[0]  # it trains
    for label in ("fp32", "int8"):
        assert len(r[label]) == len(ref)
        assert max(abs(a - b) / b for a, b in zip(r[label], ref, strict=True)) < 0.02


def test_trainers_muon_state_reshards_between_placements(parity_results):
    """DTensor Muon state saved from whole-heads-per-rank dp_shard 4 loads into dp_shard 2 x tp 2 as exactly
    the state that layout reaches itself, and the next step from it is the same."""
    r = parity_results["mesh_muon_checkpoint_block4_to_dp2_tp2"]
    assert "error" not in r, r["error"]
    assert r["placements_differ"] and r["state_diff"] == 0.0 and r["next_diff"] == 0.0
