"""Where checkpoints live: ``directory/step_XXXXXXXX/``, and finding the newest good one.

Only directories named ``step_<digits>`` count as committed checkpoints.
A save in progress (or one a crash cut short) lives in a hidden
``.tmp-step_…`` directory, which is never listed and is safe to delete
once no save is in flight (``ftitan.checkpoint.remove_unfinished``).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from ftitan.checkpoint._manifest import CorruptCheckpointError, read_manifest, verify_files

__all__ = ["TMP_PREFIX", "checkpoint_dirname", "latest", "list_checkpoints", "step_of"]

TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"step_(\d+)\Z")


def checkpoint_dirname(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: str | Path) -> int | None:
    """The step a ``step_XXXXXXXX`` directory name encodes; ``None`` for any other name."""
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Committed-looking checkpoint directories under ``directory``, oldest step first.

    Cheap: names only, nothing is read; temp directories of unfinished saves
    are left out. Use :func:`latest` to get one that is known to be whole.
    An absent ``directory`` has no checkpoints.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(s, p) for p in directory.iterdir() if (s := step_of(p)) is not None and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest(directory: str | Path, *, verify: bool = True) -> Path | None:
    """The newest valid checkpoint under ``directory``, or ``None`` if there is none.

    A checkpoint whose manifest is missing or unreadable, or (with
    ``verify=True``, the default) whose tensor files fail their size or sha256
    check, is skipped with a warning, so the previous one is used. Hashing
    reads every file whole; ``verify=False`` checks only the manifest and the
    file sizes. Not collective: in a parallel run every rank may call it, but
    :meth:`ftitan.checkpoint.RunDir.resume` is what makes the ranks agree.
    """
    for path in reversed(list_checkpoints(directory)):
        try:
            verify_files(read_manifest(path), hash=verify)
        except CorruptCheckpointError as e:
            warnings.warn(f"skipping checkpoint {path.name}: {e}", stacklevel=2)
            continue
        return path
    return None
