"""``ftitan bench flexshard --quick`` on 4 gloo ranks: one JSON object whose ratios follow from the figures it
reports; the FSDP baseline gathers every Muon matrix where distributed Muon gathers none (the trainer's
distributed Muon sends shards to their owners and back: two all-to-alls); the quantized
gathers send ~0.52x of bf16's bytes, one all-gather per bucket; the trainer's dp_shard step with per-layer
buckets calls fewer collectives than with per-leaf ones."""

import json

import pytest

from ftitan.__main__ import main


def test_quick_run_reports_honest_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "flexshard", "--quick", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and printed["bench"] == "flexshard" and not printed["errors"]
    res, ratios = printed["results"], printed["ratios"]
    opt = res["optimizer"]
    assert ratios["optimizer flexshard/fsdp"] == pytest.approx(opt["flexshard"]["median_s"] / opt["fsdp"]["median_s"])
    assert opt["fsdp"]["gathered_matrices"] > 0
    assert opt["fsdp"]["collectives"] == {"all_gather": opt["fsdp"]["gathered_matrices"]}
    assert opt["flexshard"]["collectives"] == {} and opt["flexshard"]["gathered_matrices"] == 0
    tr = res["trainer_optimizer"]  # the trainer's Muon: two all-to-alls, against DTensor gathers (not ours)
    assert ratios["trainer_optimizer distributed/gather"] == pytest.approx(
        tr["distributed"]["median_s"] / tr["gather"]["median_s"])
    assert tr["distributed"]["collectives"] == {"all_to_all": 2}
    gb = res["gather_bytes"]
    for fmt in ("int8", "fp8"):
        assert ratios[f"gather_bytes {fmt}/bf16"] == gb[fmt]["bytes_per_rank"] / gb["bf16"]["bytes_per_rank"] <= 0.52
    assert all(v["all_gathers"] == v["buckets"] for v in gb.values()) and printed["checks"]["one_all_gather_per_bucket"]
    st = res["step"]
    layer, leaf = st["per_layer"]["collectives"], st["per_leaf"]["collectives"]
    assert layer["all_gather"] < leaf["all_gather"] and layer["reduce_scatter"] < leaf["reduce_scatter"]
    assert printed["checks"]["per_layer_fewer_collectives"]
    goals_met = all(ratios[k] <= v for k, v in printed["goals"].items())
    assert printed["met"] == (goals_met and all(printed["checks"].values()))
