"""Loading a checkpoint into the structure of a given tree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ftitan import tree as ftree
from ftitan.checkpoint._layout import latest, step_of
from ftitan.checkpoint._manifest import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointError,
    CorruptCheckpointError,
    Manifest,
    read_manifest,
    spec_of,
    verify_files,
)

__all__ = ["load"]

_SHOWN = 5  # paths listed in a mismatch error


def load(path_or_directory: str | Path, like_tree: Any, *, verify: bool = True) -> tuple[Any, Manifest]:
    """``(tree, manifest)``: the checkpoint restored into the structure of ``like_tree``.

    ``path_or_directory`` is a checkpoint (``.../step_00000100``) or a
    directory of them, in which case the newest valid one is loaded (see
    :func:`~ftitan.checkpoint.latest`). ``like_tree`` must have the same
    dotted paths, dtypes and shapes as the saved tree; only its structure,
    and each leaf's device and ``requires_grad``, are used, so a tree of
    ``meta`` tensors works (its leaves are loaded to the CPU).
    With ``verify=True`` the tensor file's sha256 is checked first.

    Raises :class:`CheckpointError` naming the mismatched paths, or
    :class:`CorruptCheckpointError` for a missing manifest, a truncated or
    corrupted file.

    >>> state, manifest = load("ckpt", init_state(params, opt))
    >>> manifest.step, manifest.extra["config"]
    """
    checkpoint, verified = _resolve(Path(path_or_directory), verify=verify)
    manifest = read_manifest(checkpoint)
    if verify and not verified:
        verify_files(manifest)
    paths, likes, treedef = ftree.flatten_with_paths(like_tree)
    _check_structure(manifest, paths, likes)
    file = manifest.path / STATE_FILE
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            leaves = [_restore(path, f.get_tensor(path), like) for path, like in zip(paths, likes, strict=True)]
    except SafetensorError as e:
        raise CorruptCheckpointError(f"{file}: unreadable tensor file ({e}); restore from another checkpoint") from e
    return ftree.unflatten(treedef, leaves), manifest


def _resolve(path: Path, *, verify: bool) -> tuple[Path, bool]:
    """The checkpoint to read, and whether its files were already verified."""
    if step_of(path) is not None or (path / MANIFEST_FILE).exists() or (path / STATE_FILE).exists():
        return path, False
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint or checkpoint directory")
    found = latest(path, verify=verify)
    if found is None:
        raise FileNotFoundError(
            f"{path}: no valid checkpoint (step_XXXXXXXX directory with a good manifest) in this directory"
        )
    return found, verify


def _check_structure(manifest: Manifest, paths: list[str], likes: list[Any]) -> None:
    where = f"checkpoint {manifest.path}"
    saved = {s.path: s for s in manifest.leaves}
    missing = [p for p in paths if p not in saved]
    wanted = set(paths)
    unexpected = [p for p in saved if p not in wanted]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_some(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in like_tree: {_some(unexpected)}")
        raise CheckpointError(
            f"{where}: the tree structure differs; {'; '.join(parts)}. Build like_tree the way the saved run "
            "did (same model and optimizer config; manifest.extra may hold it)"
        )
    for path, like in zip(paths, likes, strict=True):
        if not isinstance(like, torch.Tensor):
            raise TypeError(f"{path}: like_tree leaf is a {type(like).__name__}, expected a tensor")
        want, got = spec_of(path, like), saved[path]
        if want.shape != got.shape:
            raise CheckpointError(
                f"{where}: {path} has shape {list(got.shape)} but like_tree has {list(want.shape)}; "
                "build like_tree with the saved model config"
            )
        if want.dtype != got.dtype:
            raise CheckpointError(
                f"{where}: {path} is {got.describe()} but like_tree has {want.describe()}; build like_tree "
                f"in {got.dtype} and cast after loading (ftitan.tree.cast)"
            )


def _some(paths: list[str]) -> str:
    shown = ", ".join(paths[:_SHOWN])
    return shown + (f" (and {len(paths) - _SHOWN} more)" if len(paths) > _SHOWN else "")


def _restore(path: str, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if x.dtype != like.dtype or x.shape != like.shape:  # the file disagrees with its own manifest
        raise CorruptCheckpointError(
            f"{path}: stored as {spec_of(path, x).describe()}, but the manifest says {spec_of(path, like).describe()}"
        )
    if like.device.type not in ("cpu", "meta"):
        x = x.to(like.device)
    if like.requires_grad:
        x.requires_grad_(True)
    return x
