"""ftitan: a functional, JAX-style PyTorch platform for LLM pretraining, post-training and RL.

``import ftitan as ft`` gives the subpackages: ``ft.tree``, ``ft.random``,
``ft.nn``, ``ft.models``, ``ft.optim``, ``ft.train``.
"""

from ftitan import tree  # noqa: I001  (tree first: everything else builds on it)
from ftitan import random
from ftitan import nn, models, optim, train

__all__ = ["models", "nn", "optim", "random", "train", "tree"]
__version__ = "0.1.0"
