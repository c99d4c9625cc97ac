"""ftitan: a functional, JAX-style PyTorch platform for LLM pretraining, post-training and RL.

``import ftitan as ft`` gives the subpackages: ``ft.tree``, ``ft.random``,
``ft.nn``, ``ft.models``, ``ft.optim``, ``ft.train``, ``ft.infer``,
``ft.data``, ``ft.checkpoint``, ``ft.rl``. ``ftitan.vllm`` (vLLM engines over ftitan
models) is imported on its own: it needs the ``vllm`` extra. Compile caches
go under ftitan's cache root (``$FTITAN_CACHE_DIR``, else the user's cache
directory; see ``ftitan._cache``) unless ``TORCHINDUCTOR_CACHE_DIR`` is set.
"""

from ftitan import tree  # noqa: I001  (tree first: everything else builds on it)
from ftitan import random
from ftitan import nn, models, optim, train, infer
from ftitan import checkpoint, data, rl
from ftitan import _cache

_cache.set_defaults()

__all__ = ["checkpoint", "data", "infer", "models", "nn", "optim", "random", "rl", "train", "tree"]
__version__ = "0.1.0"
