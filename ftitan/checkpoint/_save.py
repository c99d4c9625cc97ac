"""Saving a tree: write into a temp directory, fsync, rename into place.

The rename is the commit point. Before it, only a hidden ``.tmp-step_…``
directory exists, which :func:`~ftitan.checkpoint.list_checkpoints` ignores;
after it, the checkpoint is complete and durable. A crash at any moment
therefore leaves either the new checkpoint or none, never half of one.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ftitan import tree as ftree
from ftitan.checkpoint._layout import TMP_PREFIX, checkpoint_dirname, list_checkpoints, step_of
from ftitan.checkpoint._manifest import (
    MANIFEST_FILE,
    STATE_FILE,
    Manifest,
    manifest_json,
    sha256_file,
    spec_of,
)

__all__ = ["save"]


def save(
    directory: str | Path,
    step: int,
    tree: Any,
    *,
    extra: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Writes ``tree`` as the checkpoint ``directory/step_{step:08d}/`` and returns its path.

    Every leaf must be a tensor; it is stored in ``state.safetensors`` under
    its dotted path (``ftitan.tree.paths``), so a ``TrainState`` round-trips
    bit-exactly. ``extra`` is JSON metadata kept in ``manifest.json`` (the
    run's config, a git commit, ...); tensor state such as
    ``ftitan.data.LoaderState`` belongs in ``tree`` itself. The write is
    atomic: see the module docstring. An existing checkpoint of the same
    step is replaced.

    ``keep=K`` then deletes older checkpoints so that the K newest with a
    step up to ``step`` remain (this one included); checkpoints of later
    steps, left by a run this one restarted behind, are not touched.

    >>> save("ckpt", int(state.step), state, extra={"config": attrs.asdict(cfg)}, keep=3)
    """
    step = _check_step(step)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep={keep!r}: expected an int >= 1 (or None to keep every checkpoint)")
    extra = {} if extra is None else dict(extra)
    _check_json("extra", extra)
    tensors, specs = _tensors_by_path(tree)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_dirname(step)
    tmp = _hidden_name(final)
    tmp.mkdir()  # not tempfile.mkdtemp, whose 0o700 would hide the checkpoint from other users
    try:
        state_file = tmp / STATE_FILE
        save_file(tensors, str(state_file))
        _fsync_file(state_file)
        manifest = Manifest(
            path=final,
            step=step,
            leaves=specs,
            state_sha256=sha256_file(state_file),
            state_nbytes=state_file.stat().st_size,
            extra=extra,
        )
        _write_durable(tmp / MANIFEST_FILE, manifest_json(manifest))
        _fsync_dir(tmp)
        _commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        _prune(directory, step, keep)
    return final


def _check_step(step: Any) -> int:
    if isinstance(step, torch.Tensor) and step.dim() == 0 and not step.is_floating_point():
        step = int(step.item())
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: expected an int >= 0 (e.g. int(state.step))")
    return step


def _check_json(where: str, value: Any) -> None:
    # walk first so the error names the offending key, which json.dumps does not
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is not a str; JSON objects need str keys")
            _check_json(f"{where}[{k!r}]", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(f"{where}[{i}]", v)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value!r} is not valid JSON; store it as a string")
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        raise TypeError(
            f"{where}: {type(value).__name__} is not JSON-able; convert it first "
            "(attrs.asdict(config), tensor.tolist(), str(path))"
        )


def _tensors_by_path(tree: Any) -> tuple[dict[str, torch.Tensor], tuple[Any, ...]]:
    paths, leaves, _ = ftree.flatten_with_paths(tree)
    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for path, x in zip(paths, leaves, strict=True):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{path}: leaf is a {type(x).__name__}, not a tensor; a checkpoint stores tensors only. "
                "Make it a 0-d tensor, or pass it through save(..., extra={...})"
            )
        if path in tensors:
            raise ValueError(
                f"{path}: two leaves share this dotted path (a dict key containing '.'?); "
                "rename the keys so that paths are unique"
            )
        if x.device.type == "meta":
            raise ValueError(f"{path}: a meta tensor has no data to save; materialize the tree first")
        tensors[path] = _standalone(x.detach().cpu(), seen_storage)
    return tensors, tuple(spec_of(p, t) for p, t in tensors.items())


def _standalone(x: torch.Tensor, seen_storage: set[int]) -> torch.Tensor:
    # safetensors refuses tensors that share storage or do not span their
    # whole storage (views, tied weights); copy only those
    storage = x.untyped_storage()
    ptr = storage.data_ptr()
    whole = x.is_contiguous() and x.storage_offset() == 0 and storage.nbytes() == x.numel() * x.element_size()
    if not whole or (ptr in seen_storage and storage.nbytes() > 0):
        x = x.clone(memory_format=torch.contiguous_format)
        ptr = x.untyped_storage().data_ptr()
    seen_storage.add(ptr)
    return x


def _hidden_name(final: Path, tag: str = "") -> Path:
    return final.parent / f"{TMP_PREFIX}{tag}{final.name}-{os.getpid()}-{secrets.token_hex(4)}"


def _fsync_file(file: Path) -> None:
    with open(file, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(file: Path, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _commit(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():
        # a non-empty directory cannot be renamed over: move the old one aside
        # (hidden, so a crash here leaves the previous step as latest)
        old = _hidden_name(final, "old-")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(directory: Path, step: int, keep: int) -> None:
    older = [p for p in list_checkpoints(directory) if (s := step_of(p)) is not None and s <= step]
    for path in older[: max(0, len(older) - keep)]:
        shutil.rmtree(path, ignore_errors=True)
