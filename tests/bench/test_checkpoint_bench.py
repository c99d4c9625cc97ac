"""``ftitan bench checkpoint``: the JSON it prints has the shape DESIGN.md fixes, and its ratios and
``met`` follow from the timings it reports."""

import json
import statistics

import pytest

from ftitan.__main__ import main
from ftitan.bench import checkpoint


def test_quick_run_reports_blocked_and_commit_times_and_honest_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # dcp and sync: torch-checkpointing's writer subprocess would cost this test seconds to start
    assert main(["bench", "checkpoint", "--quick", "--peers", "dcp", "sync", "--warmup", "1", "--rounds", "3",
                 "--dir", str(tmp_path), "--out", str(out)]) == 0  # fmt: skip
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["bench"] == "checkpoint" and printed["config"]["quick"] is True
    assert printed["config"]["state_bytes"] > 0 and printed["machine"]["threads"] >= 1
    res = printed["results"]
    assert set(res) == {"dcp", "sync"}
    for r in res.values():
        assert len(r["blocked_times_s"]) == len(r["commit_times_s"]) == 3
        assert r["blocked_s"] == statistics.median(r["blocked_times_s"])
        assert r["commit_s"] == statistics.median(r["commit_times_s"])
        # a save is committed after it stops blocking; a sync one when it returns
        assert all(0 < b <= c for b, c in zip(r["blocked_times_s"], r["commit_times_s"], strict=True))
    sync = statistics.median(res["sync"]["blocked_times_s"])
    want = statistics.median(res["dcp"]["blocked_times_s"]) / sync
    assert printed["ratios"] == {"dcp/sync": pytest.approx(want, rel=1e-12)}
    assert printed["goals"] == {"dcp/sync": 0.10} and printed["goal_is"] == "max"  # only the goals of peers run
    assert printed["met"] == all(printed["ratios"][k] <= v for k, v in printed["goals"].items())
    assert list(tmp_path.iterdir()) == [out]  # the checkpoints were removed


def test_sync_must_be_among_the_peers():
    with pytest.raises(ValueError, match="sync among them"):
        checkpoint.run(checkpoint.Options(peers=("dcp",), quick=True))
