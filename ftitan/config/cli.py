"""Command line: ``--recipe NAME`` picks a recipe, dotted ``tyro`` flags override its fields.

    python -m ftitan train --recipe llama3-debug --model.n-layers 2 --optim.lr 1e-3 \\
        --data.seq-len 128 --compile False

How flags are spelled (tyro 1.x, as configured here):

- nested attrs fields are dotted, underscores become dashes:
  ``model.n_layers`` -> ``--model.n-layers``, ``data.seq_len`` -> ``--data.seq-len``;
  top-level fields have no prefix: ``--steps 100``, ``--accum-steps 2``;
- booleans take a value (``tyro.conf.FlagConversionOff``): ``--compile False``,
  ``--model.tie-embeddings True``;
- ``model.rope_scaling`` is not a subcommand (``tyro.conf.AvoidSubcommands``):
  when the recipe's model has it (llama3-1b/8b), its fields are flags
  (``--model.rope-scaling.factor 4``); when it is ``None`` it cannot be set here.

``--help`` lists every field with its comment and the recipe's value as default.
Unknown flags and values the model rejects (``--model.dim 100``) make tyro print
the culprit and exit with status 2 (``SystemExit``); the rest of the checks
(``validate``) raise ``ValueError("--flag=value: fix")``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import attrs
import tyro

from ftitan.config.recipes import RECIPES, get_recipe
from ftitan.config.schema import TrainConfig
from ftitan.config.validate import validate

__all__ = ["DEFAULT_RECIPE", "DEFAULT_RL_RECIPE", "from_hf_checkpoint", "parse_train_args"]

DEFAULT_RECIPE = "llama3-debug"
DEFAULT_RL_RECIPE = "grpo-arith"
_TYRO_CONFIG = (tyro.conf.FlagConversionOff, tyro.conf.AvoidSubcommands)


def _split_recipe(argv: Sequence[str], default: str = DEFAULT_RECIPE) -> tuple[str, list[str]]:
    """Pull ``--recipe NAME`` / ``--recipe=NAME`` out of ``argv``; the last one wins."""
    name, rest, args = default, [], list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--recipe":
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ValueError(f"--recipe needs a name; known recipes: {', '.join(sorted(RECIPES))}")
            name, i = args[i + 1], i + 2
            continue
        if arg.startswith("--recipe="):
            name = arg.removeprefix("--recipe=")
        else:
            rest.append(arg)
        i += 1
    return name, rest


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` / ``flag=VALUE`` in ``args``."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.removeprefix(flag + "=")
    return value


def from_hf_checkpoint(base: TrainConfig, directory: str, *, tokenizer: bool = True) -> TrainConfig:
    """``base`` starting from the HF checkpoint in ``directory``: its architecture (``config.json``), its
    vocabulary size, and (``tokenizer=True``) its own ``tokenizer.json`` when it has one."""
    from ftitan.models import hf

    config = Path(directory) / "config.json"
    if not config.is_file():
        raise ValueError(f"--init.hf={directory!r}: no config.json there; expected an HF checkpoint directory "
                         "(a transformers save_pretrained directory)")  # fmt: skip
    model = hf.config_from_hf(json.loads(config.read_text()))
    own_tokenizer = tokenizer and (Path(directory) / "tokenizer.json").is_file()
    data = attrs.evolve(base.data, vocab_size=model.vocab_size, seq_len=min(base.data.seq_len, model.max_seq_len),
                        tokenizer=str(directory) if own_tokenizer else base.data.tokenizer)  # fmt: skip
    return attrs.evolve(base, model=model, data=data, init=attrs.evolve(base.init, hf=str(directory)))


def parse_train_args(argv: Sequence[str], *, prog: str | None = None, rl: bool = False) -> TrainConfig:
    """Build the run ``argv`` asks for: recipe, then dotted overrides, then ``validate``.

    ``--recipe`` defaults to ``llama3-debug``. ``--init.hf DIR`` starts from an HF checkpoint: the
    model is DIR's architecture (``--model.*`` flags still override it) and the data uses DIR's
    tokenizer unless ``--data.tokenizer`` says otherwise. Raises ``ValueError`` for an unknown recipe
    or a failed check; tyro raises ``SystemExit`` (2 for a bad flag, 0 after ``--help``).
    ``rl=True`` (``ftitan rl``): the recipe must be an RL run (``rl.env`` set; default ``grpo-arith``), and
    ``ftitan train`` refuses one.
    """
    name, rest = _split_recipe(argv, DEFAULT_RL_RECIPE if rl else DEFAULT_RECIPE)
    base = get_recipe(name)
    if (hf_dir := _flag_value(rest, "--init.hf")) is not None and hf_dir:
        base = from_hf_checkpoint(base, hf_dir, tokenizer=_flag_value(rest, "--data.tokenizer") is None)
    description = (
        f"Train with recipe {name!r} (choose with --recipe NAME; known: {', '.join(sorted(RECIPES))}). "
        "Flags below override its fields."
    )
    cfg = tyro.cli(TrainConfig, default=base, args=rest, prog=prog, description=description, config=_TYRO_CONFIG)
    if rl and not cfg.rl.env:
        raise ValueError(f"--recipe {name!r} is not an RL run (no --rl.env); use an RL recipe "
                         f"({', '.join(n for n in sorted(RECIPES) if RECIPES[n]().rl.env)}) or pass --rl.env NAME")  # fmt: skip
    if not rl and cfg.rl.env:
        raise ValueError(f"--recipe {name!r} is an RL run (--rl.env {cfg.rl.env}); run it with `ftitan rl`")
    return validate(cfg)
