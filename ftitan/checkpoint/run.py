"""A run directory: its config, checkpoints and resume logic, as ``ftitan train`` writes them.

    runs/<recipe>/
      config.json        the run's config (``ftitan.config.config_to_dict``)
      tokenizer.json     the tokenizer the run trained or copied
      checkpoints/       step_XXXXXXXX/ (``ftitan.checkpoint.Checkpointer``), the newest K kept
      metrics.jsonl, tensorboard/, loss.png

:class:`RunDir` is what the trainer saves to and resumes from;
:func:`load_run` is what ``ftitan generate`` / ``ftitan convert`` read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftitan.checkpoint._checkpointer import Checkpointer
from ftitan.checkpoint._commit import remove_unfinished
from ftitan.checkpoint._layout import latest, list_checkpoints, step_of
from ftitan.checkpoint._load import load
from ftitan.checkpoint._manifest import read_manifest
from ftitan.checkpoint._resume import resume_newest
from ftitan.checkpoint._save import save

if TYPE_CHECKING:
    from ftitan.config.schema import CheckpointConfig, TrainConfig
    from ftitan.data import Tokenizer

__all__ = ["IDENTITY", "RunDir", "RunDirError", "load_run"]

CONFIG_FILE = "config.json"
# what a run trains and on what: a run directory holds one such run (--resume may change the rest:
# steps, intervals, optimizer, parallel layout, device, precision, compile)
IDENTITY = ("model", "data", "seed", "init", "lora", "rl.env", "rl.sft_steps", "rl.sft_lr", "rl.init_run",
            "rl.group_size", "rl.prompts", "rl.max_new_tokens", "rl.max_offpolicy_steps")
# what `ftitan train` writes into a run directory, all of which --overwrite deletes (nothing else)
WRITTEN = ("checkpoints", "metrics.jsonl", "tensorboard", "loss.png", "train_tokens.npy", "eval_tokens.npy",
           "tokenizer.json", "tokenizer_size.json", "tokenizer_config.json", "special_tokens_map.json",
           "generation_config.json", "chat_template.jinja", "reward.png", "sft", CONFIG_FILE)  # fmt: skip


class RunDirError(ValueError):
    """A run directory cannot take this run (it holds another one, or is ahead of ``--steps``)."""


def _flat(d: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
    return out


def _normalized(saved: dict[str, Any], file: Path) -> dict[str, Any]:
    """``saved`` with the defaults an older ftitan's config.json lacks filled in."""
    from ftitan.config.io import config_from_dict, config_to_dict

    try:
        return config_to_dict(config_from_dict(saved))
    except (TypeError, ValueError, KeyError) as e:
        raise RunDirError(f"{file}: not a config this ftitan reads ({type(e).__name__}: {e}); pass --overwrite to "
                          "start a new run here, or use another --run-dir") from None  # fmt: skip


def _flag(path: str) -> str:
    return "--" + path.replace("_", "-")


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def identity_differences(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``["--data.seq-len: 256 in the run, 128 now", ...]``: the IDENTITY fields two configs differ in."""
    a = {k: v for s in IDENTITY for k, v in _flat(_get(saved, s), s).items()}
    b = {k: v for s in IDENTITY for k, v in _flat(_get(new, s), s).items()}
    return [f"{_flag(k)}: {a.get(k)!r} in the run, {b.get(k)!r} now" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]  # fmt: skip


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
        """Make the directory and write the run's ``config.json`` atomically (rank 0 only)."""
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{CONFIG_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(cfg_dict, indent=2) + "\n")
        os.replace(tmp, self.path / CONFIG_FILE)  # other ranks may read it meanwhile: never half a file

    def saved_config(self) -> dict[str, Any] | None:
        """The ``config.json`` a previous run wrote here (``None`` when there is none)."""
        file = self.path / CONFIG_FILE
        if not file.is_file():
            return None
        try:
            return json.loads(file.read_text())
        except ValueError as e:
            raise RunDirError(f"{file}: unreadable ({e}); pass --overwrite to start a new run here, or use another "
                              "--run-dir") from None  # fmt: skip

    def check_reuse(self, cfg_dict: dict[str, Any], *, resume: bool) -> bool:
        """Refuse to mix two runs in one directory (read-only: every rank may call it); returns whether
        the directory holds leftovers of another run to clear first (:meth:`clear`, rank 0).

        A run with checkpoints here is continued only by ``--resume`` with the same identity
        (:data:`IDENTITY`: model, data, seed, init); anything else raises :class:`RunDirError` naming what
        differs and the ways out (``--resume``, ``--overwrite``, another ``--run-dir``). A run that stopped
        before its first checkpoint lost nothing: with the same identity its caches are reused, with
        another they are stale (a tokenizer trained on other data, say), so they are to be cleared."""
        saved = self.saved_config()
        if saved is not None:
            saved = _normalized(saved, self.path / CONFIG_FILE)
        steps = [s for p in list_checkpoints(self.checkpoints) if (s := step_of(p)) is not None]
        if saved is None:
            leftovers = [name for name in WRITTEN if (self.path / name).exists() and name not in ("checkpoints", CONFIG_FILE)]
            if steps or leftovers:
                raise RunDirError(f"{self.path}: holds {'checkpoints' if steps else ', '.join(leftovers)} but no "
                                  f"{CONFIG_FILE}, so it cannot be checked against this run; pass --overwrite to "
                                  "clear it, or use another --run-dir")  # fmt: skip
            return False
        diffs = identity_differences(saved, cfg_dict)
        if not steps:
            return bool(diffs)
        if diffs:
            shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
            action = "resume" if resume else "reuse"
            raise RunDirError(f"{self.path}: cannot {action} the run there (checkpoints up to step {max(steps)}), its "
                              f"model or data differs ({shown}); drop those flags to resume it, or start this run "
                              "with another --run-dir or --overwrite (deletes that run's checkpoints, metrics and "
                              "caches)")  # fmt: skip
        if not resume:
            raise RunDirError(f"{self.path}: holds a run with checkpoints up to step {max(steps)}; pass --resume to "
                              "continue it, --overwrite to start over (deletes its checkpoints, metrics and "
                              "caches), or use another --run-dir")  # fmt: skip
        return False

    def clear(self) -> list[str]:
        """``--overwrite``: delete what a run wrote here (only those files: :data:`WRITTEN`); returns their names."""
        removed = []
        for name in WRITTEN:
            path = self.path / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
            else:
                continue
            removed.append(name)
        return removed

    def resume(self, like: Any, *, whole: Any = None, into: bool = False) -> tuple[Any, int] | None:
        """``(tree, step)`` from the newest checkpoint every rank can load, restored into ``like``'s
        structure and sharding (DTensor leaves read only their blocks, whatever layout saved them; a
        meta leaf loads whole on the CPU); ``None`` when there is no checkpoint. ``whole``: the whole
        structure when ``like`` is a pipeline stage's part (see :func:`ftitan.checkpoint.load`).
        Collective under a process group. A damaged newest checkpoint is skipped with a warning; when
        checkpoints exist but none loads, raises :class:`CorruptCheckpointError` listing each and why.
        ``into=True``: load into ``like``'s own tensors (one copy of the state; see ``load``)."""
        found = resume_newest(self.checkpoints, like, whole=whole, into=into)
        return None if found is None else (found[0], found[1].step)

    def save(self, step: int, tree: Any, *, keep: int, cfg_dict: dict[str, Any]) -> Path:
        """Checkpoint ``tree`` at ``step`` (atomic; the newest ``keep`` are kept), the config alongside."""
        return save(self.checkpoints, step, tree, keep=keep, extra={"config": cfg_dict})

    def checkpointer(self, cfg: CheckpointConfig, *, keep: int, cfg_dict: dict[str, Any]) -> Checkpointer:
        """The trainer's saver into ``checkpoints/`` (:class:`ftitan.checkpoint.Checkpointer`: sharded,
        async unless ``cfg.backend="sync"``), the config in every manifest. Every rank makes one."""
        return Checkpointer(self.checkpoints, backend=cfg.backend, keep=keep, extra={"config": cfg_dict},
                            commit_timeout=cfg.commit_timeout,
                            subprocess_min_bytes=int(cfg.subprocess_min_mib * 2**20))  # fmt: skip

    def remove_unfinished(self) -> list[str]:
        """Delete the temp dirs of saves a crash or kill cut short (rank 0, before training)."""
        return remove_unfinished(self.checkpoints)


def newest_of_run(run: RunDir) -> tuple[Path, TrainConfig]:
    """The run's newest valid checkpoint (every file verified) and the config its weights came from."""
    from ftitan.config.io import config_from_dict

    if not (run.path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{run.path}: no config.json here; pass the directory a `ftitan train` run wrote "
                                "(runs/<recipe> by default)")  # fmt: skip
    newest = latest(run.checkpoints)
    if newest is None:
        raise FileNotFoundError(f"{run.checkpoints}: no valid checkpoint yet; train longer or check the run")
    return newest, config_from_dict(read_manifest(newest).extra["config"])


def load_run(run_dir: str | Path, *, device: Any = None) -> tuple[TrainConfig, Any, Any, Tokenizer | None, int]:
    """``(cfg, model, params, tokenizer, step)`` from a run directory's newest valid checkpoint.

    ``device``: where the params go (default: the CPU). ``tokenizer`` is ``None`` for a run converted
    from an HF directory that had no tokenizer files.
    """
    from ftitan import random
    from ftitan.data import pipeline
    from ftitan.train import post
    from ftitan.train.state import init_state

    run = RunDir(run_dir)
    newest, cfg = newest_of_run(run)
    model = post.model_of(cfg)  # a LoRA run: {"base", "lora"} params (ftitan.models.lora.merge for the base's)
    params = model.init(random.key(cfg.seed), device="meta")  # the structure to restore into
    opt = post.optimizer_of(cfg, model, params)
    whole: dict[str, Any] = {"state": init_state(params, opt, trainable=post.trainable_of(cfg))}
    if cfg.rl.env:  # an RL run: its generator step, reference and rollout queue (ftitan.rl.loop)
        from ftitan.rl.loop import rl_state_like

        whole["rl"] = rl_state_like(cfg, params)
    else:
        whole["loader"] = pipeline.loader_state_like(cfg)
    # only the params are read (not the optimizer state), each leaf from whatever ranks wrote it
    restored, manifest = load(newest, {"state": {"params": params}}, whole=whole)
    params = restored["state"]["params"]
    if device is not None:
        from ftitan import tree

        params = tree.map(lambda x: x.to(device), params)
    return cfg, model, params, pipeline.run_tokenizer(cfg, run.path), manifest.step
