"""``ftitan bench parallel``: JSON shape, and byte counts that follow from the layout."""

from __future__ import annotations

import json

import ftitan as ft
from ftitan import parallel
from ftitan.bench import parallel as bench


def test_quick_run_reports_time_and_bytes_per_layout(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--layouts", "dp_shard=4", "dp_shard=2,tp=2", "--out", str(out)])
    printed = json.loads(capsys.readouterr().out)
    assert rc == 0 and printed == json.loads(out.read_text())
    assert printed["bench"] == "parallel" and printed["met"] is True
    res = printed["results"]
    assert set(res) == {"single", "dp_shard=4", "dp_shard=2,tp=2"}
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
