"""``ftitan bench compile``: the JSON it prints has the shape DESIGN.md fixes and its ratios and ``met``
follow from the times it reports (tiny config on aot_eager; the inductor figures and goals are judged on the
full-size run, see docs/compile-and-memory.md)."""

import json

import pytest

from ftitan.__main__ import main
from ftitan.bench import compile as bench


def test_quick_run_reports_compile_and_step_times_and_honest_ratios(tmp_path, capsys):
    out = tmp_path / "compile.json"
    assert main(["bench", "compile", "--quick", "--backend", "aot_eager", "--rounds", "2", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["bench"] == "compile" and printed["config"]["backend"] == "aot_eager"
    res = printed["results"]
    assert set(res) == {"whole", "regional", "regional-eager-update"}
    for name, r in res.items():
        assert len(r["step_times_s"]) == 2 and r["step_s"] > 0
        if name == "regional-eager-update":  # it reuses regional's block region: no cold compile of its own
            assert r["compile_s"] is None
        else:
            assert r["compile_s"] == pytest.approx(max(r["first_step_s"] - r["step_s"], 0.0))
    r = printed["ratios"]
    assert r["whole/regional:compile_s"] == pytest.approx(res["whole"]["compile_s"] / res["regional"]["compile_s"])
    for peer in ("regional", "regional-eager-update"):
        assert r[f"{peer}/whole:step_s"] == pytest.approx(res[peer]["step_s"] / res["whole"]["step_s"])
    assert printed["goals"] == bench.GOALS and printed["goal_is"] == bench.GOAL_IS
    want = r["whole/regional:compile_s"] >= 4.0 and r["regional/whole:step_s"] <= 1.05
    assert printed["met"] == want
