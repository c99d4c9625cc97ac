"""Fault recovery under torchrun: missing peers, dead ranks, a kill mid-save, resuming; all on gloo.

Each scenario launches ``torchrun -m ftitan train`` (dp_shard 2 x tp 2, the tiny llama of
``test_cli.py``) through ``_faulty_train.py``, which SIGKILLs one rank on cue. The claims:
- a rank whose peers never arrive fails within ``--parallel.timeout-s`` naming them (exit 2);
- a dead rank does not hang the others: each exits soon with one line naming the newest checkpoint;
- that checkpoint stays whole, also when the kill lands mid-save;
- ``--resume`` (a rerun, or ``torchrun --max-restarts 1``) continues with the losses of an
  uninterrupted run.
The default tier runs the missing-peer check (one process) and one kill; the rest is ``slow``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftitan.checkpoint._layout import latest, step_of

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "_faulty_train.py"
TINY = ["--recipe", "llama3-debug", "--model.n-layers", "2", "--data.seq-len", "64", "--data.batch-size", "8",
        "--optim.warmup", "1", "--log-every", "1", "--compile", "False", "--eval-every", "0", "--eval-batches", "1",
        "--data.vocab-size", "300", "--model.vocab-size", "300"]  # fmt: skip
ARGS = [*TINY, "--steps", "6", "--ckpt-every", "2"]
FSDP_TP = ("--parallel.dp-shard", "2", "--parallel.tp", "2")  # 4 ranks
# one line per rank; ranks write concurrently, so a line may follow rank 0's progress bar or another rank's line
ERROR = re.compile(r"ftitan train: error: rank (\d): (.*?)(?=ftitan train: error: |\n|$)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small JSONL corpus every scenario reads (tokenizing it takes no time)."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) + "\n"
                            for i in range(400)))  # fmt: skip
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTITAN_TEST_KILL", "TORCHELASTIC"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def _torchrun(run_dir: Path, corpus: Path, *extra: str, kill: str = "", restarts: int = 0,
              layout: tuple[str, ...] = FSDP_TP) -> subprocess.CompletedProcess:  # fmt: skip
    nproc = 2 if layout == ("--parallel.dp-shard", "2") else 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", str(SCRIPT), "train", *ARGS, *layout, "--data.corpus", str(corpus), *extra,
           "--run-dir", str(run_dir)]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=_env(FTITAN_TEST_KILL=kill), capture_output=True, text=True, timeout=600)


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def _newest(run_dir: Path) -> int | None:
    found = latest(run_dir / "checkpoints")  # verified: manifest and every file's hash
    return None if found is None else step_of(found)


def _assert_survivors_report(proc: subprocess.CompletedProcess, dead: int, newest: int, *, world: int = 4) -> None:
    """Every rank but ``dead`` printed exactly one error line naming a committed checkpoint to resume
    from (``newest`` or, when a save committed after the line was written, an older one); no rank
    printed a traceback."""
    lines = dict(ERROR.findall(proc.stderr))
    assert sorted(int(r) for r in lines) == sorted(set(range(world)) - {dead}), proc.stderr[-4000:]
    assert len(ERROR.findall(proc.stderr)) == world - 1, proc.stderr[-4000:]
    for msg in lines.values():
        assert "a peer process died or stopped responding" in msg or "stopped by the launcher" in msg, msg
        named = re.search(r"rerun with --resume to continue from step (\d+),", msg)
        assert named is not None and 2 <= int(named.group(1)) <= newest, msg
    # torchrun's own summary ends in one traceback (ChildFailedError); the ranks add none
    assert proc.stderr.count("Traceback (most recent call last)") <= 1, proc.stderr[-4000:]


def test_a_rank_whose_peers_never_arrive_fails_in_time_naming_them(tmp_path, corpus):
    with socket.socket() as s:  # a free port for the rendezvous store this lone rank 0 serves
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args = [*TINY, "--data.corpus", str(corpus), "--parallel.dp-shard", "2", "--parallel.timeout-s", "3",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ftitan", "train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    took = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("ftitan train: error: rank 0: ranks [1] never arrived "
                                                           "within 3 s"), proc.stderr[-3000:]  # fmt: skip
    assert "--parallel.timeout-s" in proc.stderr and "Traceback" not in proc.stderr
    assert took < 30, took  # ~3 s of waiting plus imports; torch's own rendezvous would wait 30 minutes


@pytest.mark.parametrize(
    "layout, dead",
    [
        pytest.param(("--parallel.dp-shard", "2"), 1, id="dp_shard2"),  # the default tier's: 2 ranks are cheaper
        pytest.param(FSDP_TP, 2, id="dp_shard2_tp2", marks=pytest.mark.slow),
    ],
)
def test_a_dead_rank_stops_the_others_with_one_line_and_keeps_the_checkpoint(tmp_path, corpus, layout, dead):
    run = tmp_path / "run"
    t0 = time.perf_counter()
    # one rank dies before step 5; steps 2 and 4 were checkpointed (sync: committed on every rank when save
    # returns, also when rank 0's rename of step 4 is slow: the dead rank cannot reach step 5 before it)
    proc = _torchrun(run, corpus, "--checkpoint.backend", "sync", kill=f"{dead}:step:5,0:slow-commit:4",
                     layout=layout)  # fmt: skip
    assert proc.returncode != 0 and time.perf_counter() - t0 < 300
    assert _newest(run) == 4
    _assert_survivors_report(proc, dead=dead, newest=4, world=2 if len(layout) == 2 else 4)
    assert max(r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())) == 4


@pytest.mark.slow
def test_a_hung_rank_fails_the_others_after_the_collective_timeout(tmp_path, corpus):
    run = tmp_path / "run"
    # rank 1 stops (SIGSTOP) before step 5: alive, silent; its peers' collectives give up after 5 s
    proc = _torchrun(run, corpus, "--checkpoint.backend", "sync", "--parallel.timeout-s", "5", kill="1:stop:5",
                     layout=("--parallel.dp-shard", "2"))  # fmt: skip
    assert proc.returncode != 0
    (rank, msg), *rest = ERROR.findall(proc.stderr)
    assert rank == "0" and not rest, proc.stderr[-4000:]
    assert "stopped responding (Timed out waiting 5000ms" in msg and "continue from step 4," in msg, msg


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus) -> list[float]:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    proc = _torchrun(run, corpus)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _losses(run)


@pytest.mark.slow
def test_resume_after_a_dead_rank_matches_the_uninterrupted_run(tmp_path, corpus, uninterrupted):
    run = tmp_path / "run"
    killed = _torchrun(run, corpus, kill="1:step:4")
    assert killed.returncode != 0
    newest = _newest(run)
    _assert_survivors_report(killed, dead=1, newest=newest)
    resumed = _torchrun(run, corpus, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _losses(run) == uninterrupted  # the same floats: same layout, same batches, exact state


@pytest.mark.slow
def test_a_kill_mid_save_keeps_the_previous_checkpoint_and_resumes(tmp_path, corpus, uninterrupted):
    run = tmp_path / "run"
    # rank 0 dies with every file of step 4 written, just before the rename that commits it
    killed = _torchrun(run, corpus, "--checkpoint.backend", "sync", kill="0:commit:4")
    assert killed.returncode != 0
    assert _newest(run) == 2  # step 4 never committed; step 2 still verifies
    assert not (run / "checkpoints" / "step_00000004").exists()
    resumed = _torchrun(run, corpus, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _losses(run) == uninterrupted


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_after_a_dead_rank(tmp_path, corpus, uninterrupted):
    run = tmp_path / "run"
    # --resume from the start: the first attempt finds no checkpoint and starts at step 0
    proc = _torchrun(run, corpus, "--resume", kill="3:step:5", restarts=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _losses(run) == uninterrupted


@pytest.mark.slow
@pytest.mark.parametrize("layout", [FSDP_TP, ("--parallel.pp", "2", "--parallel.dp-shard", "2")], ids=["dp_shard2_tp2",
                                                                                                     "pp2_dp_shard2"])
def test_nonfinite_gradients_stop_every_rank_at_the_same_step(tmp_path, corpus, layout):
    # the gradients turn NaN at step 3: steps 3 and 4 are skipped (step 4's checkpoint holds the guard's state,
    # the same on every rank), the guard halts at step 5, and the check before step 6's checkpoint stops the run
    proc = _torchrun(tmp_path / "run", corpus, "--optim.lr", "1e6", "--steps", "12", "--log-every", "4",
                     "--checkpoint.backend", "sync", layout=layout)  # fmt: skip
    assert proc.returncode != 0
    lines = ERROR.findall(proc.stderr)
    assert sorted(int(r) for r, _ in lines) == [0, 1, 2, 3], proc.stderr[-4000:]
    # every rank saw the same steps (and leaf); one still finishing the step may get torchrun's SIGTERM first
    stops = {msg for _, msg in lines if "stopped by the launcher" not in msg}
    assert len(stops) == 1, lines
    stop = stops.pop()
    assert "NaN or inf gradients" in stop and "stopped at step 6" in stop, lines
    assert _newest(tmp_path / "run") == 4
