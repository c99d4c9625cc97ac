"""``save``: one synchronous sharded save, committed when it returns.

Each rank writes its own blocks (:mod:`ftitan.checkpoint._shards`) into a
hidden temp dir and rank 0 renames it into place once every rank's part is
there (:mod:`ftitan.checkpoint._commit`): a crash at any moment leaves the
new checkpoint whole or absent, never half of it. For saves that let
training go on while they write, use :class:`~ftitan.checkpoint.Checkpointer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftitan.checkpoint._checkpointer import Checkpointer

__all__ = ["save"]


def save(
    directory: str | Path,
    step: int,
    tree: Any,
    *,
    extra: dict[str, Any] | None = None,
    keep: int | None = None,
    backend: str = "sync",
) -> Path:
    """Writes ``tree`` as the checkpoint ``directory/step_{step:08d}/`` and returns its path.

    Every leaf must be a tensor: a ``DTensor`` (each rank writes its own block, a replicated block
    once) or a plain tensor (written by rank 0). Leaves are keyed by their dotted path
    (``ftitan.tree.paths``), so a ``TrainState`` round-trips bit-exactly. ``extra`` is JSON metadata
    kept in ``manifest.json`` (the run's config, a git commit, ...); tensor state such as
    ``ftitan.data.LoaderState`` belongs in ``tree`` itself. An existing checkpoint of the same step
    is replaced. Collective when ``torch.distributed`` is initialized: every rank calls it.

    ``keep=K`` then deletes older checkpoints so that the K newest with a step up to ``step`` remain
    (this one included); checkpoints of later steps, left by a run this one restarted behind, are
    not touched. ``backend``: the writer (``"sync"``, ``"torch-checkpointing"``, ``"dcp"``); the call
    returns once the checkpoint is committed either way.

    >>> save("ckpt", int(state.step), state, extra={"config": attrs.asdict(cfg)}, keep=3)
    """
    with Checkpointer(directory, backend=backend, keep=keep) as checkpointer:
        return checkpointer.save(step, tree, extra=extra)
