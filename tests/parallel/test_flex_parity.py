"""``attn_impl="flex"`` under tp x cp (checks in ``_checks_flex.py``, run by the shared parity launch)."""


def test_flex_logits_under_tp_cp_match_one_process(parity_results):
    # FlexAttention itself (no grad) with cp's explicit mask and Muse Glimmer's windows; fp32, 1e-5: the
    # attention differs by summation order (blockwise softmax, chunked keys), the head by tp's split
    r = parity_results["flex_logits_tp2_cp2"]
    assert "error" not in r, r["error"]
    assert r["shape_ok"] and r["diff"] <= 1e-5


def test_flex_loss_and_grads_under_tp_cp_match_one_process(parity_results):
    # with gradients flex runs SDPA with the same mask: the tolerance of the sdpa check in _checks_muse_glimmer
    r = parity_results["flex_muse_glimmer_tp2_cp2"]
    assert "error" not in r, r["error"]
    assert r["loss_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5
    assert r["gate_grad"] > 0
