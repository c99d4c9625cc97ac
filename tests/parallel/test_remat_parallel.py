"""Remat policies and regional compile on real gloo ranks (checks in ``_checks_remat.py``, run by the one
torchrun launch of every parity check): a 4-layer Llama under FlexShard (dp_shard 4, dp_shard 2 x tp 2)
and pipeline stages (pp 2 x dp_shard 2, 1F1B), blocks under full / save-matmuls remat and/or compiled
once (aot_eager), against the single-process torch.func gradients without remat.

Tolerance: 1e-5 on the loss (~5.6) and on every gradient, as the other parity checks: the same float32
ops split over ranks and summed in another order (measured 9.5e-7 on the loss, 1.9e-8 on the gradients).
A regional check also asserts that its rank compiled the block once for all the layers it runs.
"""

from __future__ import annotations

import pytest

NAMES = ("remat_full_dp_shard4", "remat_save_matmuls_dp_shard2_tp2", "regional_dp_shard4", "regional_dp_shard2_tp2",
         "regional_remat_full_dp_shard4", "remat_full_pp2_dp_shard2", "regional_remat_full_pp2_dp_shard2")  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_remat_and_regional_compile_match_one_process(parity_results, name):
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5, r
    assert r["graphs"] == (1 if name.startswith("regional") else 0), r  # one compiled block serves every layer
