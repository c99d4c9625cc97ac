"""The manifest: what a checkpoint holds, and checks that its files are whole.

``manifest.json`` is written last and names every leaf (dotted path, dtype,
shape) and the size and sha256 of ``state.safetensors``. A checkpoint whose
manifest is missing, unreadable, or disagrees with the tensor file is
*corrupt*; :class:`CorruptCheckpointError` says so, and
:func:`~ftitan.checkpoint.latest` skips such checkpoints.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs
import torch

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "STATE_FILE",
    "CheckpointError",
    "CorruptCheckpointError",
    "LeafSpec",
    "Manifest",
    "read_manifest",
    "verify_files",
]

FORMAT = "ftitan.checkpoint"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.safetensors"

_LEAVES = "\x00leaves"  # placeholder while formatting manifest.json
_CHUNK = 1 << 22  # 4 MiB reads while hashing


class CheckpointError(ValueError):
    """A checkpoint cannot be restored into the requested tree (paths, dtypes, shapes)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are missing, truncated or fail their checksum."""


@attrs.frozen(kw_only=True)
class LeafSpec:
    """One saved tensor: its dotted path, dtype name (``"bfloat16"``) and shape."""

    path: str
    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@attrs.frozen(kw_only=True)
class Manifest:
    """The parsed ``manifest.json`` of the checkpoint at ``path``."""

    path: Path  # the checkpoint directory, step_XXXXXXXX
    step: int
    leaves: tuple[LeafSpec, ...]  # in the tree's flatten order
    state_sha256: str  # hex digest of state.safetensors
    state_nbytes: int  # size of state.safetensors
    extra: dict[str, Any] = attrs.field(factory=dict, eq=False)  # JSON metadata given to save()
    version: int = FORMAT_VERSION


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_of(path: str, x: torch.Tensor) -> LeafSpec:
    return LeafSpec(path=path, dtype=dtype_name(x.dtype), shape=tuple(x.shape))


def sha256_file(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest_json(manifest: Manifest) -> str:
    doc = {
        "format": FORMAT,
        "version": manifest.version,
        "step": manifest.step,
        "files": {STATE_FILE: {"sha256": manifest.state_sha256, "bytes": manifest.state_nbytes}},
        "leaves": _LEAVES,
        "extra": manifest.extra,
    }
    # one leaf per line: a manifest is read by people diffing two runs
    leaves = ",\n  ".join(
        json.dumps({"path": s.path, "dtype": s.dtype, "shape": list(s.shape)}) for s in manifest.leaves
    )
    text = json.dumps(doc, indent=1, allow_nan=False)
    return text.replace(json.dumps(_LEAVES), f"[\n  {leaves}\n ]" if leaves else "[]", 1) + "\n"


def read_manifest(checkpoint: str | Path) -> Manifest:
    """The manifest of the checkpoint directory ``checkpoint``; checks the format, not the files."""
    checkpoint = Path(checkpoint)
    file = checkpoint / MANIFEST_FILE
    if not file.is_file():
        hint = (
            "the save was interrupted before it committed, or this is not a checkpoint directory"
            if checkpoint.is_dir()
            else "the directory does not exist"
        )
        raise CorruptCheckpointError(
            f"{file}: missing manifest ({hint}); "
            f"use ftitan.checkpoint.latest({str(checkpoint.parent)!r}) to pick the newest complete checkpoint"
        )
    try:
        doc = json.loads(file.read_text())
        if doc.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{file}: format {doc.get('format')!r} is not {FORMAT!r}")
        if doc["version"] != FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{file}: format version {doc['version']} is not supported (this ftitan reads version "
                f"{FORMAT_VERSION}); load it with the ftitan version that wrote it"
            )
        state = doc["files"][STATE_FILE]
        return Manifest(
            path=checkpoint,
            step=int(doc["step"]),
            leaves=tuple(
                LeafSpec(path=d["path"], dtype=d["dtype"], shape=tuple(int(n) for n in d["shape"]))
                for d in doc["leaves"]
            ),
            state_sha256=str(state["sha256"]),
            state_nbytes=int(state["bytes"]),
            extra=doc.get("extra") or {},
            version=doc["version"],
        )
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{file}: unreadable manifest ({type(e).__name__}: {e})") from e


def verify_files(manifest: Manifest) -> None:
    """Raises :class:`CorruptCheckpointError` unless ``state.safetensors`` matches the manifest."""
    file = manifest.path / STATE_FILE
    if not file.is_file():
        raise CorruptCheckpointError(f"{file}: missing tensor file; the checkpoint was partly deleted")
    size = file.stat().st_size
    if size != manifest.state_nbytes:
        raise CorruptCheckpointError(
            f"{file}: {size} bytes but the manifest records {manifest.state_nbytes}: the file is "
            f"{'truncated' if size < manifest.state_nbytes else 'overwritten'} (disk full, or a copy cut short?); "
            "restore from another checkpoint, e.g. ftitan.checkpoint.latest(directory)"
        )
    digest = sha256_file(file)
    if digest != manifest.state_sha256:
        raise CorruptCheckpointError(
            f"{file}: sha256 {digest[:16]}… does not match the manifest's {manifest.state_sha256[:16]}…: "
            "the file is corrupted; restore from another checkpoint, e.g. ftitan.checkpoint.latest(directory)"
        )
