"""One torchrun launch (4 gloo ranks) runs every parity check; tests read its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def launch(script: str, *args: str, nproc: int = 4, timeout: int = 900, slow: bool = False) -> dict[str, dict]:
    """Run ``script`` under torchrun (``nproc=0``: one plain process, e.g. fake ranks);
    ``{check name: result}`` from its ``RESULT {...}`` lines. ``slow``: the checks files also register
    their slow-tier checks (``FTITAN_SLOW_CHECKS``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
    if slow:
        env["FTITAN_SLOW_CHECKS"] = "1"
    runner = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else []
    cmd = [sys.executable, *runner, str(HERE / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            results[r["check"]] = r
    if proc.returncode != 0 or not results:
        raise AssertionError(f"{script} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return results


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make) -> dict[str, dict]:
    """``make()`` (JSON results) once per test run: under pytest-xdist (``make test`` runs ``-n 2``) the first
    worker to ask runs it, behind a file lock, and leaves the results (or its failure) where the other
    worker reads them, so a 4-rank gloo launch is not run once per worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make()
    from filelock import FileLock

    path = tmp_path_factory.getbasetemp().parent / f"{name}.json"  # the run's directory, shared by the workers
    with FileLock(f"{path}.lock"):
        if path.is_file():
            saved = json.loads(path.read_text())
            if "failed" in saved:
                raise AssertionError(saved["failed"])
            return saved
        try:
            results = make()
        except Exception as e:  # a failed launch, or one past its timeout: the other worker must not rerun it
            path.write_text(json.dumps({"failed": f"{type(e).__name__}: {e}"}))
            raise
        path.write_text(json.dumps(results))
        return results


@pytest.fixture(scope="session")
def parity_results(tmp_path_factory) -> dict[str, dict]:
    return once_per_run(tmp_path_factory, "parity_results", lambda: launch("_parity.py"))


@pytest.fixture(scope="session")
def run_checks():
    """:func:`launch`, for a test that runs its own checks."""
    return launch


@pytest.fixture(scope="session")
def slow_checks():
    """``slow_checks(*names)``: a 4-rank launch of the named slow-tier checks (``{name: result}``)."""
    return lambda *names: launch("_parity.py", *names, slow=True)


@pytest.fixture(scope="module")
def fake_ranks() -> dict[str, dict]:
    """Every rank of dp_shard2_tp2 / ep2_dp_shard2 / pp2_tp2 simulated in one process (``_fake_ranks.py``)."""
    layouts = ("dp_shard2_tp2", "ep2_dp_shard2", "pp2_tp2")
    return launch("_fake_ranks.py", *(f"{kind}_{name}" for name in layouts for kind in ("init", "hf")), nproc=0)


@pytest.fixture(scope="session")
def parity_results_8(tmp_path_factory) -> dict[str, dict]:
    return once_per_run(tmp_path_factory, "parity_results_8", lambda: launch("_parity.py", nproc=8))
