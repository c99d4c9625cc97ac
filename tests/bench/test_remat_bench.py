"""``ftitan bench remat``: the JSON it prints has the shape DESIGN.md fixes, its byte counts are exact and
consistent with the policies, and its ratios and ``met`` follow from what it reports (tiny config; the
goals themselves are judged on the full-size run, see docs/compile-and-memory.md)."""

import json

import pytest

from ftitan.__main__ import main
from ftitan.bench import remat


def test_quick_run_reports_bytes_times_and_honest_ratios(tmp_path, capsys):
    out = tmp_path / "remat.json"
    assert main(["bench", "remat", "--quick", "--policies", "none", "full", "save-matmuls", "--warmup", "0",
                 "--rounds", "2", "--out", str(out)]) == 0  # fmt: skip
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["bench"] == "remat" and printed["config"]["quick"] is True and printed["machine"]["threads"] >= 1
    res = printed["results"]
    assert list(res) == ["none", "full", "save-matmuls"]
    for r in res.values():
        assert r["grads_identical"] is True and len(r["step_times_s"]) == 2 and r["step_s"] > 0
    # without remat every kept byte is a saved tensor; full remat keeps far less, save-matmuls in between
    assert res["none"]["saved_bytes"] == pytest.approx(res["none"]["hook_bytes"], rel=0.02)
    assert res["full"]["saved_bytes"] < res["save-matmuls"]["saved_bytes"] < res["none"]["saved_bytes"]
    for p in ("full", "save-matmuls"):
        assert printed["ratios"][f"{p}/none:saved"] == pytest.approx(res[p]["saved_bytes"] / res["none"]["saved_bytes"])
        assert printed["ratios"][f"{p}/none:step_s"] == pytest.approx(res[p]["step_s"] / res["none"]["step_s"])
    assert printed["goals"] == remat.GOALS and printed["goal_is"] == "max"
    assert printed["met"] == all(printed["ratios"][k] <= v for k, v in printed["goals"].items())


def test_policies_are_checked_and_none_is_required():
    with pytest.raises(ValueError, match="--policies='fulll'"):
        remat.run(remat.Options(policies=("none", "fulll"), quick=True))
    with pytest.raises(ValueError, match="'none' must be among them"):
        remat.run(remat.Options(policies=("full",), quick=True))
