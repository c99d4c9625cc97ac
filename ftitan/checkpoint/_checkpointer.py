"""``Checkpointer``: sharded saves that block the training loop only while this rank's blocks are staged.

One per process. ``save(step, tree)`` waits for the previous save, plans
this rank's blocks (:mod:`ftitan.checkpoint._shards`), joins the one
collective of a save (:func:`~ftitan.checkpoint._commit.begin`, in the
caller's thread), hands the blocks to the writer (which stages them) and
returns; a worker thread then waits for the file, fsyncs and hashes it,
writes this rank's index and, on rank 0, commits
(:mod:`ftitan.checkpoint._commit`: file-system only, no collectives off the
main thread). ``finish()`` (collective) returns once every rank's last save
is committed, raising on every rank if any part failed; ``close()`` finishes
and stops the writer.

>>> with Checkpointer("runs/a/checkpoints", backend="torch-checkpointing", keep=3) as ckpt:  # doctest: +SKIP
...     for step in range(1, steps + 1):
...         state, _ = train_step(state, batch)
...         if step % 100 == 0:
...             ckpt.save(step, {"state": state, "loader": loader_state})  # stages, then training goes on
"""

from __future__ import annotations

import functools
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch.distributed as dist

from ftitan.checkpoint._backends import make_writer
from ftitan.checkpoint._commit import (
    begin,
    commit,
    fsync_dir,
    fsync_file,
    patient_group,
    rank_file,
    world,
    write_error,
    write_index,
)
from ftitan.checkpoint._layout import checkpoint_dirname
from ftitan.checkpoint._manifest import CheckpointError, LeafSpec, file_spec
from ftitan.checkpoint._shards import SavePlan, plan_save
from ftitan.checkpoint._validate import check_json, check_keep, check_step

__all__ = ["Checkpointer"]


def _in_file(plan: SavePlan, names: list[str]) -> tuple[LeafSpec, ...]:
    """The plan's chunks pointed at the one file the writer wrote (``dcp`` picks its own name)."""
    if len(names) > 1:
        raise CheckpointError(f"checkpoint writer wrote {names}; ftitan expects one tensor file per rank")
    if not names or all(c.file == names[0] for leaf in plan.leaves for c in leaf.chunks):
        return plan.leaves
    return tuple(attrs.evolve(leaf, chunks=tuple(attrs.evolve(c, file=names[0]) for c in leaf.chunks))
                 for leaf in plan.leaves)  # fmt: skip


class Checkpointer:
    """Saves trees as sharded checkpoints under ``directory`` (see the module docstring).

    ``backend``: ``"torch-checkpointing"`` (async: shared-memory staging, writer subprocess),
    ``"dcp"`` (async: ``torch.distributed.checkpoint``'s safetensors writer in a thread) or
    ``"sync"`` (written before ``save`` returns). ``keep``: the newest K checkpoints remain after
    each commit. ``extra``: JSON metadata stored in every manifest (``save(extra=...)`` adds to it).
    ``commit_timeout``: seconds rank 0 waits for the other ranks' files before giving a save up.
    ``subprocess_min_bytes``: torch-checkpointing starts its writer subprocess with the first save of
    at least this many bytes on a rank (smaller ones: a staged copy written from a thread; 0: always).
    Collective under a process group: every rank constructs one and calls ``save`` and ``finish``.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        backend: str = "torch-checkpointing",
        keep: int | None = None,
        extra: dict[str, Any] | None = None,
        commit_timeout: float = 600.0,
        subprocess_min_bytes: int = 64 << 20,
    ) -> None:
        self.directory = Path(directory)
        self.keep = check_keep(keep)
        self.extra = dict(extra or {})
        check_json("extra", self.extra)
        if not commit_timeout > 0:
            raise ValueError(f"commit_timeout={commit_timeout!r}: expected seconds > 0")
        self.commit_timeout = float(commit_timeout)
        self.rank, self.size = world()
        # waits on rank 0's commit of the previous save: longer than a training collective may
        self._group = patient_group(self.commit_timeout + 60) if self.size > 1 else None
        self._writer = make_writer(backend, rank=self.rank, subprocess_min_bytes=subprocess_min_bytes)
        self.backend = backend
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ftitan-ckpt") if backend != "sync" else None
        self._pending: Future[Path] | None = None
        self._closed = False
        self._stop = threading.Event()  # set by abort(): rank 0 stops waiting for the other ranks' files

    def save(self, step: int, tree: Any, *, extra: dict[str, Any] | None = None) -> Path:
        """Start saving ``tree`` as ``directory/step_{step:08d}``; returns that path (committed once
        :meth:`wait` on rank 0, or :meth:`finish` everywhere, returns). Blocks until this rank's blocks
        are staged (and, first, until the previous save's own part is done). The ``"sync"`` backend
        returns on every rank once the checkpoint is committed (a :meth:`finish`), raising everywhere
        if any rank's part failed."""
        if self._closed:
            raise RuntimeError(f"Checkpointer({str(self.directory)!r}) is closed; make a new one to save again")
        step = check_step(step)
        meta = {**self.extra, **(extra or {})}
        check_json("extra", meta)
        self.wait()
        plan = plan_save(tree, rank=self.rank, file=rank_file(self.rank))
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = begin(self.directory, step, plan.plain, self._group)  # collective
        final = self.directory / checkpoint_dirname(step)
        try:
            done = self._writer.write(tmp, self.rank, plan.tensors)
        except BaseException as e:
            self._abandon(tmp, e)
            raise
        job = functools.partial(self._complete, tmp, final, step, plan, done, meta)
        if self._worker is not None:
            self._pending = self._worker.submit(job)
        elif self.size == 1:
            job()
        else:  # "sync": every rank returns once rank 0 has committed (a rank that died right after its own
            # write, before rank 0's rename, lost that checkpoint when its launcher stopped rank 0)
            self._pending = Future()
            try:
                self._pending.set_result(job())
            except Exception as e:  # noqa: BLE001 - raised on every rank by finish()
                self._pending.set_exception(e)
            self.finish()
        return final

    def _complete(self, tmp: Path, final: Path, step: int, plan: SavePlan, done: Any, extra: dict[str, Any]) -> Path:
        try:
            names = done()
            for name in names:
                fsync_file(tmp / name)
            for sub in {(tmp / n).parent for n in names} - {tmp}:
                fsync_dir(sub)
            files = {name: file_spec(tmp / name) for name in names}
            write_index(tmp, rank=self.rank, size=self.size, step=step, files=files, leaves=_in_file(plan, names))
            if self.rank == 0:
                commit(tmp, final, size=self.size, step=step, extra=extra, backend=self.backend, keep=self.keep,
                       timeout=self.commit_timeout, stop=self._stop)  # fmt: skip
        except BaseException as e:
            self._abandon(tmp, e)
            raise
        return final

    def _abandon(self, tmp: Path, error: BaseException) -> None:
        if self.size == 1:
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # the other ranks may still write there: rank 0 gives up on seeing the marker
            write_error(tmp, self.rank, error)

    def wait(self) -> None:
        """Block until this rank's part of the last save is written (on rank 0: committed); raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def finish(self) -> None:
        """Collective: every rank's last save is committed when it returns; an error on any rank raises
        on every rank (the failing rank's own exception there, a :class:`CheckpointError` elsewhere)."""
        error: BaseException | None = None
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = e
        if self.size > 1:
            everyone: list[Any] = [None] * self.size
            dist.all_gather_object(everyone, None if error is None else f"{type(error).__name__}: {error}",
                                   group=self._group)  # fmt: skip
            failed = [(r, msg) for r, msg in enumerate(everyone) if msg is not None]
            if failed and error is None:
                r, msg = failed[0]
                raise CheckpointError(f"checkpoint under {self.directory}: rank {r} failed ({msg})")
        if error is not None:
            raise error

    def close(self) -> None:
        """:meth:`finish`, then stop the writer (its subprocess or thread)."""
        if self._closed:
            return
        try:
            self.finish()
        finally:
            self._closed = True
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            self._writer.close()

    def abort(self) -> None:
        """The run is ending on an error (a dead peer, a non-finite stop): not collective, never waits on
        other ranks. One process finishes its last save (nothing else can be missing from it); under a
        process group the save in flight is given up (rank 0 stops waiting for the others' files, the
        previous checkpoint stays the newest), so the process can exit at once."""
        if self._closed:
            return
        self._closed = True
        if self.size == 1:
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - the error that ends the run is the one to report
                pass
        self._stop.set()
        if self._worker is not None:
            self._worker.shutdown(wait=self.size == 1, cancel_futures=True)
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
