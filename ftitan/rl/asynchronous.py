"""Asynchronous rollouts: a generator thread samples the next batches while the trainer trains.

::

    source = AsyncRollouts(make, params, version=0, k=1, ledger=Ledger())   # make(params, index) -> batch
    for step in range(steps):
        batch, lag = source.get(step)          # lag = step - the params version that sampled it (<= k)
        state, metrics = rl_step(state, batch)
        source.push(state.params, version=step + 1)   # push_weights: the generator's next batch uses them
    source.close()

The generator runs ``make(params, index)`` for ``index = 0, 1, 2, ...`` with the newest pushed params
(a copy: the trainer's step writes its new state into the old one's buffers) and queues each batch with
the version of the params that made it, at most ``capacity`` (default ``k``) waiting. ``get(step)`` takes
the oldest; a batch more than ``k`` versions behind ``step`` is dropped (its ids go to the ledger's
dropped list) and the next one is taken. :class:`Ledger` accounts for every rollout id: made, trained,
dropped, or still queued; none is trained twice (a second use raises). ``paused()`` waits until no batch
is being made and yields the queue as fixed-shape tensors, which a checkpoint saves and a resumed run
restores (``queue=``), so a checkpoint loses no rollout either.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ftitan import tree

__all__ = ["AsyncRollouts", "Ledger", "ProcessRollouts"]

Batch = dict[str, torch.Tensor]  # "ids": (N,) int64 rollout ids, -1 on padding rows


class Ledger:
    """Where every rollout id went: ``made``, ``trained`` (at most once each), ``dropped`` (stale)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.made_ids: set[int] = set()
        self.trained_ids: list[int] = []
        self.dropped_ids: list[int] = []
        self.n_dropped = 0  # batches dropped as stale

    @staticmethod
    def _ids(ids: torch.Tensor) -> list[int]:
        return [i for i in ids.tolist() if i >= 0]

    def made(self, ids: torch.Tensor) -> None:
        new = self._ids(ids)
        with self._lock:
            if self.made_ids.intersection(new) or len(set(new)) != len(new):
                raise RuntimeError(f"rollout ids made twice: {sorted(self.made_ids.intersection(new))[:8]}")
            self.made_ids.update(new)

    def trained(self, ids: torch.Tensor) -> None:
        new = self._ids(ids)
        with self._lock:
            twice = set(self.trained_ids).intersection(new)
            if twice:
                raise RuntimeError(f"rollouts trained on twice: ids {sorted(twice)[:8]}")
            self.trained_ids += new

    def dropped(self, ids: torch.Tensor) -> None:
        with self._lock:
            self.dropped_ids += self._ids(ids)
            self.n_dropped += 1

    def unaccounted(self, pending: list[int]) -> set[int]:
        """Ids made but neither trained, dropped nor in ``pending`` (the queue): empty when nothing was lost."""
        with self._lock:
            return self.made_ids - set(self.trained_ids) - set(self.dropped_ids) - set(pending)


class _Source:
    """The trainer's side shared by both workers: the queue of ``(batch, version)``, ``get``, ``pending_ids``,
    ``paused`` (a worker supplies ``_pause``/``_resume``/``_taken``/``close``)."""

    worker = "generator"

    def _setup(self, *, k: int, ledger: Ledger, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
               queue: Mapping[str, Any] | None, capacity: int | None) -> None:  # fmt: skip
        if k < 1:
            raise ValueError(f"{type(self).__name__}: k={k} must be >= 1 (k = 0 is the synchronous loop)")
        self.k, self.ledger, self.spec = k, ledger, dict(spec)  # spec: each batch field's shape, dtype
        self.capacity = k if capacity is None else capacity
        self._queue: collections.deque[tuple[Batch, int]] = collections.deque()
        if queue is not None:  # a checkpoint's: its first n entries
            for j in range(int(queue["n"])):
                self._queue.append(({name: v[j].clone() for name, v in queue["batches"].items()},
                                    int(queue["versions"][j])))  # fmt: skip
        self._cv = threading.Condition()
        self._error: BaseException | str | None = None

    @staticmethod
    def empty_queue(k: int, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
        """The checkpointed queue's structure: ``{"n", "versions": (k,), "batches": {name: (k, *shape)}}``."""
        return {
            "n": torch.zeros((), dtype=torch.int64),
            "versions": torch.zeros(k, dtype=torch.int64),
            "batches": {name: torch.zeros((k, *shape), dtype=dtype) for name, (shape, dtype) in spec.items()},
        }

    def _check(self) -> None:
        """Raise the worker's error here, as its own type (a bad setting stays a ``ValueError``: one line at
        the CLI), naming the worker."""
        e = self._error
        if isinstance(e, BaseException):
            try:
                again = type(e)(f"the rollout {self.worker} failed: {e}")
            except Exception:  # noqa: BLE001 -- a type that wants other arguments
                again = RuntimeError(f"the rollout {self.worker} failed: {type(e).__name__}: {e}")
            raise again from e
        if e is not None:
            raise RuntimeError(f"the rollout {self.worker} failed: {e}")

    def _taken(self) -> None:
        """A batch left the queue (under ``_cv``)."""

    def get(self, step: int) -> tuple[Batch, int]:
        """The oldest batch at most ``k`` versions behind ``step``, and its lag; staler ones are dropped."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._error is not None)
                if not self._queue:
                    self._check()
                batch, version = self._queue.popleft()
                self._taken()
                self._cv.notify_all()
            lag = step - version
            if lag <= self.k:
                return batch, lag
            self.ledger.dropped(batch["ids"])

    def pending_ids(self) -> list[int]:
        with self._cv:
            return [i for b, _ in self._queue for i in b["ids"].tolist() if i >= 0]

    def _pause(self) -> int:
        """Stop making batches; wait until none is in flight; return the next batch index (under ``_cv``)."""
        raise NotImplementedError

    def _resume(self) -> None:
        """Make batches again (under ``_cv``)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def paused(self) -> Iterator[tuple[dict[str, Any], int]]:
        """No batch is made inside: yields ``(queue, next_index)`` (the queue as :meth:`empty_queue`'s
        structure for ``capacity`` entries) for a checkpoint."""
        with self._cv:
            next_index = self._pause()
            self._check()
            entries = list(self._queue)
        try:
            queue = self.empty_queue(self.capacity, self.spec)
            queue["n"].fill_(len(entries))
            for j, (b, version) in enumerate(entries):
                queue["versions"][j] = version
                for name, v in b.items():
                    queue["batches"][name][j] = v
            yield queue, next_index
        finally:
            with self._cv:
                self._resume()
                self._cv.notify_all()

    def __enter__(self) -> _Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class AsyncRollouts(_Source):
    """The generator thread and its queue (see the module docstring)."""

    worker = "generator thread"

    def __init__(self, make: Callable[[Any, int], Batch], params: Any, *, version: int, k: int, ledger: Ledger,
                 spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]], next_index: int = 0,
                 queue: Mapping[str, Any] | None = None, capacity: int | None = None,
                 threads: int | None = None) -> None:  # fmt: skip
        self._setup(k=k, ledger=ledger, spec=spec, queue=queue, capacity=capacity)
        self._make = make
        self.threads = threads  # the generator thread's intra-op threads (None: torch's default)
        self._params, self._version, self._next = tree.map(torch.clone, params), version, next_index
        self._paused = self._busy = self._closed = False
        self._thread = threading.Thread(target=self._run, name="ftitan-rollouts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self.threads is not None:
                torch.set_num_threads(self.threads)
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._closed or (not self._paused and len(self._queue) < self.capacity))
                    if self._closed:
                        return
                    params, version, index = self._params, self._version, self._next
                    self._next += 1
                    self._busy = True
                batch = self._make(params, index)
                self.ledger.made(batch["ids"])
                with self._cv:
                    self._queue.append((batch, version))
                    self._busy = False
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 -- handed to the trainer, which raises it
            with self._cv:
                self._error, self._busy = e, False
                self._cv.notify_all()

    def push(self, params: Any, *, version: int) -> None:
        """The trainer's params after ``version`` updates: the generator samples its next batch from a copy."""
        copy = tree.map(torch.clone, params)
        with self._cv:
            self._params, self._version = copy, version
        self._check()

    def _pause(self) -> int:
        self._paused = True
        self._cv.wait_for(lambda: not self._busy)
        return self._next

    def _resume(self) -> None:
        self._paused = False

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=600)


class ProcessRollouts(_Source):
    """The generator in a separate process (the layout of a cluster, where it owns its own devices or vLLM
    engine), with :class:`AsyncRollouts`'s interface and guarantees.

    ``factory()`` (picklable: e.g. a ``functools.partial`` of a module-level function) runs once in the
    spawned child and returns its ``make(params, index) -> batch``. ``push`` copies the trainer's params
    into one shared-memory tree under a lock; the child copies them out before each batch, so a batch is
    made from one version whole. Batches return through a queue; a receiver thread here files them (and
    their ids in the ledger) and hands the child one credit per batch taken, so at most ``capacity`` are
    made ahead. ``paused()`` asks the child to stop and waits for its answer, which follows every batch it
    made; ``close()`` drains the same way, then ends the child. A child that raises or dies is an error
    the trainer's next ``get``/``push`` raises, naming the child's traceback or exit code."""

    worker = "generator process"

    def __init__(self, factory: Callable[[], Callable[[Any, int], Batch]], params: Any, *, version: int, k: int,
                 ledger: Ledger, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]], next_index: int = 0,
                 queue: Mapping[str, Any] | None = None, capacity: int | None = None,
                 threads: int | None = None, start_timeout: float = 600.0) -> None:  # fmt: skip
        import torch.multiprocessing as mp

        self._setup(k=k, ledger=ledger, spec=spec, queue=queue, capacity=capacity)
        ctx = mp.get_context("spawn")
        self._shared = tree.map(lambda t: t.detach().to("cpu", copy=True).share_memory_(), params)
        self._lock, self._version = ctx.Lock(), ctx.Value("q", version, lock=False)
        self._cmd, self._out = ctx.Queue(), ctx.Queue()
        self._paused_at: int | None = None
        self._closed = False
        credits = self.capacity - len(self._queue)
        self._proc = ctx.Process(target=_worker, name="ftitan-rollouts", daemon=True,
                                 args=(factory, self._shared, self._lock, self._version, self._cmd, self._out,
                                       threads, next_index, max(0, credits)))  # fmt: skip
        self._proc.start()
        self._receiver = threading.Thread(target=self._receive, name="ftitan-rollouts-receiver", daemon=True)
        self._receiver.start()

    def _receive(self) -> None:
        import queue as q

        while True:
            try:
                msg = self._out.get(timeout=0.5)
            except q.Empty:
                if not self._proc.is_alive():
                    with self._cv:
                        if self._error is None and not self._closed:
                            self._error = f"the process exited with code {self._proc.exitcode} before its batches"
                        self._closed = True
                        self._cv.notify_all()
                    return
                continue
            with self._cv:
                if msg[0] == "batch":
                    batch = {name: v.clone() for name, v in msg[1].items()}  # out of shared memory: its fd closes
                    try:
                        self.ledger.made(batch["ids"])
                    except RuntimeError as e:
                        self._error = e
                    self._queue.append((batch, msg[2]))
                elif msg[0] == "paused":
                    self._paused_at = msg[1]
                elif msg[0] == "error":  # the child's exception (if it pickled), and its traceback
                    exc, tb = msg[1], msg[2]
                    if exc is None:
                        exc = RuntimeError(tb.strip().splitlines()[-1])
                    exc.add_note(f"(the generator process's traceback)\n{tb}")
                    self._error = exc
                elif msg[0] == "closed":
                    self._closed = True
                del msg
                self._cv.notify_all()
                if self._closed or self._error is not None:
                    return

    def _taken(self) -> None:
        if not self._closed:
            self._cmd.put("credit")

    def push(self, params: Any, *, version: int) -> None:
        """The trainer's params after ``version`` updates, into the shared tree the child reads."""
        with self._lock:
            tree.map(lambda s, p: s.copy_(p.detach()), self._shared, params)
            self._version.value = version
        with self._cv:
            self._check()

    def _pause(self) -> int:
        if self._closed:  # drained at close (or failed: paused() raises): nothing is in flight
            return self._paused_at if self._paused_at is not None else -1
        self._paused_at = None
        self._cmd.put("pause")
        self._cv.wait_for(lambda: self._paused_at is not None or self._error is not None)
        return self._paused_at if self._paused_at is not None else -1

    def _resume(self) -> None:
        if not self._closed:
            self._cmd.put("resume")

    def close(self) -> None:
        """Drain (every batch the child made is queued here, see ``pending_ids``), then end the child."""
        with self._cv:
            if not self._closed and self._proc.is_alive():
                self._cmd.put("pause")
                self._cv.wait_for(lambda: self._paused_at is not None or self._error is not None or self._closed,
                                  timeout=600)  # fmt: skip
                self._cmd.put("close")
        self._receiver.join(timeout=600)
        self._cmd.cancel_join_thread()  # a child that died reads nothing more: exiting must not wait on it
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        with self._cv:
            self._closed = True


def _worker(factory: Callable[[], Callable[[Any, int], Batch]], shared: Any, lock: Any, version: Any, cmd: Any,
            out: Any, threads: int | None, next_index: int, credits: int) -> None:  # fmt: skip
    """The child of :class:`ProcessRollouts`: make batches while it has credits, answer pause/resume/close."""
    import queue as q
    import traceback

    try:
        if threads is not None:
            torch.set_num_threads(threads)
        make = factory()
        local, seen = tree.map(torch.clone, shared), None
        paused = False
        while True:
            try:
                msg = cmd.get(block=paused or credits == 0)
            except q.Empty:
                msg = None
            if msg == "close":
                out.put(("closed",))
                return
            if msg == "pause":
                paused = True
                out.put(("paused", next_index))  # after every batch made: the trainer has them all
            elif msg == "resume":
                paused = False
            elif msg == "credit":
                credits += 1
            if msg is not None:
                continue
            with lock:
                v = int(version.value)
                if v != seen:
                    tree.map(lambda a, b: a.copy_(b), local, shared)
                    seen = v
            batch = make(local, next_index)
            next_index, credits = next_index + 1, credits - 1
            out.put(("batch", batch, v))
    except BaseException as e:  # noqa: BLE001 -- handed to the trainer, which raises it
        import pickle

        try:
            pickle.loads(pickle.dumps(e))
        except Exception:  # noqa: BLE001 -- then its traceback's last line stands for it
            e = None  # type: ignore[assignment]
        out.put(("error", e, traceback.format_exc(limit=-8)))
