"""Batches made ahead of the step by a background thread, and the loader's own throughput.

:class:`Prefetcher` runs a :class:`~ftitan.data.stream.Stream` in a daemon
thread that keeps up to ``depth`` ready batches in a queue. Reading and
tokenizing overlap the training step: the Rust tokenizer and Arrow release the
GIL, and the step itself spends its time in torch kernels. Its ``state`` is the
stream position after the last batch *handed out*, not after the worker's
read-ahead, so it is what a checkpoint saves. A worker exception is re-raised
by ``next()`` in the caller (same exception, same message).

Example::

    with prefetch(stream_batches(src, tok, state, seq_len=256, batch_size=8)) as batches:
        for step in range(100):
            batch = next(batches)
        saved = batches.state    # resume: stream_batches(src, tok, saved, ...)
"""

from __future__ import annotations

import queue
import threading
import time
from types import TracebackType
from typing import NamedTuple

from ftitan.data.loader import Batch
from ftitan.data.sources import Source
from ftitan.data.stream import Stream, StreamState, init_stream_state, stream_batches
from ftitan.data.tokenizer import Tokenizer

__all__ = ["Prefetcher", "loader_throughput", "prefetch"]

_POLL_S = 0.1  # how often a blocked worker or reader checks for close() / a dead thread


class _Failed(NamedTuple):
    error: BaseException


class _End(NamedTuple):
    pass


class Prefetcher:
    """An iterator of ``stream``'s batches, made ahead by a daemon thread (``depth`` batches at most).

    ``state``: the stream position after the last batch ``next()`` returned. ``close()`` (or leaving a
    ``with`` block) stops the thread; it is a daemon, so an unclosed one never blocks interpreter exit.
    """

    def __init__(self, stream: Stream, *, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"prefetch: depth must be >= 1, got {depth}")
        self._stream, self._state = stream, stream.state
        self._ready: queue.Queue[tuple[Batch, StreamState] | _Failed | _End] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="ftitan-data-prefetch", daemon=True)
        self._thread.start()

    @property
    def state(self) -> StreamState:
        return self._state

    def _put(self, item: tuple[Batch, StreamState] | _Failed | _End) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                batch = next(self._stream)
                self._put((batch, self._stream.state))
        except StopIteration:
            self._put(_End())
        except BaseException as e:  # handed to the caller, who re-raises it
            self._put(_Failed(e))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Batch:
        if self._stop.is_set():
            raise RuntimeError("prefetch: next() after close()")
        while True:
            try:
                item = self._ready.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    raise RuntimeError("prefetch: the worker thread stopped without a batch or an error") from None
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        batch, self._state = item
        return batch

    def close(self) -> None:
        """Stop the worker and drop the batches it made ahead (``state`` stays where the caller is)."""
        self._stop.set()
        while True:  # unblock a worker waiting on a full queue
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * _POLL_S + 5)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def prefetch(stream: Stream, *, depth: int = 2) -> Prefetcher:
    """``stream`` made ``depth`` batches ahead in a background thread (see :class:`Prefetcher`)."""
    return Prefetcher(stream, depth=depth)


def loader_throughput(source: Source, tokenizer: Tokenizer, *, seq_len: int, batch_size: int, batches: int = 20,
                      dp_rank: int = 0, dp_size: int = 1, eval_fraction: float = 0.02,
                      seed: int = 0) -> dict[str, float]:
    """The loader's own speed: tokens (``rows * seq_len``) per second this rank's stream produces.

    One warm-up batch (it also settles the held-out split) is not timed; then ``batches`` batches are,
    synchronously (no prefetch: this is what a prefetch worker has to keep ahead of). Returns
    ``{"tokens_per_s", "seconds", "batches", "tokens"}``.
    """
    stream = stream_batches(source, tokenizer, init_stream_state(seed, batch_size), seq_len=seq_len,
                            batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size,
                            eval_fraction=eval_fraction)  # fmt: skip
    next(stream)
    start = time.perf_counter()
    tokens = 0
    for _ in range(batches):
        tokens += next(stream)["inputs"].numel()
    seconds = time.perf_counter() - start
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "batches": float(batches), "tokens": float(tokens)}
