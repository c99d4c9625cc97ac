"""keep=K: older checkpoints are pruned after the new one is committed."""

import torch

import ftitan.checkpoint as ckpt


def _steps(directory):
    return [int(p.name.removeprefix("step_")) for p in ckpt.list_checkpoints(directory)]


def test_keep_last_k(tmp_path):
    for step in [10, 20, 30, 40]:
        ckpt.save(tmp_path, step, {"w": torch.full((2,), float(step))}, keep=2)
    assert _steps(tmp_path) == [30, 40]
    assert ckpt.latest(tmp_path) == tmp_path / "step_00000040"


def test_keep_none_keeps_everything_and_listing_is_by_step(tmp_path):
    for step in [100_000_000, 9, 10]:  # wider than 8 digits still sorts by number
        ckpt.save(tmp_path, step, {"w": torch.ones(1)})
    assert _steps(tmp_path) == [9, 10, 100_000_000]


def test_keep_leaves_later_steps_alone(tmp_path):
    # a run restarted from step 10 saves step 15 while a stale step 20 exists
    for step in [5, 10, 20]:
        ckpt.save(tmp_path, step, {"w": torch.ones(1)})
    ckpt.save(tmp_path, 15, {"w": torch.ones(1)}, keep=1)
    assert _steps(tmp_path) == [15, 20]


def test_list_checkpoints_of_missing_directory_is_empty(tmp_path):
    assert ckpt.list_checkpoints(tmp_path / "nope") == []
    assert ckpt.latest(tmp_path / "nope") is None
