"""A save SIGKILLed midway leaves the previous checkpoint as latest (a real process), for the
synchronous writer and the asynchronous ones (staged, then written and committed while the caller goes
on); the next run's start removes the leftover temp dir."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ftitan.checkpoint as ckpt

# The child saves a ~16 MiB tree with a slowed step, announces through a
# marker file that it is inside the slow part, and waits to be killed.
_CHILD = r"""
import sys, time
from pathlib import Path
import torch
import ftitan.checkpoint._backends as b
import ftitan.checkpoint._commit as c
import ftitan.checkpoint as ckpt

directory, where, backend = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
marker = directory.parent / "inside"

if where == "tensor_write":
    real = b.save_file
    def slow_save_file(tensors, filename):
        real(tensors, filename)
        data = Path(filename).read_bytes()
        with open(filename, "wb") as f:  # rewrite it slowly, chunk by chunk
            for i in range(0, len(data), 1 << 20):
                f.write(data[i : i + (1 << 20)])
                f.flush()
                if i == 2 << 20:  # 2 of 16 MiB written
                    marker.touch()
                time.sleep(0.2)
    b.save_file = slow_save_file
else:
    real_rename = c._rename
    def slow_rename(tmp, final):
        marker.touch()
        time.sleep(60)
        real_rename(tmp, final)
    c._rename = slow_rename

with ckpt.Checkpointer(directory, backend=backend, subprocess_min_bytes=0) as saver:
    saver.save(2, {"w": torch.ones(4 << 20)})
    if backend != "sync":  # staged: training goes on while the commit hangs
        print("returned", flush=True)
"""


@pytest.mark.parametrize(
    ("backend", "where"),
    [
        ("sync", "tensor_write"),
        ("sync", "before_commit"),
        ("dcp", "before_commit"),  # async: staged, written and committed from the checkpointer's thread
        # async through torch-checkpointing's writer subprocess (its start costs seconds: slow tier)
        pytest.param("torch-checkpointing", "before_commit", marks=pytest.mark.slow),
    ],
)
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, backend, where):
    directory = tmp_path / "ckpt"
    previous = ckpt.save(directory, 1, {"w": torch.zeros(4 << 20)})
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(directory), where, backend],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "inside").exists():
            assert child.poll() is None, f"child exited early with {child.returncode}"
            assert time.monotonic() < deadline, "child never reached the slow part of save"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        out, _ = child.communicate()
    assert child.returncode == -signal.SIGKILL
    if backend != "sync":
        assert out.strip() == "returned"  # save() had returned before the commit

    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1 and list((directory / leftovers[0]).rglob("*.safetensors"))  # written, not committed
    assert ckpt.list_checkpoints(directory) == [previous]
    assert ckpt.latest(directory) == previous
    restored, manifest = ckpt.load(directory, {"w": torch.empty(4 << 20)})
    assert manifest.step == 1 and not restored["w"].any()

    # the next save works despite the leftover, which the next run's start removes
    new = ckpt.save(directory, 2, {"w": torch.ones(4 << 20)})
    assert ckpt.latest(directory) == new
    assert ckpt.remove_unfinished(directory) == leftovers
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000001", "step_00000002"]
