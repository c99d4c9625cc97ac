"""``ftitan bench attention``: the JSON it prints has the shape DESIGN.md fixes, every mask kind's build is
timed, and its ratios follow from the forward and training timings it reports."""

import json

import pytest

from ftitan.__main__ import main
from ftitan.bench import attention


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_quick_run_reports_mask_builds_forward_and_training_times(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # --no-compile: flex's eager form (an inductor compile per length would cost this test ~40 s)
    assert main(["bench", "attention", "--quick", "--no-compile", "--warmup", "1", "--rounds", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["bench"] == "attention" and printed["config"]["quick"] is True
    assert printed["config"]["seq_lens"] == [128, 300] and printed["machine"]["threads"] >= 1
    assert set(printed["results"]) == {"T=128", "T=300"}
    for t, r in printed["results"].items():
        builds = r["block_mask"]["ms"]
        assert set(builds) == {"causal", "window", "document", "prefix_rows", "cached", "dense_document"}
        assert all(ms > 0 for ms in builds.values())
        fwd = r["forward_ms"]
        assert set(fwd) == {"flex-causal", "sdpa-causal", "flex-document", "sdpa-document"}
        for kind in ("causal", "document"):
            assert printed["ratios"][f"flex/sdpa {kind} {t}"] == pytest.approx(fwd[f"flex-{kind}"] / fwd[f"sdpa-{kind}"])
        train = r["train_ms"]
        kinds = ("causal", "window", "document")
        assert set(train) == {f"{impl}-{kind}" for impl in ("gemm", "sdpa") for kind in kinds}
        assert all(ms > 0 for ms in train.values())
        assert r["gemm_ran"] == {kind: True for kind in kinds}  # 128 and 300 keys: the blocks
        for kind in kinds:
            assert printed["ratios"][f"gemm/sdpa train {kind} {t}"] == pytest.approx(
                train[f"gemm-{kind}"] / train[f"sdpa-{kind}"])
    assert printed["goals"] == {} and printed["met"] is None


def test_documents_split_every_row():
    import torch

    seg = attention._segments(3, 50, 4, torch.Generator().manual_seed(0))
    assert seg.shape == (3, 50) and seg[:, 0].eq(0).all() and seg[:, -1].eq(3).all()
    assert (seg.diff(dim=1) >= 0).all() and (seg.diff(dim=1).sum(dim=1) == 3).all()  # 4 contiguous documents
