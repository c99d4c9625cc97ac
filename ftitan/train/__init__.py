"""Training: state, losses, and the pure train step."""

from ftitan.train.losses import IGNORE_INDEX, chunked_cross_entropy, next_token_loss
from ftitan.train.precision import MixedPrecision, apply_precision
from ftitan.train.state import TrainState, init_state
from ftitan.train.step import make_train_step, value_and_grad
from ftitan.train.transforms import filter_grad, per_example_grads

__all__ = [
    "IGNORE_INDEX",
    "MixedPrecision",
    "TrainState",
    "apply_precision",
    "chunked_cross_entropy",
    "filter_grad",
    "init_state",
    "make_train_step",
    "next_token_loss",
    "per_example_grads",
    "value_and_grad",
]
