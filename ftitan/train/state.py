"""The training state: a NamedTuple of tensors and trees."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftitan import random

__all__ = ["TrainState", "init_state"]


class TrainState(NamedTuple):
    """Everything a step reads and writes; a pytree, so it crosses ``torch.compile``."""

    step: torch.Tensor  # 0-d int64: optimizer steps taken
    params: Any  # the parameter tree
    opt_state: Any  # the optimizer's state tree
    rng: torch.Tensor  # a key from ftitan.random, for dropout / sampling in the step


def init_state(params: Any, optimizer: Any, *, rng: torch.Tensor | None = None) -> TrainState:
    """A fresh ``TrainState`` for ``params`` and ``optimizer`` (a ``Transform``)."""
    return TrainState(
        step=torch.zeros((), dtype=torch.int64),
        params=params,
        opt_state=optimizer.init(params),
        rng=random.key(0) if rng is None else rng,
    )
