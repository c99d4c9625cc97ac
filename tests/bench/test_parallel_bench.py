"""``ftitan bench parallel``: JSON shape, and byte counts that follow from the layout."""

from __future__ import annotations

import json

import pytest

import ftitan as ft
from ftitan import parallel
from ftitan.bench import parallel as bench


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick bench launch (4 gloo ranks) for every test here: ``(rc, printed JSON, written JSON)``."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("bench") / "bench.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = bench.main(["--quick", "--layouts", "dp_shard=4", "dp_shard=2,tp=2", "ep=2,dp_shard=2", "--out", str(out)])
    return rc, json.loads(buf.getvalue()), json.loads(out.read_text())


def test_quick_run_reports_time_and_bytes_per_layout(quick_run):
    rc, printed, written = quick_run
    assert rc == 0 and printed == written
    assert printed["bench"] == "parallel" and printed["met"] is True
    res = printed["results"]
    assert set(res) == {"single", "single-moe", "dp_shard=4", "dp_shard=2,tp=2", "ep=2,dp_shard=2",
                        "ep=2,dp_shard=2 [sync]"}  # fmt: skip
    cfg = bench._config(bench.Options(quick=True))
    for name in ("dp_shard=4", "dp_shard=2,tp=2"):
        assert res[name]["median_s"] > 0 and res[name]["bytes_sent_per_rank"] > 0
        tokens = cfg["batch_size"] * cfg["seq_len"]  # one global batch per step, whatever the layout
        assert abs(res[name]["tokens_per_s"] * res[name]["median_s"] - tokens) <= 1e-6 * tokens
        assert abs(printed["ratios"][f"{name}/single"] - res[name]["tokens_per_s"] / res["single"]["tokens_per_s"]) < 1e-9

    # FSDP over 4 ranks: each rank sends 3 of its 4 shards' worth per gather (ring) and the same per
    # reduce-scatter of the gradients, for exactly the leaves split over dp_shard
    model = bench._model(cfg, moe=False)
    params = model.init(ft.random.key(0), device="meta")
    shardings = parallel.resolve(params, model.param_axes, parallel.default_rules(), {"dp_shard": 4})
    split = sum(x.numel() * 4 for x, s in zip(ft.tree.leaves(params), ft.tree.leaves(shardings), strict=True)
                if "dp_shard" in s.mesh_axes())  # fmt: skip
    sent = res["dp_shard=4"]["bytes_by_collective"]
    assert sent["all_gather"] == sent["reduce_scatter"] == 3 * split // 4


def test_quick_ep_run_reports_padded_and_sync_exchanges(quick_run):
    """The EP layout runs once per exchange in the same ranks; the padded exchange's bytes follow from
    static sizes alone: per MoE layer and step, dispatch (N rows of D + 2k: weights and ids ride along)
    and combine (N rows of D) to the other ep rank, each once forward and once backward (fp32)."""
    rc, printed, _ = quick_run
    assert rc == 0 and printed["met"] is True
    res = printed["results"]
    padded, sync = res["ep=2,dp_shard=2"], res["ep=2,dp_shard=2 [sync]"]
    assert padded["median_s"] > 0 and sync["median_s"] > 0
    ratio = printed["ratios"]["ep=2,dp_shard=2/ep=2,dp_shard=2 [sync]"]
    assert abs(ratio - padded["tokens_per_s"] / sync["tokens_per_s"]) < 1e-9
    cfg = bench._config(bench.Options(quick=True))
    model = bench._model(cfg, moe=True)
    n_moe, d, k, ep = len(model.config.moe_layers), cfg["dim"], model.config.top_k, 2
    n = cfg["batch_size"] * cfg["seq_len"] // 4  # tokens per rank (ep x dp_shard data ranks)
    assert padded["bytes_by_collective"]["all_to_all"] == n_moe * 2 * (ep - 1) * n * (2 * d + 2 * k) * 4
    assert 0 < sync["bytes_by_collective"]["all_to_all"]  # routing-dependent: exact rows (+ the counts)
