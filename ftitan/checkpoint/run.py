"""A run directory: its config, checkpoints and resume logic, as ``ftitan train`` writes them.

    runs/<recipe>/
      config.json        the run's config (``ftitan.config.config_to_dict``)
      tokenizer.json     the tokenizer the run trained or copied
      checkpoints/       step_XXXXXXXX/ (``ftitan.checkpoint.save``), the newest K kept
      metrics.jsonl, tensorboard/, loss.png

:class:`RunDir` is what the trainer saves to and resumes from;
:func:`load_run` is what ``ftitan generate`` / ``ftitan convert`` read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftitan.checkpoint._layout import latest
from ftitan.checkpoint._load import load
from ftitan.checkpoint._manifest import read_manifest
from ftitan.checkpoint._save import save

if TYPE_CHECKING:
    from ftitan.config.schema import TrainConfig
    from ftitan.data import Tokenizer

__all__ = ["RunDir", "load_run"]

CONFIG_FILE = "config.json"


class RunDir:
    """The directory one run writes: ``config.json``, ``checkpoints/``, metrics and plots."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"

    @classmethod
    def of(cls, cfg: TrainConfig) -> RunDir:
        """``cfg.run_dir`` with ``{recipe}`` filled in."""
        return cls(cfg.run_dir.format(recipe=cfg.recipe))

    def create(self, cfg_dict: dict[str, Any]) -> None:
        """Make the directory and write the run's ``config.json`` (rank 0 only)."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / CONFIG_FILE).write_text(json.dumps(cfg_dict, indent=2) + "\n")

    def resume(self, like: Any) -> tuple[Any, int] | None:
        """``(tree, step)`` from the newest valid checkpoint, restored into ``like``'s structure; ``None``
        when there is none. ``like`` may be on the meta device (the tree then loads on the CPU)."""
        newest = latest(self.checkpoints)
        if newest is None:
            return None
        restored, manifest = load(newest, like)
        return restored, manifest.step

    def save(self, step: int, tree: Any, *, keep: int, cfg_dict: dict[str, Any]) -> Path:
        """Checkpoint ``tree`` at ``step`` (atomic; the newest ``keep`` are kept), the config alongside."""
        return save(self.checkpoints, step, tree, keep=keep, extra={"config": cfg_dict})


def load_run(run_dir: str | Path, *, device: Any = None) -> tuple[TrainConfig, Any, Any, Tokenizer | None, int]:
    """``(cfg, model, params, tokenizer, step)`` from a run directory's newest valid checkpoint.

    ``device``: where the params go (default: the CPU). ``tokenizer`` is ``None`` for a run converted
    from an HF directory that had no tokenizer files.
    """
    from ftitan import optim, random
    from ftitan.data import pipeline
    from ftitan.config.io import config_from_dict
    from ftitan.models import registry
    from ftitan.train.state import init_state

    run = RunDir(run_dir)
    if not (run.path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{run.path}: no config.json here; pass the directory a `ftitan train` run wrote "
                                "(runs/<recipe> by default)")  # fmt: skip
    newest = latest(run.checkpoints)
    if newest is None:
        raise FileNotFoundError(f"{run.checkpoints}: no valid checkpoint yet; train longer or check the run")
    cfg = config_from_dict(read_manifest(newest).extra["config"])  # the config these weights came from
    model = registry.model_for(cfg.model)
    params = model.init(random.key(cfg.seed), device="meta")  # the structure to restore into
    opt = optim.from_config(cfg.optim, cfg.steps, params, frozen=model.frozen)
    like = {"state": init_state(params, opt), "loader": pipeline.loader_state_like(cfg)}
    restored, manifest = load(newest, like)
    params = restored["state"].params
    if device is not None:
        from ftitan import tree

        params = tree.map(lambda x: x.to(device), params)
    return cfg, model, params, pipeline.run_tokenizer(cfg, run.path), manifest.step
