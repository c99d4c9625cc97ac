"""``--device`` and ``--parallel.backend``: what auto picks, and a clear error for what this machine lacks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ftitan.config import parse_train_args
from ftitan.train import runtime

NO_CUDA = not torch.cuda.is_available()


def test_auto_picks_cuda_only_when_available():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert runtime.resolve_device("auto").type == expected
    assert runtime.resolve_device("cpu") == torch.device("cpu")


def test_backend_auto_follows_the_device():
    assert runtime.resolve_backend("auto", torch.device("cpu")) == "gloo"
    assert runtime.resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert runtime.resolve_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ValueError, match="--parallel.backend='nccl' needs CUDA"):
        runtime.resolve_backend("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="expected one of"):
        runtime.resolve_backend("mpi", torch.device("cpu"))


@pytest.mark.skipif(not NO_CUDA, reason="checks the error a machine without CUDA gives")
def test_cuda_without_a_gpu_is_one_clear_line():
    with pytest.raises(ValueError, match=r"--device='cuda'.*use --device cpu"):
        runtime.resolve_device("cuda")
    with pytest.raises(ValueError, match=r"--device='cuda'.*use --device cpu or auto"):
        parse_train_args(["--device", "cuda"])
    proc = subprocess.run([sys.executable, "-m", "ftitan", "train", "--device", "cuda"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line, no traceback
    assert "--device='cuda'" in proc.stderr


def test_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match=r"--device='tpu'.*expected one of"):
        parse_train_args(["--device", "tpu"])


def test_single_process_runtime_places_on_its_device():
    rt = runtime.setup(runtime.ParallelConfig(), device="cpu")
    assert rt.device == torch.device("cpu") and rt.layout is None
