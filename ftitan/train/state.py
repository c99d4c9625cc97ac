"""The training state: a NamedTuple of tensors and trees."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ftitan import random, tree
from ftitan.optim.masking import check_mask_matches, subset
from ftitan.optim.transform import state_device

__all__ = ["Trainable", "TrainState", "init_state", "trainable_params"]

Trainable = str | Sequence[str] | Callable[[str, Any], bool]
"""Which leaves train: glob pattern(s) over dotted paths, or ``(path, leaf) -> bool``."""


class TrainState(NamedTuple):
    """Everything a step reads and writes; a pytree, so it crosses ``torch.compile``."""

    step: torch.Tensor  # 0-d int64: optimizer steps taken
    params: Any  # the parameter tree
    opt_state: Any  # the optimizer's state tree
    rng: torch.Tensor  # a key from ftitan.random, for dropout / sampling in the step


def trainable_params(params: Any, trainable: Trainable) -> dict[str, Any]:
    """The leaves ``trainable`` selects, as a flat ``{dotted path: leaf}`` dict (what the
    optimizer sees in ``make_train_step(..., trainable=...)``). A glob that selects no
    leaf raises, naming it and some paths."""
    if not torch.compiler.is_compiling():
        check_mask_matches(trainable, params, "trainable")
    return subset(trainable, params)


def init_state(
    params: Any, optimizer: Any, *, rng: torch.Tensor | None = None, trainable: Trainable | None = None
) -> TrainState:
    """A fresh ``TrainState`` for ``params`` and ``optimizer`` (a ``Transform``).

    With ``trainable`` (the same value given to ``make_train_step``) the
    optimizer state covers the selected leaves only: frozen leaves have no
    optimizer state.
    """
    return TrainState(
        step=torch.zeros((), dtype=torch.int64, device=state_device(params)),  # beside the params
        params=params,
        opt_state=optimizer.init(params if trainable is None else trainable_params(params, trainable)),
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
