"""A save SIGKILLed midway leaves the previous checkpoint as latest (a real process)."""

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
import ftitan.checkpoint._save as s

directory, where = Path(sys.argv[1]), sys.argv[2]
marker = directory.parent / "inside"

if where == "tensor_write":
    real = s.save_file
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
    s.save_file = slow_save_file
else:
    real_commit = s._commit
    def slow_commit(tmp, final):
        marker.touch()
        time.sleep(60)
        real_commit(tmp, final)
    s._commit = slow_commit

s.save(directory, 2, {"w": torch.ones(4 << 20)})
"""


@pytest.mark.parametrize("where", ["tensor_write", "before_commit"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, where):
    directory = tmp_path / "ckpt"
    previous = ckpt.save(directory, 1, {"w": torch.zeros(4 << 20)})
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(directory), where])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "inside").exists():
            assert child.poll() is None, f"child exited early with {child.returncode}"
            assert time.monotonic() < deadline, "child never reached the slow part of save"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL

    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1 and (directory / leftovers[0] / "state.safetensors").exists()
    assert ckpt.list_checkpoints(directory) == [previous]
    assert ckpt.latest(directory) == previous
    restored, manifest = ckpt.load(directory, {"w": torch.empty(4 << 20)})
    assert manifest.step == 1 and not restored["w"].any()

    # the next save works despite the leftover
    new = ckpt.save(directory, 2, {"w": torch.ones(4 << 20)})
    assert ckpt.latest(directory) == new
