"""Where ftitan keeps its caches (inductor's compiled kernels, vLLM's): one place decides.

The root is ``$FTITAN_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/ftitan``, else
``~/.cache/ftitan``: the user's cache directory, never inside the installed
package or the current directory. The repository's Makefile and tests point
``FTITAN_CACHE_DIR`` at its ignored ``.cache/``, so they write nothing outside
the checkout.

``import ftitan`` calls :func:`set_defaults`; a variable the user set wins.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV", "cache_root", "set_defaults"]

ENV = "FTITAN_CACHE_DIR"


def cache_root() -> Path:
    """``$FTITAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/ftitan``, else ``~/.cache/ftitan`` (absolute)."""
    if explicit := os.environ.get(ENV):
        return Path(explicit).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).expanduser().is_absolute() else Path.home() / ".cache"
    return (base / "ftitan").resolve()  # a relative XDG_CACHE_HOME is invalid per the spec: ignored


def set_defaults() -> Path:
    """``os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", <root>/inductor)`` (inductor reads it when it
    compiles, so this works after ``import torch``); returns the root. ``ftitan.vllm`` adds vLLM's."""
    root = cache_root()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    return root
