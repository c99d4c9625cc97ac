"""ftitan's model families running inside vLLM through the same pure functions.

``engine(source)`` builds an in-process ``vllm.LLM`` on an HF-format directory, an ftitan run
directory or ``(model, params)``; ``complete(llm, prompts, sampling)`` returns token ids and their
logprobs; ``push_weights(llm, params)`` updates the engine's weights from a params tree (RL: after
each training step); ``close(llm)`` shuts an engine down. The model vLLM runs is
``FtitanForCausalLM``: the family's ``apply`` with vLLM's paged attention plugged in through
``apply(..., cache=)``.

``import ftitan.vllm`` does not import vLLM (``engine`` does); it only sets environment defaults so
that vLLM, whenever imported, keeps its caches under ftitan's cache root (``$FTITAN_CACHE_DIR``, else
the user's cache directory: ``ftitan._cache``) and runs engines in-process (see docs/inference.md). The model class is loaded on first access.
"""

from typing import Any

from ftitan.vllm._env import INSTALL_HINT, cache_root, set_defaults
from ftitan.vllm._families import ARCHITECTURES, CPU_HEAD_DIMS
from ftitan.vllm.engine import Source, close, engine, export_hf, push_weights
from ftitan.vllm.requests import Completion, complete

__all__ = [
    "ARCHITECTURES",
    "CPU_HEAD_DIMS",
    "INSTALL_HINT",
    "Completion",
    "FtitanForCausalLM",
    "PagedAttention",
    "Source",
    "cache_root",
    "close",
    "complete",
    "engine",
    "export_hf",
    "push_weights",
    "register",
]

set_defaults()  # env defaults only (setdefault): so that a later `import vllm` already sees them

_NEEDS_VLLM = ("FtitanForCausalLM", "PagedAttention", "register")


def __getattr__(name: str) -> Any:
    if name in _NEEDS_VLLM:  # these import vLLM: only on first access
        from ftitan.vllm._env import import_vllm

        import_vllm()
        from ftitan.vllm import model

        return getattr(model, name)
    raise AttributeError(f"module 'ftitan.vllm' has no attribute {name!r}")
