"""Pipeline parallelism on 4 gloo ranks equals a single-process run (checks in ``_checks_pp.py``).

Tolerances, fp32:
- loss and gradients 1e-5 (the issue's bar). The pipeline sums the same
  terms in another order: per micro-batch means weighted by their token
  counts, gradients accumulated over micro-batches before one reduce-scatter
  / all-reduce. Measured: gradients differ by ~1.5e-8 (scale ~0.05), the
  loss (~5.5) by ~5e-7, i.e. a few float32 ulps.
- after 3 AdamW steps, losses 1e-5 (measured ~5e-7) and params 1e-4
  (measured ~3e-6): AdamW's normalized update turns ~1e-8 gradient
  differences into ~1e-6 on weights whose second moment is tiny.
"""

from __future__ import annotations

import pytest

GRAD_CHECKS = [
    "pp2_dp_shard2_1f1b",  # 1F1B, 4 micro-batches, FSDP inside each stage
    "pp2_dp_shard2_gpipe_3layers",  # GPipe, stages of 2 and 1 layers
    "pp2_tp2_1f1b",  # tensor + sequence parallel inside each stage
    "qwen3_pp2_tp2_1f1b",  # QK-norm (tp-shared scales), untied head
    "pp2_cp2_1f1b",  # context parallel inside each stage: later stages' positions are head-tail chunks
    "pp4_1f1b",  # one layer per stage, 8 micro-batches: warm-up, steady state and cool-down
]


@pytest.mark.parametrize("name", GRAD_CHECKS)
def test_pipeline_loss_and_grads_match_single_process(parity_results, name):
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert r["loss_diff"] <= 1e-5
    assert r["grad_diff"] <= 1e-5
    assert r["covered"]  # the stages' gradients together are every param's
    assert r["grad_scale"] > 1e-3  # the gradients compared are not trivially zero


@pytest.mark.parametrize("name", GRAD_CHECKS)
def test_pipeline_sends_activations_and_gradients_between_stages(parity_results, name):
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert all(n > 0 for n in r["sends"])  # every rank of a pp layout sends
    # exactly: an activation per forward (plus a 64-byte shape header) and a gradient per backward
    assert r["sends"] == r["expected_sends"]


def test_three_pipeline_steps_match_single_process(parity_results):
    r = parity_results["steps_pp2_dp_shard2"]
    assert "error" not in r, r["error"]
    assert len(r["losses"]) == 3
    assert r["loss_diff"] <= 1e-5, (r["losses"], r["ref_losses"])
    assert r["loss_spread"] == 0.0  # metrics are the same on every rank (reduced over pp too)
    assert r["grad_norm_diff"] <= 1e-5  # the whole model's norm, not one stage's
    assert min(r["ref_grad_norms"]) > 0.5  # clip_by_global_norm(0.5) binds: stages scale by the global norm
    assert len(set(r["losses"])) > 1  # the model trains: losses move
    assert r["param_diff"] <= 1e-4


# MoE families (qwen3_moe pp2 x dp_shard2, deepseek_v3 pp2 x ep2; 1F1B, 4 micro-batches, aux_loss_coef 0.1):
# the reference is one process running the same objective, sum_m n_m / N (CE_m + c LB_m) over the global
# micro-batches (``_checks_pp.microbatched_loss``). Tolerance 1e-5 as above; measured: loss 0, gradients
# ~1e-8, loads and balancing loss exact.
MOE_GRAD_CHECKS = ["qwen3_moe_pp2_dp_shard2_1f1b", "deepseek_v3_pp2_ep2_1f1b"]


@pytest.mark.parametrize("name", MOE_GRAD_CHECKS)
def test_moe_pipeline_loss_grads_and_loads_match_single_process(parity_results, name):
    r = parity_results[name]
    assert "error" not in r, r["error"]
    assert r["loss_diff"] <= 1e-5  # cross-entropy plus every stage's share of the balancing loss
    assert r["grad_diff"] <= 1e-5
    assert r["covered"]
    assert r["grad_scale"] > 1e-3
    assert r["router_grad_scale"] > 1e-4  # the routers' gradients (where the balancing loss acts) are compared
    assert r["load_diff"] == 0.0  # moe.tokens_per_expert (L_moe, E): every stage's layers, summed over pp
    assert r["aux_loss_diff"] <= 1e-6


def test_three_deepseek_v3_pipeline_steps_match_single_process(parity_results):
    # measured: losses ~1e-6, params ~9e-6 (AdamW, see above), loads and router biases exact
    r = parity_results["steps_deepseek_v3_pp2_ep2"]
    assert "error" not in r, r["error"]
    assert r["loss_diff"] <= 1e-5, (r["losses"], r["ref_losses"])
    assert r["load_diff"] == 0.0 and r["max_load_diff"] == 0.0
    assert r["aux_loss_diff"] <= 1e-6
    assert r["bias_diff"] == 0.0  # update_buffers on each stage reads its layers' rows of the whole load
    assert r["bias_moved"] > 0.0
    assert r["param_diff"] <= 1e-4
