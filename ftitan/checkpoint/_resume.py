"""Resuming: the newest checkpoint every rank can read, agreed on by all ranks.

Each rank loads only its own blocks and verifies only the files it reads,
so one rank may find a damaged file another never opens. After each
attempt the ranks exchange what they found (the one collective); if any
rank failed, all of them fall back to the previous checkpoint, with a
warning naming the culprit. A checkpoint that does not fit the tree at all
(another model or optimizer) stops the resume on every rank. When
checkpoints exist but none is valid, one error lists each and why: a
resume never silently starts over from step 0.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ftitan.checkpoint._commit import patient_group, world
from ftitan.checkpoint._layout import list_checkpoints
from ftitan.checkpoint._load import load
from ftitan.checkpoint._manifest import CheckpointError, CorruptCheckpointError, Manifest

__all__ = ["resume_newest"]

LOAD_TIMEOUT_S = 3600.0  # how long a rank that loaded its blocks waits for the slowest one


def _attempt(path: Path, like: Any, whole: Any, into: bool) -> tuple[Any, Manifest | None, tuple[str, str] | None]:
    try:
        restored, manifest = load(path, like, whole=whole, into=into)  # verifies the files this rank reads
        return restored, manifest, None
    except CorruptCheckpointError as e:
        return None, None, ("corrupt", str(e))
    except CheckpointError as e:
        return None, None, ("mismatch", str(e))
    except OSError as e:  # a file vanished or cannot be read: as good as corrupt
        return None, None, ("corrupt", f"{type(e).__name__}: {e}")


def _everyone(found: tuple[str, str] | None, group: Any) -> list[tuple[str, str] | None]:
    if group is None:
        return [found]
    out: list[Any] = [None] * world()[1]
    dist.all_gather_object(out, found, group=group)
    return out


def _on_rank(rank: int, message: str) -> str:
    return f"{message} (rank {rank})" if world()[1] > 1 else message


def resume_newest(directory: Path, like: Any, *, whole: Any = None, into: bool = False) -> tuple[Any, Manifest] | None:
    """``(tree, manifest)`` from the newest checkpoint under ``directory`` that loads on every rank;
    ``None`` when there is none at all. Collective under a process group. Raises
    :class:`CheckpointError` when checkpoints exist but none loads (listing each and why), or when the
    newest readable one does not fit ``like`` (see :func:`ftitan.checkpoint.load`, also for ``into``)."""
    tried: list[str] = []
    candidates = [p.name for p in list_checkpoints(directory)]
    group = patient_group(LOAD_TIMEOUT_S) if world()[1] > 1 else None
    if group is not None:  # rank 0's listing: every rank tries the same checkpoints in the same order
        listings: list[Any] = [None] * world()[1]
        dist.all_gather_object(listings, candidates, group=group)
        candidates = listings[0]
    for path in (directory / name for name in reversed(candidates)):
        restored, manifest, found = _attempt(path, like, whole, into)  # into: a fallback overwrites it all again
        failed = [(r, f) for r, f in enumerate(_everyone(found, group)) if f is not None]
        if not failed:
            assert manifest is not None
            return restored, manifest
        mismatch = [(r, msg) for r, (kind, msg) in failed if kind == "mismatch"]
        if mismatch:
            raise CheckpointError(_on_rank(*mismatch[0]))
        r, (_, msg) = failed[0]
        warnings.warn(f"skipping checkpoint {path.name}: {_on_rank(r, msg)}", stacklevel=3)
        tried.append(f"{path.name}: {_on_rank(r, msg)}")
    if tried:
        raise CorruptCheckpointError(
            f"{directory}: {len(tried)} checkpoint(s), none of which loads — " + "; ".join(tried)
            + ". Restore one of them from a copy, or start over (--overwrite deletes them)"
        )
    return None
