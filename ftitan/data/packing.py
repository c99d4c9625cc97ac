"""Packing documents into fixed-length training rows.

Documents are encoded once into one flat token stream, each document
followed by ``<|eos|>`` (and preceded by BOS when the tokenizer has one; the
trained BPE has none)::

    stream = [BOS] doc_0 EOS [BOS] doc_1 EOS ... [BOS] doc_{n-1} EOS

and the stream is cut into consecutive, non-overlapping rows of
``seq_len + 1`` tokens (``inputs = row[:-1]``, ``targets = row[1:]``). There
is no padding and no per-document truncation: a document that does not fit
continues in the next row. The only tokens lost are the final partial row
(fewer than ``seq_len + 1`` tokens), which is dropped. The packing law, which
the tests check::

    rows.flatten() == stream[: num_rows * (seq_len + 1)]

Attention is not masked at document boundaries; the EOS tells the model a new
document starts, as in GPT-2 and nanoGPT.

Fine-tuning data is packed the other way (:func:`pack_documents`): whole
documents (chat conversations with a loss mask) placed into rows of
``seq_len`` tokens, never split, each row carrying the document id of every
token (``segments``) and positions restarting at each document, so that the
model attends block-diagonally and a packed document computes exactly what
it computes alone.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ftitan.data.tokenizer import Tokenizer

__all__ = ["PackedRows", "encode_documents", "pack", "pack_documents", "token_stream"]

_ENCODE_CHUNK = 256  # documents per encode_batch call: bounded memory, still parallel


def token_stream(token_docs: Iterable[list[int]], *, eos_id: int, bos_id: int | None = None) -> np.ndarray:
    """``[BOS] doc_0 EOS [BOS] doc_1 EOS ...`` as one flat ``int32`` array (BOS only when ``bos_id`` is given)."""
    parts: list[np.ndarray] = []
    eos = np.array([eos_id], dtype=np.int32)
    bos = None if bos_id is None else np.array([bos_id], dtype=np.int32)
    for ids in token_docs:
        if bos is not None:
            parts.append(bos)
        parts.append(np.asarray(ids, dtype=np.int32))
        parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def encode_documents(docs: Iterable[str], tokenizer: Tokenizer, *,
                     cache: str | Path | None = None) -> np.ndarray:
    """The token stream of ``docs`` (see :func:`token_stream`), encoded once.

    With ``cache`` (a ``.npy`` path) the stream is loaded from there if the file
    exists, and saved there otherwise; ``docs`` is then not read at all. The
    cache does not know which tokenizer or corpus made it: keep it in the run
    directory next to the ``tokenizer.json`` it came from. An unreadable cache
    (truncated, not a 1-d int32 array) is encoded again, with a warning.
    """
    if cache is not None and Path(cache).is_file():
        try:
            stream = np.load(cache)
            if stream.dtype != np.int32 or stream.ndim != 1:
                raise ValueError(f"a {stream.dtype} array of shape {stream.shape}, not a 1-d int32 token stream")
            return stream
        except (ValueError, EOFError, OSError) as e:  # e.g. a copy cut short: rebuild the cache
            warnings.warn(f"{cache}: unreadable token cache ({e}); encoding the corpus again", stacklevel=2)

    def encoded() -> Iterable[list[int]]:
        chunk: list[str] = []
        for doc in docs:
            chunk.append(doc)
            if len(chunk) == _ENCODE_CHUNK:
                yield from tokenizer.encode_batch(chunk)
                chunk = []
        yield from tokenizer.encode_batch(chunk)

    stream = token_stream(encoded(), eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id)
    if cache is not None:
        cache = Path(cache)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npy")
        np.save(tmp, stream)
        os.replace(tmp, cache)  # atomic: a crash never leaves a truncated cache
    return stream


def pack(stream: np.ndarray | torch.Tensor, *, seq_len: int) -> torch.Tensor:
    """Cut ``stream`` into rows of ``seq_len + 1`` tokens, dropping the final partial row.

    Returns a ``(num_rows, seq_len + 1)`` tensor with the stream's dtype; a
    view of the stream when it is a contiguous tensor or array.
    """
    if seq_len < 1:
        raise ValueError(f"pack: seq_len must be >= 1, got {seq_len}")
    flat = torch.as_tensor(stream)
    if flat.dim() != 1:
        raise ValueError(f"pack: expected a 1-d token stream, got shape {tuple(flat.shape)}")
    row = seq_len + 1
    num_rows = flat.numel() // row
    if num_rows == 0:
        raise ValueError(f"pack: a stream of {flat.numel()} tokens is shorter than one row "
                         f"of seq_len + 1 = {row}; use more data or a smaller seq_len")
    return flat[: num_rows * row].view(num_rows, row)


IGNORE_INDEX = -100  # ftitan.train.losses.IGNORE_INDEX (not imported: ftitan.train imports ftitan.data)


class PackedRows(NamedTuple):
    """Documents packed into rows: ``batch`` ``{"inputs", "targets", "positions", "segments"}``, each
    ``(N, seq_len)`` int64, and ``placement[i] = (row, start)`` of document ``i``'s first token."""

    batch: dict[str, torch.Tensor]
    placement: list[tuple[int, int]]

    @property
    def fill(self) -> float:
        """The share of the rows' slots that hold document tokens (not padding)."""
        seg = self.batch["segments"]
        return float((seg != _PAD_SEGMENT).sum()) / max(seg.numel(), 1)


_PAD_SEGMENT = 1 << 30  # the padding's document id: above any real one, so padding never meets a document


def pack_documents(docs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, seq_len: int, pad_id: int = 0) -> PackedRows:
    """Pack ``(ids, mask)`` documents (``(n,)`` int each; ``mask`` 1 where the token is trained on,
    e.g. :class:`ftitan.data.ChatTokens`) whole into rows of ``seq_len`` tokens.

    A document of ``n`` tokens takes ``n - 1`` slots: ``inputs = ids[:-1]`` and ``targets =
    ids[1:]`` where ``mask[1:]`` is 1, ``IGNORE_INDEX`` elsewhere. Each goes to the first row with
    room (first fit, in order: deterministic, rows fill to ~95% for short documents); rows are
    right-padded (``pad_id``, ``IGNORE_INDEX`` targets, a padding segment of its own). ``segments``
    numbers the documents of a row ``0, 1, ...``; ``positions`` restart at 0 with each. A document
    longer than ``seq_len + 1`` tokens raises (truncate it when encoding: ``encode_chat(...,
    seq_len=seq_len + 1, truncate=True)``).
    """
    if seq_len < 1:
        raise ValueError(f"pack_documents: seq_len must be >= 1, got {seq_len}")
    rows: list[list[int]] = []  # per row: the indices of its documents
    room: list[int] = []
    placement: list[tuple[int, int]] = []
    for i, (ids, mask) in enumerate(docs):
        n = int(ids.shape[0]) - 1
        if ids.dim() != 1 or mask.shape != ids.shape:
            raise ValueError(f"pack_documents: document {i}: ids {tuple(ids.shape)} and mask {tuple(mask.shape)} "
                             "must be the same (n,) shape")  # fmt: skip
        if n > seq_len:
            raise ValueError(f"pack_documents: document {i} has {n + 1} tokens, more than seq_len + 1 = {seq_len + 1}; "
                             "truncate it when encoding or raise seq_len")  # fmt: skip
        r = next((j for j, free in enumerate(room) if free >= n), None) if n > 0 else None
        if r is None:
            rows.append([])
            room.append(seq_len)
            r = len(rows) - 1
        placement.append((r, seq_len - room[r]))
        rows[r].append(i)
        room[r] -= n
    shape = (len(rows), seq_len)
    out = {
        "inputs": torch.full(shape, pad_id, dtype=torch.int64),
        "targets": torch.full(shape, IGNORE_INDEX, dtype=torch.int64),
        "positions": torch.zeros(shape, dtype=torch.int64),
        "segments": torch.full(shape, _PAD_SEGMENT, dtype=torch.int64),
    }
    for r, members in enumerate(rows):
        for seg, i in enumerate(members):
            ids, mask = (torch.as_tensor(x, dtype=torch.int64) for x in docs[i])
            n, start = ids.shape[0] - 1, placement[i][1]
            span = slice(start, start + n)
            out["inputs"][r, span] = ids[:-1]
            out["targets"][r, span] = torch.where(mask[1:].bool(), ids[1:], IGNORE_INDEX)
            out["positions"][r, span] = torch.arange(n)
            out["segments"][r, span] = seg
        used = seq_len - room[r]
        out["positions"][r, used:] = torch.arange(seq_len - used)  # padding: a document of its own
    return PackedRows(out, placement)
