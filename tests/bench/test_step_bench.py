"""``ftitan bench step``: the JSON it prints has the shape DESIGN.md fixes, with honest ratios."""

import json

from ftitan.bench import step


def test_quick_run_reports_results_ratios_and_goals(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert step.main(["--quick", "--peers", "ftitan-compiled", "ftitan-eager", "hf-eager",
                      "--warmup", "1", "--rounds", "2", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["bench"] == "step" and printed["config"]["quick"] is True
    assert set(printed["results"]) == {"ftitan-compiled", "ftitan-eager", "hf-eager"}
    for r in printed["results"].values():
        assert r["tokens_per_s"] > 0 and 0 < r["mfu_vs_gemm_peak"]
        assert len(r["times_s"]) == 2
    res = printed["results"]
    want = res["ftitan-compiled"]["tokens_per_s"] / res["hf-eager"]["tokens_per_s"]
    assert abs(printed["ratios"]["ftitan-compiled/hf-eager"] - want) < 1e-9
    # only the goals whose peers ran are judged, and "met" follows from them
    assert printed["goals"] == {"ftitan-compiled/hf-eager": 1.2}
    assert printed["met"] == (printed["ratios"]["ftitan-compiled/hf-eager"] >= 1.2)
    assert printed["machine"]["threads"] >= 1 and printed["gemm_peak"]["flops_per_s"] > 0
