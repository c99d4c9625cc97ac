"""Held-out data: which documents a stream trains on and which it holds out, and the held-out rows.

With ``0 < eval_fraction < 1`` a document is held out when a hash of its text
(BLAKE2b, so the same on every machine and process) falls in the lowest
``eval_fraction`` of 10,000 buckets: the split does not depend on file names,
shard order or the number of ranks, and duplicated documents land on the same
side, so exact copies never leak from train into eval. When that leaves no
training document, or held-out documents too short for one row of ``seq_len + 1``
tokens (a corpus of one or a few documents), the split falls back to tokens:
the last ``max(ceil(eval_fraction * N), seq_len + 1)`` of the ``N`` tokens of
the corpus packed in file order are held out (one document may then train on
its head and be evaluated on its tail), so a single-document corpus still
trains and still has a held-out row.

``eval_fraction=0`` trains on everything (use it with a separate eval source);
``eval_fraction=1`` holds out everything (that eval source's own setting).

Held-out rows are the held-out documents in file order (unshuffled), packed as
in training and cut into rows of ``seq_len + 1``; :func:`held_out_batches`
serves each row once.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterator
from typing import Literal

import attrs

from ftitan.data.lanes import Doc, Lane, Row, encode_docs, rows_to_batch
from ftitan.data.loader import Batch
from ftitan.data.sources import Source
from ftitan.data.tokenizer import Tokenizer

__all__ = ["HeldOut", "held_out", "held_out_batches"]

_BUCKETS = 10_000
_ENCODE_CHUNK = 64  # documents per encode_batch call while counting or serving held-out tokens


def _bucket(text: str) -> int:
    # blake2b, not hash(): Python's str hash is salted per process; surrogatepass: JSON may hold lone surrogates
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _BUCKETS


@attrs.frozen
class HeldOut:
    """The split of a source: ``mode`` "none" (all train), "all" (all held out), "hash" or "tail"."""

    mode: Literal["none", "all", "hash", "tail"]
    threshold: int = 0  # hash: held out when _bucket(text) < threshold
    cut: tuple[int, int, int] = (0, 0, 0)  # tail: (chunk, record, packed tokens of that record that train)

    def part(self, chunk: int, record: int, text: str, *, train: bool) -> tuple[int, int | None] | None:
        """The slice of the packed document at ``(chunk, record)`` in the train (or held-out) split, or None.

        ``chunk`` is the index in ``source.chunks`` (file order, not a place in an epoch's shuffled order).
        """
        if self.mode == "none" or self.mode == "all":
            return (0, None) if (self.mode == "none") == train else None
        if self.mode == "hash":
            return (0, None) if (_bucket(text) >= self.threshold) == train else None
        at, keep = (chunk, record), self.cut[2]
        if at != self.cut[:2]:
            return (0, None) if (at < self.cut[:2]) == train else None
        if train:
            return (0, keep) if keep > 0 else None
        return (keep, None)


@functools.lru_cache(maxsize=8)
def held_out(source: Source, tokenizer: Tokenizer, *, seq_len: int, eval_fraction: float) -> HeldOut:
    """The split for ``source`` (see the module docstring). Cached: a stream and its eval share one.

    The hash split scans documents only until it has seen a training document
    and held-out documents of at least one row (``seq_len + 1`` packed tokens;
    a few dozen documents on a real corpus, only the held-out ones encoded); the
    token fallback encodes the whole (small) corpus once to count its tokens.
    """
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    if eval_fraction == 0.0:
        return HeldOut("none")
    if eval_fraction == 1.0:
        return HeldOut("all")
    threshold = round(eval_fraction * _BUCKETS)
    extra = 1 + (tokenizer.bos_id is not None)  # BOS and EOS around every packed document
    trains, held = False, 0  # a training document seen; held-out packed tokens seen
    for text in source.documents():
        if _bucket(text) >= threshold:
            trains = True
        else:
            held += len(tokenizer.encode(text)) + extra
        if trains and held >= seq_len + 1:
            return HeldOut("hash", threshold=threshold)
    # too few documents for a held-out row (none on one side, or a few short ones): split by tokens
    return _tail_split(source, tokenizer, seq_len, eval_fraction)


def _tail_split(source: Source, tokenizer: Tokenizer, seq_len: int, eval_fraction: float) -> HeldOut:
    extra = 1 + (tokenizer.bos_id is not None)  # BOS and EOS around every packed document
    sizes: list[tuple[int, int, int]] = []  # (chunk, record, packed tokens)
    for chunk in range(source.num_chunks):
        texts = list(source.records(chunk))  # a small corpus: this split is only used when few documents exist
        for start in range(0, len(texts), _ENCODE_CHUNK):
            ids = tokenizer.encode_batch(texts[start : start + _ENCODE_CHUNK])
            sizes.extend((chunk, start + i, len(x) + extra) for i, x in enumerate(ids))
    total = sum(n for *_, n in sizes)
    held = max(math.ceil(eval_fraction * total), seq_len + 1)
    cut = total - held
    if cut < seq_len + 1:
        raise ValueError(
            f"shards {[str(f) for f in source.files[:3]]}{'...' if len(source.files) > 3 else ''}: "
            f"{total} tokens in all, too few for a held-out tail of {held} and one training row of "
            f"seq_len + 1 = {seq_len + 1}; use more text, a smaller seq_len (--data.seq-len), or a separate eval "
            f"source (eval_fraction=0 for training)"
        )
    start = 0
    for chunk, record, n in sizes:
        if start + n > cut:
            return HeldOut("tail", cut=(chunk, record, cut - start))
        start += n
    raise AssertionError("unreachable: cut < total")


def _held_out_docs(source: Source, split: HeldOut) -> Iterator[Doc]:
    """The held-out documents in file order."""
    for chunk in range(source.num_chunks):
        for record, text in enumerate(source.records(chunk)):
            part = split.part(chunk, record, text, train=False)
            if part is not None:
                yield Doc(chunk, record, text, part)


def held_out_batches(source: Source, tokenizer: Tokenizer, *, seq_len: int, batch_size: int,
                     eval_fraction: float = 0.02, dp_rank: int = 0, dp_size: int = 1,
                     segments: bool = False) -> Iterator[Batch]:
    """Every held-out row once, unshuffled: global batches of ``batch_size`` rows, this rank's slice of each.

    Yields ``{"inputs": (b, T), "targets": (b, T)}`` int64 (plus ``segment_ids`` / ``positions`` with
    ``segments``), ``b = batch_size / dp_size``; the last global batch may be smaller (with ``dp_size > 1``
    it is cut to a multiple of ``dp_size`` rows, dropping at most ``dp_size - 1``). Lazy: taking the
    first few batches reads only as much of the source as they need. For an explicit eval source pass
    ``eval_fraction=1.0``. Raises ValueError when the held-out documents do not fill one row.
    """
    _check_dp(batch_size, dp_rank, dp_size, seq_len)
    split = held_out(source, tokenizer, seq_len=seq_len, eval_fraction=eval_fraction)
    docs = _held_out_docs(source, split)
    lane = Lane(index=0, chunk=0, record=0, offset=0)

    def more(lane: Lane) -> bool:
        chunk = [d for _, d in zip(range(_ENCODE_CHUNK), docs, strict=False)]
        encode_docs(chunk, tokenizer)
        lane.queue.extend(chunk)
        return bool(chunk)

    def rank_slice(rows: list[Row]) -> Batch:
        n = len(rows)
        return rows_to_batch(rows[dp_rank * n // dp_size : (dp_rank + 1) * n // dp_size])

    rows: list[Row] = []
    served = False
    while (row := lane.fill(seq_len + 1, more, segments=segments)) is not None:
        rows.append(row)
        if len(rows) == batch_size:
            yield rank_slice(rows)
            rows, served = [], True
    rows = rows[: len(rows) // dp_size * dp_size]
    if rows:
        yield rank_slice(rows)
    elif not served:
        raise ValueError(f"held-out data of {[str(f) for f in source.files[:3]]}: fewer than seq_len + 1 = "
                         f"{seq_len + 1} held-out tokens (x dp_size={dp_size}), not one row; use a larger "
                         f"eval_fraction or eval source, or a smaller seq_len")  # fmt: skip


def _check_dp(batch_size: int, dp_rank: int, dp_size: int, seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if batch_size < 1 or dp_size < 1 or batch_size % dp_size:
        raise ValueError(f"batch_size={batch_size} must be a positive multiple of dp_size={dp_size}: "
                         f"each data-parallel rank takes batch_size / dp_size rows of every batch")  # fmt: skip
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
