"""The manifest: what a checkpoint holds, where each block of it lies, and checks that its files are whole.

``manifest.json`` is written last, by rank 0, from every rank's index. It
names every leaf (dotted path, dtype, global shape) and its *chunks*: the
blocks the ranks wrote, each a tensor ``key`` in a safetensors ``file`` of
the checkpoint, placed at global ``offsets`` with its own ``shape``. Every
file is listed with its size and sha256. A checkpoint whose manifest is
missing, unreadable, or disagrees with its files is *corrupt*;
:class:`CorruptCheckpointError` says so, and
:func:`~ftitan.checkpoint.latest` skips such checkpoints.

Version 1 (one ``state.safetensors`` holding every leaf whole, written by
ftitan before sharded saves) is read as a manifest whose leaves each have
one chunk covering all of it, so old run directories keep loading.
"""

from __future__ import annotations

import hashlib
import json
import math
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
    "Chunk",
    "CorruptCheckpointError",
    "FileSpec",
    "LeafSpec",
    "Manifest",
    "read_manifest",
    "verify_files",
]

FORMAT = "ftitan.checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.safetensors"  # version 1's single tensor file

_LEAVES = "\x00leaves"  # placeholder while formatting manifest.json
_CHUNK = 1 << 22  # 4 MiB reads while hashing


class CheckpointError(ValueError):
    """A checkpoint cannot be restored into the requested tree (paths, dtypes, shapes)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are missing, truncated or fail their checksum."""


@attrs.frozen(kw_only=True)
class Chunk:
    """One block of a leaf, as a rank wrote it: tensor ``key`` of ``file``, at global ``offsets``."""

    file: str  # relative to the checkpoint directory, e.g. "rank00003.safetensors"
    key: str  # the tensor's name in that file
    offsets: tuple[int, ...]  # where the block starts in the leaf, per dim
    shape: tuple[int, ...]  # the block's shape

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, "offsets": list(self.offsets), "shape": list(self.shape)}


@attrs.frozen(kw_only=True)
class LeafSpec:
    """One saved tensor: its dotted path, dtype name (``"bfloat16"``), global shape and chunks."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...] = ()

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@attrs.frozen(kw_only=True)
class FileSpec:
    """A tensor file of the checkpoint: its size and sha256 (hex)."""

    nbytes: int
    sha256: str


@attrs.frozen(kw_only=True)
class Manifest:
    """The parsed ``manifest.json`` of the checkpoint at ``path``."""

    path: Path  # the checkpoint directory, step_XXXXXXXX
    step: int
    leaves: tuple[LeafSpec, ...]
    files: dict[str, FileSpec] = attrs.field(factory=dict, eq=False)  # name (relative to path) -> size, sha256
    extra: dict[str, Any] = attrs.field(factory=dict, eq=False)  # JSON metadata given to save()
    world_size: int = 1  # ranks that wrote it
    backend: str = "sync"  # the writer that wrote the files
    version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        """Bytes of all tensor files together."""
        return sum(f.nbytes for f in self.files.values())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_of(path: str, x: torch.Tensor) -> LeafSpec:
    """``x``'s path, dtype and (global, for a DTensor) shape."""
    return LeafSpec(path=path, dtype=dtype_name(x.dtype), shape=tuple(x.shape))


def sha256_file(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_spec(file: Path) -> FileSpec:
    return FileSpec(nbytes=file.stat().st_size, sha256=sha256_file(file))


def leaf_json(leaf: LeafSpec) -> dict[str, Any]:
    return {"path": leaf.path, "dtype": leaf.dtype, "shape": list(leaf.shape), "chunks": [c.to_json() for c in leaf.chunks]}


def leaf_from_json(d: dict[str, Any]) -> LeafSpec:
    chunks = tuple(
        Chunk(file=str(c["file"]), key=str(c["key"]), offsets=tuple(int(n) for n in c["offsets"]),
              shape=tuple(int(n) for n in c["shape"]))
        for c in d.get("chunks", ())
    )  # fmt: skip
    return LeafSpec(path=str(d["path"]), dtype=str(d["dtype"]), shape=tuple(int(n) for n in d["shape"]), chunks=chunks)


def manifest_json(manifest: Manifest) -> str:
    doc = {
        "format": FORMAT,
        "version": manifest.version,
        "step": manifest.step,
        "world_size": manifest.world_size,
        "backend": manifest.backend,
        "files": {name: {"bytes": f.nbytes, "sha256": f.sha256} for name, f in sorted(manifest.files.items())},
        "leaves": _LEAVES,
        "extra": manifest.extra,
    }
    # one leaf per line: a manifest is read by people diffing two runs
    leaves = ",\n  ".join(json.dumps(leaf_json(s)) for s in manifest.leaves)
    text = json.dumps(doc, indent=1, allow_nan=False)
    return text.replace(json.dumps(_LEAVES), f"[\n  {leaves}\n ]" if leaves else "[]", 1) + "\n"


def _missing_manifest(checkpoint: Path, file: Path) -> CorruptCheckpointError:
    hint = (
        "the save was interrupted before it committed, or this is not a checkpoint directory"
        if checkpoint.is_dir()
        else "the directory does not exist"
    )
    return CorruptCheckpointError(
        f"{file}: missing manifest ({hint}); "
        f"use ftitan.checkpoint.latest({str(checkpoint.parent)!r}) to pick the newest complete checkpoint"
    )


def read_manifest(checkpoint: str | Path) -> Manifest:
    """The manifest of the checkpoint directory ``checkpoint``; checks the format and that every chunk
    lies inside its leaf and in a listed file, not the files themselves (:func:`verify_files`)."""
    checkpoint = Path(checkpoint)
    file = checkpoint / MANIFEST_FILE
    if not file.is_file():
        raise _missing_manifest(checkpoint, file)
    try:
        doc = json.loads(file.read_text())
        if doc.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{file}: format {doc.get('format')!r} is not {FORMAT!r}")
        if doc["version"] not in READABLE_VERSIONS:
            raise CorruptCheckpointError(
                f"{file}: format version {doc['version']} is not supported (this ftitan reads versions "
                f"{READABLE_VERSIONS}); load it with the ftitan version that wrote it"
            )
        manifest = _v1(checkpoint, doc) if doc["version"] == 1 else _v2(checkpoint, doc)
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{file}: unreadable manifest ({type(e).__name__}: {e})") from e
    _check_chunks(manifest, file)
    return manifest


def _v1(checkpoint: Path, doc: dict[str, Any]) -> Manifest:
    state = doc["files"][STATE_FILE]
    leaves = []
    for d in doc["leaves"]:
        shape = tuple(int(n) for n in d["shape"])
        whole = Chunk(file=STATE_FILE, key=str(d["path"]), offsets=(0,) * len(shape), shape=shape)
        leaves.append(LeafSpec(path=str(d["path"]), dtype=str(d["dtype"]), shape=shape, chunks=(whole,)))
    return Manifest(
        path=checkpoint, step=int(doc["step"]), leaves=tuple(leaves),
        files={STATE_FILE: FileSpec(nbytes=int(state["bytes"]), sha256=str(state["sha256"]))},
        extra=doc.get("extra") or {}, version=1,
    )  # fmt: skip


def _v2(checkpoint: Path, doc: dict[str, Any]) -> Manifest:
    return Manifest(
        path=checkpoint,
        step=int(doc["step"]),
        leaves=tuple(leaf_from_json(d) for d in doc["leaves"]),
        files={str(n): FileSpec(nbytes=int(f["bytes"]), sha256=str(f["sha256"])) for n, f in doc["files"].items()},
        extra=doc.get("extra") or {},
        world_size=int(doc.get("world_size", 1)),
        backend=str(doc.get("backend", "sync")),
        version=int(doc["version"]),
    )


def _check_chunks(manifest: Manifest, file: Path) -> None:
    for leaf in manifest.leaves:
        covered = 0
        for c in leaf.chunks:
            inside = len(c.offsets) == len(c.shape) == len(leaf.shape) and all(
                0 <= o and o + n <= s for o, n, s in zip(c.offsets, c.shape, leaf.shape, strict=True)
            )
            if not inside or c.file not in manifest.files:
                raise CorruptCheckpointError(
                    f"{file}: {leaf.path}'s chunk {c.to_json()} lies outside the leaf {list(leaf.shape)} or in a "
                    "file the manifest does not list; restore from another checkpoint"
                )
            covered += math.prod(c.shape)
        if covered != math.prod(leaf.shape):
            raise CorruptCheckpointError(
                f"{file}: {leaf.path}'s chunks hold {covered} of its {math.prod(leaf.shape)} elements; "
                "restore from another checkpoint"
            )


def verify_files(manifest: Manifest, names: list[str] | None = None, *, hash: bool = True) -> None:
    """Raises :class:`CorruptCheckpointError` unless the tensor files ``names`` (default: all the manifest
    lists) have the recorded size and (``hash=True``) sha256. Hashing reads each file whole."""
    for name in manifest.files if names is None else names:
        file, want = manifest.path / name, manifest.files[name]
        if not file.is_file():
            raise CorruptCheckpointError(f"{file}: missing tensor file; the checkpoint was partly deleted")
        size = file.stat().st_size
        if size != want.nbytes:
            raise CorruptCheckpointError(
                f"{file}: {size} bytes but the manifest records {want.nbytes}: the file is "
                f"{'truncated' if size < want.nbytes else 'overwritten'} (disk full, or a copy cut short?); "
                "restore from another checkpoint, e.g. ftitan.checkpoint.latest(directory)"
            )
        if not hash:
            continue
        digest = sha256_file(file)
        if digest != want.sha256:
            raise CorruptCheckpointError(
                f"{file}: sha256 {digest[:16]}… does not match the manifest's {want.sha256[:16]}…: "
                "the file is corrupted; restore from another checkpoint, e.g. ftitan.checkpoint.latest(directory)"
            )
