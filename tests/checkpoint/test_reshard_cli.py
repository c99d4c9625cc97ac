"""`ftitan train --resume` on another number of processes: a run checkpointed on 4 ranks (dp_shard 2 x
tp 2, each rank writing its own blocks) continues on 2 ranks and on 1 process, each rank reading only
its new blocks, and its next 5 losses are the uninterrupted 4-rank run's (same global batches)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftitan.config.cli import parse_train_args
from ftitan.train.trainer import train

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--recipe", "llama3-debug", "--model.n-layers", "2", "--data.seq-len", "64", "--data.batch-size", "8",
        "--steps", "10", "--optim.warmup", "2", "--log-every", "1", "--compile", "False", "--eval-every", "0",
        "--eval-batches", "1", "--ckpt-every", "5"]  # fmt: skip
# fp32; the resumed steps sum in another order than the 4-rank ones (tp / dp_shard partial sums)
TOL = 1e-6


def _torchrun(nproc: int, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "ftitan", "train", *ARGS, *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _at_step_5(full: Path, to: Path) -> Path:
    """A copy of the run as it was when it had checkpointed step 5 (its step-10 checkpoint removed)."""
    shutil.copytree(full, to)
    shutil.rmtree(to / "checkpoints" / "step_00000010")
    return to


@pytest.mark.slow  # three runs, two of them torchrun launches (~40 s)
def test_a_4_rank_checkpoint_continues_on_2_ranks_and_on_1_process(tmp_path):
    full = tmp_path / "full"
    # torch-checkpointing's writer process on every rank, however small the state
    _torchrun(4, "--parallel.dp-shard", "2", "--parallel.tp", "2", "--checkpoint.subprocess-min-mib", "0",
              "--run-dir", str(full))
    want = _losses(full)
    assert sorted(want) == list(range(1, 11))
    manifest = json.loads((full / "checkpoints" / "step_00000005" / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and len(manifest["files"]) == 4

    two = _at_step_5(full, tmp_path / "two")
    _torchrun(2, "--parallel.dp-shard", "2", "--run-dir", str(two), "--resume")
    one = _at_step_5(full, tmp_path / "one")
    out = train(parse_train_args([*ARGS, "--run-dir", str(one)]), resume=True, progress=False)
    assert out["start_step"] == 5
    for got in (_losses(two), _losses(one)):
        assert sorted(got) == list(range(1, 11))
        diffs = [abs(got[s] - want[s]) for s in range(6, 11)]
        assert max(diffs) <= TOL, diffs
