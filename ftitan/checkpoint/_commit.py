"""The commit protocol of a sharded save: per-rank files and indexes in a hidden temp dir, rank 0 renames.

1. Every rank calls :func:`begin` (the one collective, in the caller's
   thread): rank 0 picks a nonce, so all ranks write into the same hidden
   ``.tmp-step_XXXXXXXX-<nonce>/``, and the ranks check they agree on the
   plain (non-DTensor) leaves rank 0 will write alone.
2. Each rank writes its tensor file(s), fsyncs them, then its index
   ``rankNNNNN.index.json`` (file sizes and sha256, the chunks it wrote,
   every leaf's spec), renamed into place so it is never seen half-written.
   A rank whose write fails leaves ``rankNNNNN.error`` instead.
3. Rank 0 (:func:`commit`, in whatever thread finished its own write) waits
   until every rank's index exists, merges them into ``manifest.json``
   (checking the chunks tile every leaf exactly), fsyncs it and renames the
   temp dir to ``step_XXXXXXXX``: the commit point. It then prunes to ``keep``.

Steps 2-3 use only the file system, so they may run in a background thread
while training goes on. A crash anywhere before the rename leaves the
previous checkpoint as the newest; :func:`remove_unfinished` deletes the
temp dirs such crashes leave (rank 0, when a run starts).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ftitan.checkpoint._layout import TMP_PREFIX, checkpoint_dirname, list_checkpoints, step_of
from ftitan.checkpoint._manifest import (
    MANIFEST_FILE,
    CheckpointError,
    FileSpec,
    LeafSpec,
    Manifest,
    leaf_from_json,
    leaf_json,
    manifest_json,
)

__all__ = ["begin", "commit", "patient_group", "rank_file", "remove_unfinished", "world", "write_error", "write_index"]

_SHOWN = 5


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_PATIENT: dict[float, tuple[Any, Any]] = {}  # timeout -> (the world group it was made in, the group)


def patient_group(timeout_s: float) -> Any:
    """A gloo group of every rank whose collectives wait up to ``timeout_s`` (collective to create: every
    rank calls it at the same point; made once per timeout and process group).

    A checkpoint's few small collectives wait on slow file-system work of some rank (rank 0 committing
    the previous save, another rank still loading), which the run's collective timeout is not sized
    for; gloo also keeps them off an NCCL group's device."""
    made_in, group = _PATIENT.get(timeout_s, (None, None))
    if made_in is not dist.group.WORLD:  # none yet, or the process group was destroyed and made again
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        _PATIENT[timeout_s] = (dist.group.WORLD, group)
    return group


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def _index_name(rank: int) -> str:
    return f"rank{rank:05d}.index.json"


def _error_name(rank: int) -> str:
    return f"rank{rank:05d}.error"


def begin(directory: Path, step: int, plain: tuple[Any, ...], group: Any = None) -> Path:
    """The temp dir every rank writes this save into (collective under a process group: every rank
    calls it; ``group``: e.g. :func:`patient_group`). ``plain``: this rank's plain leaves,
    ``(path, dtype, shape)``; raises when ranks differ."""
    rank, size = world()
    nonce = f"{os.getpid()}-{secrets.token_hex(4)}" if rank == 0 else ""
    if size > 1:
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, (nonce, plain), group=group)
        nonce = everyone[0][0]
        _check_plain([p for _, p in everyone])
    tmp = directory / f"{TMP_PREFIX}{checkpoint_dirname(step)}-{nonce}"
    tmp.mkdir(parents=True, exist_ok=True)  # not tempfile.mkdtemp, whose 0o700 would hide it from other users
    return tmp


def _check_plain(per_rank: list[tuple[Any, ...]]) -> None:
    """Rank 0 writes the plain leaves for everyone: under pipeline parallel, every stage must hold the same."""
    first = set(per_rank[0])
    for r, plain in enumerate(per_rank[1:], start=1):
        if set(plain) != first:
            only0 = sorted(p for p, *_ in first - set(plain))
            only_r = sorted(p for p, *_ in set(plain) - first)
            raise CheckpointError(
                f"checkpoint: ranks 0 and {r} hold different plain (non-DTensor) leaves (only on rank 0: "
                f"{_some(only0)}; only on rank {r}: {_some(only_r)}), but rank 0 writes them for every rank; "
                "make them DTensors on the mesh, or the same on every rank (pipeline stages included)"
            )


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN]) or "none"
    return shown + (f" (and {len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def fsync_file(file: Path) -> None:
    with open(file, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(file: Path, text: str) -> None:
    part = file.with_name(file.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, file)


def write_index(tmp: Path, *, rank: int, size: int, step: int, files: dict[str, FileSpec], leaves: tuple[LeafSpec, ...]) -> None:
    """Step 2's last act: this rank's files are durable; announce them and its chunks to rank 0."""
    doc = {"rank": rank, "world_size": size, "step": step,
           "files": {n: {"bytes": f.nbytes, "sha256": f.sha256} for n, f in files.items()},
           "leaves": [leaf_json(s) for s in leaves]}  # fmt: skip
    _write_durable(tmp / _index_name(rank), json.dumps(doc))


def write_error(tmp: Path, rank: int, error: BaseException) -> None:
    """Tell rank 0 this rank's part of the save failed (best effort: the disk may be the problem)."""
    try:
        _write_durable(tmp / _error_name(rank), f"{type(error).__name__}: {error}")
    except OSError:
        pass


def _wait_for_indexes(tmp: Path, size: int, timeout: float, stop: threading.Event | None = None) -> list[dict[str, Any]]:
    deadline, pause = time.monotonic() + timeout, 0.005
    missing = list(range(size))
    while True:
        if stop is not None and stop.is_set():
            raise CheckpointError(f"{tmp}: the run stopped before every rank wrote its part; the save is given up "
                                  "and the previous checkpoint stays the newest")  # fmt: skip
        for r in range(size):
            if (err := tmp / _error_name(r)).exists():
                raise CheckpointError(f"{tmp}: rank {r} failed to write its part of the checkpoint "
                                      f"({err.read_text()}); the previous checkpoint stays the newest")  # fmt: skip
        missing = [r for r in missing if not (tmp / _index_name(r)).exists()]
        if not missing:
            return [json.loads((tmp / _index_name(r)).read_text()) for r in range(size)]
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{tmp}: ranks {_some([str(r) for r in missing])} wrote no index within {timeout:.0f} s; the save "
                "is given up and the previous checkpoint stays the newest (a slow file system? raise "
                "--checkpoint.commit-timeout)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _overlaps(a: Any, b: Any) -> bool:
    return all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in zip(a.offsets, a.shape, b.offsets, b.shape, strict=True))


def merge(indexes: list[dict[str, Any]], path: Path, *, step: int, extra: dict[str, Any], backend: str) -> Manifest:
    """The manifest of the checkpoint ``path`` from every rank's index; raises when ranks disagree on a
    leaf or their chunks do not tile it exactly (each element written once)."""
    files: dict[str, FileSpec] = {}
    order: list[str] = []
    specs: dict[str, LeafSpec] = {}
    chunks: dict[str, list[Any]] = {}
    for doc in indexes:
        for name, f in doc["files"].items():
            if name in files:
                raise CheckpointError(f"{path}: ranks wrote the same file {name}; each rank writes its own")
            files[name] = FileSpec(nbytes=int(f["bytes"]), sha256=str(f["sha256"]))
        for d in doc["leaves"]:
            leaf = leaf_from_json(d)
            if leaf.path not in specs:
                specs[leaf.path], chunks[leaf.path] = leaf, []
                order.append(leaf.path)
            elif (specs[leaf.path].dtype, specs[leaf.path].shape) != (leaf.dtype, leaf.shape):
                raise CheckpointError(f"{path}: rank {doc['rank']} holds {leaf.path} as {leaf.describe()}, an "
                                      f"earlier rank as {specs[leaf.path].describe()}")  # fmt: skip
            chunks[leaf.path].extend(leaf.chunks)
    leaves = []
    for p in order:
        spec, mine = specs[p], chunks[p]
        held = sum(math.prod(c.shape) for c in mine)
        # pairwise: chunks per leaf are few (its distinct blocks); beyond that the count check alone
        pairs = ((a, b) for i, a in enumerate(mine) for b in mine[i + 1 :]) if len(mine) <= 256 else ()
        clash = next(((a, b) for a, b in pairs if _overlaps(a, b)), None)
        if held != math.prod(spec.shape) or clash is not None:
            raise CheckpointError(
                f"{path}: the ranks' blocks of {p} {spec.describe()} hold {held} elements"
                + (f", {clash[0].file} and {clash[1].file} overlapping" if clash else "")
                + f" where it has {math.prod(spec.shape)}; every element must be written by exactly one rank"
            )
        leaves.append(LeafSpec(path=p, dtype=spec.dtype, shape=spec.shape, chunks=tuple(mine)))
    return Manifest(path=path, step=step, leaves=tuple(leaves), files=files, extra=extra,
                    world_size=len(indexes), backend=backend)  # fmt: skip


def commit(tmp: Path, final: Path, *, size: int, step: int, extra: dict[str, Any], backend: str,
           keep: int | None, timeout: float, stop: threading.Event | None = None) -> Path:  # fmt: skip
    """Step 3 (rank 0): wait for every rank's index, write the manifest, rename; prune to ``keep``.
    ``stop`` set: give up waiting (the run is ending on an error)."""
    manifest = merge(_wait_for_indexes(tmp, size, timeout, stop), final, step=step, extra=extra, backend=backend)
    for r in range(size):
        (tmp / _index_name(r)).unlink()
    _write_durable(tmp / MANIFEST_FILE, manifest_json(manifest))
    fsync_dir(tmp)
    _rename(tmp, final)
    if keep is not None:
        _prune(final.parent, step, keep)
    return final


def _hidden_name(final: Path, tag: str) -> Path:
    return final.parent / f"{TMP_PREFIX}{tag}{final.name}-{os.getpid()}-{secrets.token_hex(4)}"


def _rename(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():
        # a non-empty directory cannot be renamed over: move the old one aside
        # (hidden, so a crash here leaves the previous step as latest)
        old = _hidden_name(final, "old-")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(directory: Path, step: int, keep: int) -> None:
    older = [p for p in list_checkpoints(directory) if (s := step_of(p)) is not None and s <= step]
    for path in older[: max(0, len(older) - keep)]:
        shutil.rmtree(path, ignore_errors=True)


def remove_unfinished(directory: str | Path) -> list[str]:
    """Delete the hidden temp dirs of saves a crash or kill cut short; returns their names. Call it on
    one rank while no save is in flight (``ftitan train`` does, on rank 0, before training)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = sorted(p.name for p in directory.iterdir() if p.name.startswith(TMP_PREFIX) and p.is_dir())
    for name in removed:
        shutil.rmtree(directory / name, ignore_errors=True)
    return removed
