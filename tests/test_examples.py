"""The examples run as a user runs them, and they train."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_train_loop_example_trains(optimizer):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_loop.py"), "--steps", "40", "--optimizer", optimizer, "--no-compile"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 5, out
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5, out
