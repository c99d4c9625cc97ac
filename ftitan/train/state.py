"""The training state: a NamedTuple of tensors and trees."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftitan import random, tree

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


# Paths into a TrainState read "params.layers.0.attn.wq", "opt_state.0.mu....",
# not "1.layers.0..." (optree names NamedTuple children by position): checkpoints
# key tensors by these paths.
tree.register_node(
    TrainState,
    lambda s: (tuple(s), None),
    lambda _aux, children: TrainState(*children),
    keys=lambda _aux: TrainState._fields,
)
