"""Document sources: the embedded stdlib corpus, plain text files, JSON Lines.

A corpus is an iterable of documents (``str``). The default,
:func:`stdlib_corpus`, is the ``.py`` source of the running interpreter's
standard library: it exists offline on every machine that runs ftitan, is
several MB of real text, and needs no download. It is split into train and
held-out documents by a hash of each file's path relative to the stdlib root,
so the split is the same on every machine and does not move when files are
added or removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal

__all__ = ["jsonl", "stdlib_corpus", "stdlib_files", "text_files"]

Split = Literal["train", "eval", "all"]

# directory names skipped anywhere in the stdlib tree: installed packages,
# test suites (and their data files), the IDE, and generated tables
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "encodings",
     "pydoc_data", "__pycache__"}
)


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _eval_bucket(relpath: str) -> int:
    # blake2b, not hash(): Python's str hash is salted per process
    return int.from_bytes(hashlib.blake2b(relpath.encode(), digest_size=8).digest(), "little") % 10_000


def stdlib_files(*, split: Split = "train", eval_fraction: float = 0.02,
                 root: str | Path | None = None) -> list[Path]:
    """Sorted stdlib ``.py`` paths in ``split`` (``"train"``, ``"eval"`` or ``"all"``).

    A file is held out (``"eval"``) when a hash of its POSIX path relative to
    ``root`` falls in the lowest ``eval_fraction`` of buckets.
    """
    if split not in ("train", "eval", "all"):
        raise ValueError(f"stdlib_corpus: split must be 'train', 'eval' or 'all', got {split!r}")
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"stdlib_corpus: eval_fraction must be in [0, 1], got {eval_fraction}")
    root = Path(root) if root is not None else _stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib_corpus: stdlib directory {root} does not exist")
    threshold = round(eval_fraction * 10_000)
    out = []
    for path in _walk_py(root):
        rel = path.relative_to(root).as_posix()
        if split != "all" and (_eval_bucket(rel) < threshold) != (split == "eval"):
            continue
        out.append(path)
    return sorted(out)


def _walk_py(root: Path) -> Iterator[Path]:
    # os.walk with pruning: never descends into site-packages (often 10x the stdlib)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _read_text(path: Path) -> str:
    # CPython's stdlib is all UTF-8 (3.11: checked); a patched distribution might not be,
    # and the default corpus should degrade, not fail, on a stray byte
    return path.read_bytes().decode("utf-8", errors="replace")


def stdlib_corpus(*, split: Split = "train", eval_fraction: float = 0.02,
                  root: str | Path | None = None) -> Iterator[str]:
    """The standard library's ``.py`` sources, one document per file, in sorted path order.

    Example::

        docs = list(stdlib_corpus(split="eval"))   # ~2% of files, same on every machine
    """
    for path in stdlib_files(split=split, eval_fraction=eval_fraction, root=root):
        yield _read_text(path)


def text_files(paths: Iterable[str | Path]) -> Iterator[str]:
    """Plain-text files as documents, one per file, in the order given (UTF-8)."""
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"text_files: {path} is not a file")
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"text_files: {path} is not valid UTF-8 ({e.reason} at byte {e.start})") from e


def jsonl(path: str | Path, *, field: str = "text") -> Iterator[str]:
    """Documents from a JSON Lines file: the string ``field`` of each object. Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"jsonl: {path} is not a file")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield jsonl_text(line, f"{path}:{lineno}", field)


def jsonl_text(line: str, where: str | Callable[[], str], field: str) -> str:
    """The string ``field`` of one JSON Lines record; else a ValueError naming ``where`` (``file:line``;
    a callable is only called then) and the fix."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        # e.msg may end in "at" ("Unterminated string starting at"): one "at" before the column
        what = f"{e.msg.removesuffix(' at')} at column {e.colno}"
        raise ValueError(f"{_where(where)}: invalid JSON ({what}); fix or remove the line") from e
    if isinstance(record, dict) and isinstance(record.get(field), str):
        return record[field]  # the common case: no message to build
    where = _where(where)
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with a {field!r} field, "
                         f"got {type(record).__name__}; fix or remove the line")  # fmt: skip
    if field not in record:
        raise ValueError(f"{where}: object has no field {field!r} (fields: {sorted(record)}); "
                         f"pass field=... (--data.jsonl-field) to choose another")  # fmt: skip
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {field!r} must be a string, got {type(text).__name__}; "
                         f"fix or remove the line")  # fmt: skip
    return text


def _where(where: str | Callable[[], str]) -> str:
    return where if isinstance(where, str) else where()
