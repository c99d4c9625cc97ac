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
    assert set(res) == {"whole", "regional", "regional-update"}
    for name, r in res.items():
        assert len(r["step_times_s"]) == 2 and r["step_s"] > 0
        own = max(r["first_step_s"] - r["step_s"], 0.0)  # the first step's wall time over the median
        blocks = res["regional"]["compile_s"] if name == "regional-update" else 0.0  # the region it reuses
        assert r["compile_s"] == pytest.approx(own + blocks)
    r = printed["ratios"]
    for peer in ("regional", "regional-update"):
        assert r[f"whole/{peer}:compile_s"] == pytest.approx(res["whole"]["compile_s"] / res[peer]["compile_s"])
        assert r[f"{peer}/whole:step_s"] == pytest.approx(res[peer]["step_s"] / res["whole"]["step_s"])
    assert printed["goals"] == bench.GOALS and printed["goal_is"] == bench.GOAL_IS
    want = r["whole/regional:compile_s"] >= 4.0 and r["regional/whole:step_s"] <= 1.05
    assert printed["met"] == want
