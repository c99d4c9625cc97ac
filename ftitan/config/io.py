"""A run's config as JSON and back (``config.json``, checkpoint manifests).

Sections a run written by an older ftitan lacks take their defaults, so old
run directories still load.
"""

from __future__ import annotations

from typing import Any

import attrs

from ftitan.config.schema import (
    CheckpointConfig,
    DataConfig,
    DPOConfig,
    FlexShardConfig,
    InitConfig,
    LoRAConfig,
    MixedPrecisionConfig,
    OptimConfig,
    ParallelConfig,
    RLConfig,
    TrainConfig,
)
from ftitan.models import registry

__all__ = ["config_from_dict", "config_to_dict"]

_SECTIONS = {"optim": OptimConfig, "data": DataConfig, "parallel": ParallelConfig, "flexshard": FlexShardConfig,
             "mixed_precision": MixedPrecisionConfig, "init": InitConfig, "checkpoint": CheckpointConfig,
             "lora": LoRAConfig, "dpo": DPOConfig, "rl": RLConfig}  # fmt: skip


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """``cfg`` as the JSON a run writes; the model names its family."""
    return {**attrs.asdict(cfg), "model": registry.config_to_dict(cfg.model)}


def config_from_dict(d: dict[str, Any]) -> TrainConfig:
    """The ``TrainConfig`` a run wrote to its ``config.json``."""
    sections = {name: cls(**d.get(name, {})) for name, cls in _SECTIONS.items()}
    return TrainConfig(**{**d, "model": registry.config_from_dict(d["model"]), **sections})
