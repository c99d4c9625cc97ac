"""Fused projections on real gloo ranks (checks in ``_checks_fused.py``, run by the one torchrun launch of
every parity check): dp_shard 4, dp_replicate 2 x dp_shard 2, dp_shard 2 x cp 2 and pp 2 x dp_shard 2 (1f1b)
give the single-process fused model's loss and gradients (1e-5, as the other parity checks: the same float32
ops summed in another order), FSDP splits the stacked leaves' embed dim, per-rank init equals the
single-process init, and tensor parallelism is refused naming the flag.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("name", ["fused_dp_shard4", "fused_dp_replicate2_dp_shard2", "fused_dp_shard2_cp2"])
def test_fused_loss_and_grads_match_one_process(parity_results, name):
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert r["leaves"] == ["wo", "wqkv", "w13", "w2"]  # the stacked tree ran, not the separate leaves
    assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["grad_scale"] > 1e-3, r
    assert r["init_diff"] == 0.0, r  # init_params' per-rank path gives model.init's stacked values
    assert "S(1)" in r["wqkv_placements"], r  # FSDP splits the embed dim (1) of the stacked rows


def test_pipeline_stages_of_the_fused_model_match_one_process(parity_results):
    r = parity_results["fused_pp2_dp_shard2"]
    assert "error" not in r, r["error"]
    assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5 and r["grad_scale"] > 1e-3, r


def test_tensor_parallel_is_refused_naming_the_flag(parity_results):
    r = parity_results["fused_tp2_refused"]
    assert "error" not in r, r["error"]
    assert r["refused"] and "tensor parallelism" in r["refused"] and "--model.fuse-projections" in r["refused"], r
