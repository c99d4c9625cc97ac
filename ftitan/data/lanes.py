"""A lane: a sequence of documents cut into rows of ``seq_len + 1`` tokens, carrying the remainder.

Each document is packed as ``[BOS] ids EOS`` (BOS only when the tokenizer has
one; see :mod:`ftitan.data.packing`), and the packed documents are laid end to
end: a row may start in the middle of one document and span several. Where a
lane is, is three integers (:class:`Lane`'s cursor): its current document's
chunk and record, and how many of its tokens were served.
:mod:`ftitan.data.stream` runs ``batch_size`` lanes side by side;
:mod:`ftitan.data.heldout` runs one over the held-out documents.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from ftitan.data.tokenizer import Tokenizer

__all__ = ["Doc", "Lane", "Row", "encode_docs", "rows_to_batch"]


@dataclasses.dataclass(slots=True)
class Doc:
    """One document and where it is."""

    chunk: int  # the chunk's place in the stream's chunk order (held-out rows: the chunk index)
    record: int  # record index within the chunk, in file order
    text: str | None  # dropped once encoded
    part: tuple[int, int | None]  # the slice of the packed document that belongs to this split
    tokens: np.ndarray | None = None  # (n,) int32: the packed document's ``part``


def encode_docs(docs: list[Doc], tokenizer: Tokenizer) -> None:
    """Set ``doc.tokens`` to ``[BOS] ids EOS`` (sliced to ``doc.part``) for each doc, in one ``encode_batch``."""
    if not docs:
        return
    texts = [d.text or "" for d in docs]
    head = 0 if tokenizer.bos_id is None else 1
    for doc, ids in zip(docs, tokenizer.encode_batch(texts), strict=True):
        packed = np.empty(len(ids) + head + 1, dtype=np.int32)
        if head:
            packed[0] = tokenizer.bos_id
        packed[head:-1] = ids
        packed[-1] = tokenizer.eos_id
        start, stop = doc.part
        doc.tokens, doc.text = packed[start:stop], None


class Row(NamedTuple):
    """One packed row: ``tokens`` ``(T + 1,)`` int32; with segments, per token the index of its
    document within the row (``segment_ids``, from 0) and its position in that packed document."""

    tokens: np.ndarray
    segment_ids: np.ndarray | None
    positions: np.ndarray | None


@dataclasses.dataclass
class Lane:
    """A lane's cursor and the documents read for it but not yet finished (``queue[0]`` is current).

    Cursor: the lane's current document is its first document at or after record
    ``record`` of chunk ``chunk``; ``offset`` of its tokens were served. After a
    row that ends exactly at a document's end, the cursor is just past that
    document (``record + 1``, offset 0): the cursor after a row depends only on
    the lane's own documents, not on how far ahead they were read.
    """

    index: int
    chunk: int
    record: int
    offset: int
    queue: deque[Doc] = dataclasses.field(default_factory=deque)
    reader: Iterator[Doc] | None = None  # the lane's documents after those queued

    def tokens_ahead(self) -> int:
        """Encoded tokens queued and not yet served."""
        return sum(len(d.tokens) for d in self.queue if d.tokens is not None) - self.offset

    def fill(self, row_len: int, more: Callable[[Lane], bool], *, segments: bool = False) -> Row | None:
        """The next row of ``row_len`` tokens; ``more(lane)`` queues documents (False: none left, no row)."""
        pieces: list[np.ndarray] = []
        starts: list[int] = []
        need = row_len
        while need:
            if not self.queue and not more(self):
                return None
            doc = self.queue[0]
            tokens = doc.tokens
            assert tokens is not None, "documents are encoded before they are queued"
            if self.offset >= len(tokens):
                raise ValueError(f"stream state: lane {self.index} resumes at token {self.offset} of a document "
                                 f"of {len(tokens)} tokens; was it saved with another tokenizer or data?")  # fmt: skip
            take = min(len(tokens) - self.offset, need)
            pieces.append(tokens[self.offset : self.offset + take])
            starts.append(self.offset)
            self.offset += take
            need -= take
            if self.offset == len(tokens):  # finished: the cursor moves just past it
                self.queue.popleft()
                self.chunk, self.record, self.offset = doc.chunk, doc.record + 1, 0
            else:
                self.chunk, self.record = doc.chunk, doc.record
        row = np.concatenate(pieces)
        if not segments:
            return Row(row, None, None)
        lengths = [len(p) for p in pieces]
        segment_ids = np.repeat(np.arange(len(pieces), dtype=np.int64), lengths)
        positions = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lengths, strict=True)])
        return Row(row, segment_ids, positions)


def rows_to_batch(rows: list[Row]) -> dict[str, torch.Tensor]:
    """``{"inputs": (b, T), "targets": (b, T)}`` int64 from ``b`` rows of ``T + 1`` tokens (targets: shifted
    left by one); with segments also ``"segment_ids"`` and ``"positions"``, ``(b, T)`` int64, aligned with inputs."""
    tokens = torch.from_numpy(np.stack([r.tokens for r in rows])).long()  # (b, T + 1)
    batch = {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    if rows[0].segment_ids is not None:
        batch["segment_ids"] = torch.from_numpy(np.stack([r.segment_ids[:-1] for r in rows]))  # type: ignore[index]
        batch["positions"] = torch.from_numpy(np.stack([r.positions[:-1] for r in rows]))  # type: ignore[index]
    return batch
