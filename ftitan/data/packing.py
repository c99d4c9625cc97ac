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
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from ftitan.data.tokenizer import Tokenizer

__all__ = ["encode_documents", "pack", "token_stream"]

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
