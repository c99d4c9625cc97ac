"""Training: state, losses, and the pure train step."""

from ftitan.train.dpo import completion_logprobs, dpo_loss, dpo_loss_fn, with_reference
from ftitan.train.exact_match import exact_match_eval, greedy_completions, score_completions
from ftitan.train.losses import IGNORE_INDEX, chunked_cross_entropy, next_token_loss
from ftitan.train.memory import retain_freed_memory
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
    "completion_logprobs",
    "dpo_loss",
    "dpo_loss_fn",
    "exact_match_eval",
    "filter_grad",
    "greedy_completions",
    "init_state",
    "make_train_step",
    "next_token_loss",
    "per_example_grads",
    "retain_freed_memory",
    "score_completions",
    "value_and_grad",
    "with_reference",
]
