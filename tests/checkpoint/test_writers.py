"""The three writers: ``save`` returns once staged, the checkpoint commits in the background with the
values of the moment of ``save``, and loading reads JSON and safetensors only (nothing is unpickled)."""

from __future__ import annotations

import pickle

import pytest
import torch

import ftitan.checkpoint as ckpt
from ftitan import tree
from ftitan.train.state import init_state
from ftitan.optim import adamw


def _state():
    g = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(16, 8, generator=g), "layers": {"0": {"w": torch.randn(8, 8, generator=g)}},
              "norm": torch.ones(8, dtype=torch.bfloat16)}  # fmt: skip
    return {"state": init_state(params, adamw(lr=1e-3)), "loader": {"position": torch.tensor(5)}}


def _no_pickle(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a checkpoint load unpickled something")

    for module, name in ((pickle, "loads"), (pickle, "load"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize("backend", ckpt.BACKENDS)
def test_save_stages_then_commits_and_loads_without_pickle(tmp_path, monkeypatch, backend):
    state = _state()
    before = tree.map(torch.clone, state)
    # subprocess_min_bytes=0: torch-checkpointing's writer process even for this small state
    with ckpt.Checkpointer(tmp_path, backend=backend, keep=1, extra={"run": "a"}, subprocess_min_bytes=0) as saver:
        saver.save(1, state)
        for x in tree.leaves(state):  # the train step updates the state in place right after save() returns
            x.add_(1)
        saver.save(2, state)  # waits for the previous save first
        saver.wait()  # single process: rank 0's own part includes the commit
        assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002"]  # keep=1
        for x in tree.leaves(state):
            x.add_(1)
    manifest = ckpt.read_manifest(tmp_path / "step_00000002")
    assert manifest.backend == backend and manifest.extra == {"run": "a"} and manifest.world_size == 1
    assert {p.suffix for p in (tmp_path / "step_00000002").rglob("*") if p.is_file()} == {".json", ".safetensors"}

    _no_pickle(monkeypatch)
    restored, m = ckpt.load(tmp_path, tree.map(torch.empty_like, state))
    assert m.step == 2
    want = tree.map(lambda x: x + 1, before)
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(restored), tree.leaves(want), strict=True))


def test_a_failed_async_write_raises_at_the_next_wait_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    import ftitan.checkpoint._commit as commit

    def full_disk(*_a, **_k):
        raise OSError("No space left on device")

    monkeypatch.setattr(commit, "_write_durable", full_disk)
    saver = ckpt.Checkpointer(tmp_path, backend="dcp")
    saver.save(1, {"w": torch.ones(4)})  # returns: the failure happens in the background
    with pytest.raises(OSError, match="No space left"):
        saver.close()
    assert list(tmp_path.iterdir()) == []  # the temp dir went with it


def test_small_saves_skip_the_writer_process_until_a_large_one(tmp_path):
    saver = ckpt.Checkpointer(tmp_path, backend="torch-checkpointing", subprocess_min_bytes=1 << 10)
    saver.save(1, {"w": torch.ones(16)})  # 64 bytes: a staged copy, written from the checkpointer's thread
    saver.wait()
    assert saver._writer._manager is None
    saver.save(2, {"w": torch.ones(1024)})  # 4 KiB: torch-checkpointing's writer process from now on
    assert saver._writer._manager is not None
    saver.close()
    restored, manifest = ckpt.load(tmp_path, {"w": torch.empty(1024)})
    assert manifest.step == 2 and manifest.backend == "torch-checkpointing" and restored["w"].eq(1).all()


def test_bad_backend_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"'tape'.*'torch-checkpointing', 'dcp', 'sync'"):
        ckpt.Checkpointer(tmp_path, backend="tape")
