"""``ftitan bench rl``: one JSON object with default vs batch-invariant generation and train-step timings,
cost ratios that follow from the medians it reports, and sync vs async RL runs that lose and reuse no
rollout."""

import json

import pytest

from ftitan.__main__ import main


def test_quick_run_reports_honest_ratios_and_accounts_for_every_rollout(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "rl", "--quick", "--rounds", "2", "--rl-steps", "2", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)  # stdout is the JSON alone
    assert printed == json.loads(out.read_text())
    assert printed["bench"] == "rl" and printed["config"]["quick"] is True
    res = printed["results"]
    for part in ("generation", "trainer"):
        r = res[part]["results"]
        assert set(r) == {"default", "batch_invariant"}
        want = r["batch_invariant"]["median_s"] / r["default"]["median_s"]
        assert printed["ratios"][f"{part} batch_invariant/default"] == pytest.approx(want, rel=1e-12)
    assert printed["goal_is"] == "max"
    assert printed["met"] == all(printed["ratios"][k] <= v for k, v in printed["goals"].items())
    rl = res["rl"]
    for mode in ("sync", "async", "async_process"):
        assert rl[mode]["runs"] == 2 and rl[mode]["rollouts_trained"] == 2 * 2 * 2 * 4  # runs x steps x P x G
        assert rl[mode]["rollouts_reused"] == 0
    assert rl["sync"]["max_lag"] == 0 and rl["async"]["max_lag"] <= 1 and rl["async_process"]["max_lag"] <= 1
    assert printed["reported"]["async/sync_steps_per_s"] == pytest.approx(
        rl["async"]["steps_per_s"] / rl["sync"]["steps_per_s"])
    assert printed["reported"]["async_process/sync_steps_per_s"] == pytest.approx(
        rl["async_process"]["steps_per_s"] / rl["sync"]["steps_per_s"])
