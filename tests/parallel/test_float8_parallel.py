"""Float8 training under parallel layouts (real gloo ranks; checks in ``_checks_float8.py``, run in the one
``_parity.py`` launch).

Each rank scales from the tensors it holds. On the data axes (dp_shard, pipeline micro-batches) a parallel
float8 step is one process's float8 step accumulated over the same micro-batches; under tp, tensorwise
scales are per weight shard and rowwise scales (powers of two) give the same float8 values whatever the
shard. Tolerances:
- against the matching reference, fp32 reduction order only: gradients ~1e-8, losses ~1e-5 over 3 steps;
  params after the first AdamW step 1e-4 (AdamW divides tiny gradients by their own size, as in
  test_parity.py). Later params are not compared tightly: float8 rounding is a step function, so an
  ulp of difference in a weight can move a value to the next float8 number (measured 4e-3 after 3 steps).
- tensorwise under tp against one process: the two differ by float8 rounding of other scales, measured
  6% of the largest gradient entry, 8e-5 on the loss; held to 15% and 1e-3.
"""

from __future__ import annotations


def _ok(r: dict) -> dict:
    assert "error" not in r, r["error"]
    return r


def test_fsdp_float8_steps_are_the_accumulated_single_process_steps(parity_results):
    r = _ok(parity_results["float8_steps_dp_shard4"])
    assert r["loss_diff_accum4"] <= 1e-4 and r["first_param_diff_accum4"] <= 1e-4, r
    # one process on the whole batch scales its activations over all rows: the steps differ, visibly
    assert r["loss_diff_accum1"] >= 10 * r["loss_diff_accum4"] and r["loss_diff_accum1"] > 1e-4, r


def test_float8_gradients_under_fsdp_and_tp(parity_results):
    r = _ok(parity_results["float8_grads_dp_shard2_tp2"])
    row, tensor = r["rowwise"], r["tensorwise"]
    for key in ("whole", "accum"):  # power-of-two scales: the same float8 values on any rows, any shard
        assert row[f"loss_diff_{key}"] <= 1e-5 and row[f"grad_diff_{key}"] <= 1e-6, row
    assert tensor["loss_diff_whole"] <= 1e-3 and tensor["grad_diff_whole"] <= 0.15 * tensor["grad_scale"], tensor
    assert tensor["grad_diff_whole"] > 1e-4 * tensor["grad_scale"], tensor  # tensorwise scales are per shard


def test_pipeline_float8_gradients_are_the_micro_batches_accumulated(parity_results):
    r = _ok(parity_results["float8_pp2_dp_shard2"])
    assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-6, r
    assert r["whole_batch_diff"] > 1e-3 * r["grad_scale"], r  # tensorwise: each micro-batch's own scales


def test_rowwise_float8_gradients_on_sequence_and_expert_layouts(parity_results):
    """tp 2 x cp 2 (Llama); ep 2 x dp_shard 2 with the experts' grouped GEMMs in float8 too (Qwen3-MoE,
    DeepSeek-V3 with its shared expert and MLA): an expert's scales are over the rows it got, from every
    rank, and its weight-gradient scales over them too; powers of two make all of it one process's."""
    for name in ("float8_rowwise_tp2_cp2", "float8_experts_ep2_dp_shard2_qwen3_moe",
                 "float8_experts_ep2_dp_shard2_deepseek_v3"):  # fmt: skip
        r = _ok(parity_results[name])
        assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-6, r
