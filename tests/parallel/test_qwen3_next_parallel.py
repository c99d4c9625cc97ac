"""Qwen3-Next (MoE, fused projections) and Qwen3.5 (dense, separate projections) under FSDP 2 x TP 2 on real
gloo ranks (checks in ``_checks_qwen3_next.py``, run by the one torchrun launch of every parity check).

Tolerance: 1e-5 on the loss and on every gradient, as the other families: the parallel step computes the
same float32 ops, split over ranks and summed in another order.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("name", ["qwen3_next_dp_shard2_tp2", "qwen3_5_dp_shard2_tp2"])
def test_fsdp_tp_loss_and_grads_match_one_process(parity_results, name):
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5, r
    assert r["gdn_grad"] > 0 and r["grad_scale"] > 1e-2, r  # the linear attention's own leaves get gradients
