"""Training: state, losses, and the pure train step."""

from ftitan.train.losses import IGNORE_INDEX, chunked_cross_entropy, next_token_loss
from ftitan.train.state import TrainState, init_state
from ftitan.train.step import make_train_step, value_and_grad

__all__ = [
    "IGNORE_INDEX",
    "TrainState",
    "chunked_cross_entropy",
    "init_state",
    "make_train_step",
    "next_token_loss",
    "value_and_grad",
]
