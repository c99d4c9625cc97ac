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

__all__ = ["AsyncRollouts", "Ledger"]

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


class AsyncRollouts:
    """The generator thread and its queue (see the module docstring)."""

    def __init__(self, make: Callable[[Any, int], Batch], params: Any, *, version: int, k: int, ledger: Ledger,
                 spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]], next_index: int = 0,
                 queue: Mapping[str, Any] | None = None, capacity: int | None = None,
                 threads: int | None = None) -> None:  # fmt: skip
        if k < 1:
            raise ValueError(f"AsyncRollouts: k={k} must be >= 1 (k = 0 is the synchronous loop)")
        self._make, self.k, self.ledger, self.spec = make, k, ledger, dict(spec)  # spec: each batch field's shape, dtype
        self.capacity = k if capacity is None else capacity
        self.threads = threads  # the generator thread's intra-op threads (None: torch's default)
        self._params, self._version, self._next = tree.map(torch.clone, params), version, next_index
        self._queue: collections.deque[tuple[Batch, int]] = collections.deque()
        if queue is not None:  # a checkpoint's: its first n entries
            for j in range(int(queue["n"])):
                self._queue.append(({name: v[j].clone() for name, v in queue["batches"].items()},
                                    int(queue["versions"][j])))  # fmt: skip
        self._cv = threading.Condition()
        self._paused = self._busy = self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ftitan-rollouts", daemon=True)
        self._thread.start()

    @staticmethod
    def empty_queue(k: int, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
        """The checkpointed queue's structure: ``{"n", "versions": (k,), "batches": {name: (k, *shape)}}``."""
        return {
            "n": torch.zeros((), dtype=torch.int64),
            "versions": torch.zeros(k, dtype=torch.int64),
            "batches": {name: torch.zeros((k, *shape), dtype=dtype) for name, (shape, dtype) in spec.items()},
        }

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

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout generator thread failed: {self._error}") from self._error

    def get(self, step: int) -> tuple[Batch, int]:
        """The oldest batch at most ``k`` versions behind ``step``, and its lag; staler ones are dropped."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._error is not None)
                if not self._queue:
                    self._check()
                batch, version = self._queue.popleft()
                self._cv.notify_all()
            lag = step - version
            if lag <= self.k:
                return batch, lag
            self.ledger.dropped(batch["ids"])

    def push(self, params: Any, *, version: int) -> None:
        """The trainer's params after ``version`` updates: the generator samples its next batch from a copy."""
        copy = tree.map(torch.clone, params)
        with self._cv:
            self._params, self._version = copy, version
        self._check()

    def pending_ids(self) -> list[int]:
        with self._cv:
            return [i for b, _ in self._queue for i in b["ids"].tolist() if i >= 0]

    @contextlib.contextmanager
    def paused(self) -> Iterator[tuple[dict[str, Any], int]]:
        """No batch is made inside: yields ``(queue, next_index)`` (the queue as :meth:`empty_queue`'s
        structure for ``capacity`` entries) for a checkpoint."""
        with self._cv:
            self._paused = True
            self._cv.wait_for(lambda: not self._busy)
            self._check()
            entries, next_index = list(self._queue), self._next
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
                self._paused = False
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=600)
