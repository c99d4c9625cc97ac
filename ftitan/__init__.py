"""ftitan: a functional, JAX-style PyTorch platform for LLM pretraining, post-training and RL.

``import ftitan as ft`` gives the subpackages: ``ft.tree``, ``ft.random``,
``ft.nn``, ``ft.models``, ``ft.optim``, ``ft.train``, ``ft.data``,
``ft.checkpoint``.
"""

from ftitan import tree  # noqa: I001  (tree first: everything else builds on it)
from ftitan import random
from ftitan import nn, models, optim, train
from ftitan import checkpoint, data

__all__ = ["checkpoint", "data", "models", "nn", "optim", "random", "train", "tree"]
__version__ = "0.1.0"
