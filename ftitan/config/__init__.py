"""Run configuration: schema, named recipes, model transforms, validation and the CLI.

>>> from ftitan import config
>>> cfg = config.parse_train_args(["--recipe", "llama3-debug", "--optim.lr", "1e-3"])
>>> cfg.recipe, cfg.optim.lr
('llama3-debug', 0.001)
"""

from ftitan.config.cli import parse_train_args
from ftitan.config.recipes import RECIPES, get_recipe, recipe
from ftitan.config.schema import DataConfig, OptimConfig, TrainConfig
from ftitan.config.transforms import (
    ModelTransform,
    batch_invariant,
    compose,
    with_attn_impl,
    with_dim,
    with_float8,
    with_kernels,
    with_layers,
    with_max_seq_len,
    with_model_fields,
    with_remat,
    with_vocab,
)
from ftitan.config.io import config_from_dict, config_to_dict
from ftitan.config.validate import validate

__all__ = [
    "RECIPES",
    "DataConfig",
    "ModelTransform",
    "OptimConfig",
    "TrainConfig",
    "batch_invariant",
    "compose",
    "config_from_dict",
    "config_to_dict",
    "get_recipe",
    "parse_train_args",
    "recipe",
    "validate",
    "with_attn_impl",
    "with_dim",
    "with_float8",
    "with_kernels",
    "with_layers",
    "with_max_seq_len",
    "with_model_fields",
    "with_remat",
    "with_vocab",
]
