"""Damaged and mismatched checkpoints: clear errors, and latest() falls back."""

import json
import os

import pytest
import torch

import ftitan.checkpoint as ckpt

STATE = {"params": {"layers": {"0": {"wq": torch.arange(12.0).reshape(3, 4)}}, "norm": torch.ones(4)}}


def _like():
    return {"params": {"layers": {"0": {"wq": torch.empty(3, 4)}}, "norm": torch.empty(4)}}


def _two_checkpoints(directory):
    first = ckpt.save(directory, 1, STATE)
    second = ckpt.save(directory, 2, STATE)
    return first, second


def _flip_byte(file, offset):
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))


def test_corrupted_tensor_file_is_detected_and_latest_falls_back(tmp_path):
    first, second = _two_checkpoints(tmp_path)
    _flip_byte(second / "rank00000.safetensors", -5)  # inside the tensor data, header still parses

    with pytest.raises(ckpt.CorruptCheckpointError, match=r"step_00000002.*sha256.*corrupted"):
        ckpt.load(second, _like())
    with pytest.warns(UserWarning, match=r"skipping checkpoint step_00000002.*corrupted"):
        assert ckpt.latest(tmp_path) == first
    with pytest.warns(UserWarning):
        _, manifest = ckpt.load(tmp_path, _like())
    assert manifest.step == 1


def test_truncated_tensor_file(tmp_path):
    first, second = _two_checkpoints(tmp_path)
    file = second / "rank00000.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size // 2)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"bytes but the manifest records .* truncated"):
        ckpt.load(second, _like())
    with pytest.warns(UserWarning, match="truncated"):
        assert ckpt.latest(tmp_path, verify=False) == first


def test_missing_or_broken_manifest(tmp_path):
    first, second = _two_checkpoints(tmp_path)
    (second / "manifest.json").unlink()
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"missing manifest.*latest\("):
        ckpt.load(second, _like())
    (second / "manifest.json").write_text('{"format": "ftitan.checkpoint", "vers')  # cut short
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"unreadable manifest"):
        ckpt.load(second, _like())
    with pytest.warns(UserWarning, match="unreadable manifest"):
        assert ckpt.latest(tmp_path) == first


def test_newer_format_version_is_refused(tmp_path):
    path = ckpt.save(tmp_path, 1, STATE)
    doc = json.loads((path / "manifest.json").read_text())
    doc["version"] = ckpt.FORMAT_VERSION + 1
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"version 3 is not supported"):
        ckpt.read_manifest(path)


def test_leftover_temp_dir_and_partial_checkpoint_are_ignored(tmp_path):
    first = ckpt.save(tmp_path, 1, STATE)
    # a save killed before its rename: a hidden temp dir with a partial file
    tmp = tmp_path / ".tmp-step_00000002-abc123"
    tmp.mkdir()
    (tmp / "rank00000.safetensors").write_bytes(b"\x00" * 10)
    # a directory that looks committed but was written by something non-atomic
    partial = tmp_path / "step_00000003"
    partial.mkdir()
    (partial / "rank00000.safetensors").write_bytes((first / "rank00000.safetensors").read_bytes()[:40])

    assert ckpt.list_checkpoints(tmp_path) == [first, partial]
    with pytest.warns(UserWarning, match=r"skipping checkpoint step_00000003.*missing manifest"):
        assert ckpt.latest(tmp_path) == first
    with pytest.warns(UserWarning):
        restored, _ = ckpt.load(tmp_path, _like())
    assert torch.equal(restored["params"]["layers"]["0"]["wq"], STATE["params"]["layers"]["0"]["wq"])


def test_directory_without_valid_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="no valid checkpoint"):
        ckpt.load(tmp_path, _like())
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        ckpt.load(tmp_path / "absent", _like())


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t["params"].pop("norm"), r"in the checkpoint but not in like_tree: params\.norm"),
        (lambda t: t["params"].update(bias=torch.empty(4)), r"missing from the checkpoint: params\.bias"),
        (
            lambda t: t["params"]["layers"]["0"].update(wq=torch.empty(4, 3)),
            r"params\.layers\.0\.wq has shape \[3, 4\] but like_tree has \[4, 3\]",
        ),
        (
            lambda t: t["params"].update(norm=torch.empty(4, dtype=torch.bfloat16)),
            r"params\.norm is float32\[4\] but like_tree has bfloat16\[4\].*cast",
        ),
    ],
)
def test_structure_mismatch_names_the_path(tmp_path, edit, match):
    path = ckpt.save(tmp_path, 1, STATE)
    like = _like()
    edit(like)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load(path, like)


def test_no_temp_dirs_remain_after_a_failed_save(tmp_path, monkeypatch):
    import ftitan.checkpoint._backends as backends

    def boom(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(backends, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(tmp_path, 1, STATE)
    assert os.listdir(tmp_path) == []


def test_resume_skips_a_bad_newest_and_raises_when_none_is_valid(tmp_path):
    run = ckpt.RunDir(tmp_path)
    assert run.resume(_like()) is None  # no checkpoint at all: a fresh start
    run.save(1, STATE, keep=3, cfg_dict={})
    run.save(2, STATE, keep=3, cfg_dict={})
    _flip_byte(run.checkpoints / "step_00000002" / "rank00000.safetensors", -5)
    with pytest.warns(UserWarning, match=r"skipping checkpoint step_00000002.*sha256"):
        _, step = run.resume(_like())
    assert step == 1
    (run.checkpoints / "step_00000001" / "manifest.json").unlink()
    with pytest.warns(UserWarning), pytest.raises(ckpt.CorruptCheckpointError) as e:
        run.resume(_like())  # checkpoints exist but none loads: never a silent restart from step 0
    message = str(e.value)
    assert "2 checkpoint(s), none of which loads" in message and "\n" not in message
    assert "step_00000002: " in message and "sha256" in message
    assert "step_00000001: " in message and "missing manifest" in message


def test_a_version_1_checkpoint_still_loads(tmp_path):
    from safetensors.torch import save_file

    from ftitan.checkpoint._manifest import sha256_file

    path = tmp_path / "step_00000007"
    path.mkdir()
    flat = {"params.layers.0.wq": STATE["params"]["layers"]["0"]["wq"], "params.norm": STATE["params"]["norm"]}
    save_file(flat, str(path / "state.safetensors"))
    doc = {"format": "ftitan.checkpoint", "version": 1, "step": 7,
           "files": {"state.safetensors": {"sha256": sha256_file(path / "state.safetensors"),
                                           "bytes": (path / "state.safetensors").stat().st_size}},
           "leaves": [{"path": p, "dtype": "float32", "shape": list(x.shape)} for p, x in flat.items()],
           "extra": {"config": {"steps": 7}}}  # fmt: skip
    (path / "manifest.json").write_text(json.dumps(doc))
    assert ckpt.latest(tmp_path) == path
    restored, manifest = ckpt.load(tmp_path, _like())
    assert manifest.step == 7 and manifest.version == 1 and manifest.extra["config"]["steps"] == 7
    assert torch.equal(restored["params"]["layers"]["0"]["wq"], flat["params.layers.0.wq"])


def test_a_run_removes_temp_dirs_of_killed_saves_before_training(tiny_run_cfg):
    import attrs

    from ftitan.train.trainer import train

    train(attrs.evolve(tiny_run_cfg, checkpoint=attrs.evolve(tiny_run_cfg.checkpoint, backend="sync")), progress=False)
    leftover = ckpt.RunDir.of(tiny_run_cfg).checkpoints / ".tmp-step_00000003-1234-abcd"
    leftover.mkdir()
    (leftover / "rank00000.safetensors").write_bytes(b"\x00" * 10)
    more = attrs.evolve(tiny_run_cfg, steps=3, checkpoint=attrs.evolve(tiny_run_cfg.checkpoint, backend="sync"))
    assert train(more, resume=True, progress=False)["start_step"] == 2
    assert sorted(p.name for p in leftover.parent.iterdir()) == ["step_00000002", "step_00000003"]
