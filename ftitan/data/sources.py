"""Streaming document sources: local Parquet, JSON Lines and plain-text shards, read in chunks.

A :class:`Source` is an ordered tuple of shard files, cut into *chunks*, the
unit the training stream deals out (:mod:`ftitan.data.stream`):

- ``.parquet``: a chunk is a row group; one document per row, the string column ``field``;
- ``.jsonl``: a chunk is a ``chunk_bytes`` byte range (a line belongs to the chunk its first
  byte is in); one document per non-blank line, the string ``field`` of its JSON object;
- ``.txt``: the whole file is one chunk holding one document (UTF-8).

Listing chunks opens nothing but Parquet footers (JSONL: the file size). Reading
a chunk starts at its first byte or row group, never earlier, and streams: JSON
Lines line by line, Parquet by record batches of one row group. So a corpus of
any size never sits whole in memory, and a reader resumed at record ``r`` of a
chunk skips only the ``r`` records before it (without decoding them).

A malformed record (invalid JSON or UTF-8, not an object, a missing, null or
non-string ``field``) raises ``ValueError`` naming ``file:line`` (Parquet:
``file: row i``) and the fix; no record is ever skipped silently.

Example::

    src = shards(["data/train/", "extra/*.jsonl"], field="text")
    for text in src.records(0):      # the first chunk's documents, lazily
        ...
"""

from __future__ import annotations

import functools
import glob
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import attrs

from ftitan.data.corpus import jsonl_text

__all__ = ["SUFFIXES", "Chunk", "Source", "shards"]

SUFFIXES = (".parquet", ".jsonl", ".txt")
CHUNK_BYTES = 1 << 20  # default JSONL chunk: 1 MiB, a few hundred documents of web text
_PARQUET_BATCH = 1024  # rows per Arrow record batch: bounded memory whatever the row-group size


class Chunk(NamedTuple):
    """A piece of one file: JSONL bytes ``[start, stop)``, Parquet row group ``start``, or a whole ``.txt``."""

    file: int  # index into Source.files
    start: int
    stop: int


@attrs.frozen
class Source:
    """Shard files in this order (``shards`` sorts each directory or glob), the text ``field``, the JSONL chunk size."""

    files: tuple[Path, ...]
    field: str = "text"  # Parquet column / JSON key holding the document text (ignored for .txt)
    chunk_bytes: int = CHUNK_BYTES  # JSONL chunk size in bytes

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """Every chunk, file by file, in file order (listed once per source, then cached)."""
        return _chunks(self)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def records(self, chunk: int, start: int = 0) -> Iterator[str]:
        """The documents of chunk ``chunk`` from its record ``start`` on, lazily, in file order."""
        c = self.chunks[chunk]
        path = self.files[c.file]
        if path.suffix == ".parquet":
            return _parquet_records(path, c.start, start, self.field)
        if path.suffix == ".jsonl":
            return _jsonl_records(path, c.start, c.stop, start, self.field)
        return _text_record(path, start)

    def documents(self) -> Iterator[str]:
        """Every document, chunk after chunk, in file order (lazily)."""
        for chunk in range(self.num_chunks):
            yield from self.records(chunk)


@functools.lru_cache(maxsize=16)
def _chunks(source: Source) -> tuple[Chunk, ...]:
    import pyarrow.parquet as pq

    out: list[Chunk] = []
    for i, path in enumerate(source.files):
        if path.suffix == ".parquet":
            with pq.ParquetFile(path) as pf:
                out.extend(Chunk(i, g, g + 1) for g in range(pf.metadata.num_row_groups))
        elif path.suffix == ".jsonl":
            size = path.stat().st_size
            out.extend(Chunk(i, a, min(a + source.chunk_bytes, size)) for a in range(0, size, source.chunk_bytes))
        else:
            out.append(Chunk(i, 0, 1))
    return tuple(out)


def shards(paths: str | Path | Iterable[str | Path], *, field: str = "text", chunk_bytes: int = CHUNK_BYTES) -> Source:
    """A :class:`Source` over files, directories and globs (``.parquet``, ``.jsonl``, ``.txt``).

    A directory stands for its supported files, recursively, sorted by relative
    path (names starting with ``.`` are skipped: caches, hidden files); a glob
    (``*``, ``?``, ``[``; ``**`` recurses) for its matching supported files, sorted.
    Entries keep the order given. Nothing is opened here beyond checking that the
    files exist. Example: ``shards("corpus/")``, ``shards(["a.parquet", "more/*.jsonl"])``.
    """
    if chunk_bytes < 1:
        raise ValueError(f"shards: chunk_bytes must be >= 1, got {chunk_bytes}")
    entries = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not entries:
        raise ValueError("shards: no paths given; pass a file, a directory or a glob")
    files: list[Path] = []
    for entry in entries:
        files.extend(_expand(entry))
    seen: set[Path] = set()
    for f in files:
        key = f.resolve()
        if key in seen:
            raise ValueError(f"shards: {f} is listed twice (directories and globs overlap?); list each file once")
        seen.add(key)
    return Source(files=tuple(files), field=field, chunk_bytes=chunk_bytes)


def _supported(path: Path) -> bool:
    return path.is_file() and path.suffix in SUFFIXES


def _expand(entry: str | Path) -> list[Path]:
    text = str(entry)
    if any(c in text for c in "*?["):
        found = sorted((Path(m) for m in glob.glob(text, recursive=True)), key=str)
        files = [f for f in found if _supported(f)]
        if not files:
            raise FileNotFoundError(f"shards: {text} matches no {'/'.join(SUFFIXES)} file")
        return files
    path = Path(entry)
    if path.is_dir():
        found = (f for f in path.rglob("*") if not any(p.startswith(".") for p in f.relative_to(path).parts))
        files = sorted((f for f in found if _supported(f)), key=lambda f: f.relative_to(path).as_posix())
        if not files:
            raise FileNotFoundError(f"shards: directory {path} holds no {'/'.join(SUFFIXES)} file")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"shards: {path} does not exist")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"shards: {path}: unsupported file type {path.suffix!r}; "
                         f"use {', '.join(SUFFIXES)} (one document per row / line / file)")  # fmt: skip
    return [path]


def _bad_start(path: Path, start: int, count: int) -> ValueError:
    return ValueError(f"{path}: a stream position asks for record {start} of a chunk that has {count}; "
                      f"was the state saved for other shards, or was the file changed?")  # fmt: skip


def _text_record(path: Path, start: int) -> Iterator[str]:
    if start > 1:
        raise _bad_start(path, start, 1)
    if start == 1:
        return
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start}); "
                         f"re-encode the file as UTF-8") from e  # fmt: skip
    yield text


def _line_number(path: Path, pos: int) -> int:
    """The 1-based line number of byte ``pos`` (only for error messages: reads the file up to ``pos``)."""
    count, done = 0, 0
    with path.open("rb") as f:
        while done < pos:
            block = f.read(min(1 << 20, pos - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count + 1


def _jsonl_records(path: Path, lo: int, hi: int, start: int, field: str) -> Iterator[str]:
    record = 0
    with path.open("rb") as f:  # bytes: positions are exact, and a bad UTF-8 byte is reported with its line
        if lo > 0:
            f.seek(lo - 1)
            pos = lo - 1 + len(f.readline())  # the line running into the chunk belongs to the chunk before
        else:
            pos = 0
        while pos < hi:
            raw = f.readline()
            if not raw:
                break
            at, pos = pos, pos + len(raw)
            if not raw.strip():
                continue
            if record >= start:
                yield _jsonl_line(raw, lambda at=at: f"{path}:{_line_number(path, at)}", field)
            record += 1
    if record < start:
        raise _bad_start(path, start, record)


def _jsonl_line(raw: bytes, where: Callable[[], str], field: str) -> str:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where()}: not valid UTF-8 ({e.reason} at byte {e.start} of the line); "
                         f"fix or remove the line") from e  # fmt: skip
    return jsonl_text(line, where, field)


def _parquet_records(path: Path, group: int, start: int, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as pf:
        schema = pf.schema_arrow
        if schema.get_field_index(field) < 0:
            raise ValueError(f"{path}: no column {field!r} (columns: {schema.names}); pass field=... "
                             f"(--data.jsonl-field) to choose another")  # fmt: skip
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise ValueError(f"{path}: column {field!r} has type {kind}, not string; "
                             f"pass field=... (--data.jsonl-field) naming the text column")  # fmt: skip
        meta = pf.metadata
        rows = meta.row_group(group).num_rows
        if start > rows:
            raise _bad_start(path, start, rows)
        row = sum(meta.row_group(g).num_rows for g in range(group))  # file row of the group's first row
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, row_groups=[group], columns=[field]):
            skip = min(start, batch.num_rows)
            start -= skip
            for i, text in enumerate(batch.column(0).slice(skip).to_pylist(), start=row + skip):
                if text is None:
                    raise ValueError(f"{path}: row {i}: column {field!r} is null; drop or fill null rows")
                yield text
            row += batch.num_rows
