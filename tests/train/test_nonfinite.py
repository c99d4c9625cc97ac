"""``--optim.nonfinite``: NaN/inf gradients are skipped, counted, and stop the run with a name, never saved.

The guard's decisions are the optimizer's (``tests/optim/test_nonfinite_guard.py``); these tests run the
trainer on a tiny run whose loss poisons one param's gradient at chosen steps.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from ftitan import tree
from ftitan.checkpoint._layout import list_checkpoints, step_of
from ftitan.train import post, trainer
from ftitan.train.faults import RunFailure
from ftitan.train.losses import next_token_loss

ROOT = Path(__file__).resolve().parents[2]


def _poison(monkeypatch, steps: set[int], path: str = "layers.0.attn.wq") -> None:
    """The trainer's loss, with a NaN gradient for ``path`` on the train steps ``steps`` (counted from 1;
    keep held-out evaluation to the end, --eval-every 0, so calls 1..N are the steps)."""
    calls = [0]

    def poisoned(model):
        inner = next_token_loss(model)

        def loss(params, batch):
            calls[0] += 1
            out, aux = inner(params, batch)
            if calls[0] in steps:
                leaf = params
                for key in path.split("."):
                    leaf = leaf[key]
                out = out + (leaf * math.nan).sum()  # d/d(leaf) is NaN; every other gradient stays finite
            return out, aux

        return loss

    monkeypatch.setattr(post, "loss_of", lambda cfg, model: poisoned(model))  # the trainer's objective


def _cfg(base, *, steps: int, **optim):
    return attrs.evolve(base, steps=steps, eval_every=0, optim=attrs.evolve(base.optim, **optim),
                        checkpoint=attrs.evolve(base.checkpoint, backend="sync"))  # no writer process to start


def _saved_steps(run_dir) -> list[int]:
    return [s for p in list_checkpoints(Path(run_dir) / "checkpoints") if (s := step_of(p)) is not None]


def test_stop_names_the_step_and_the_leaf(tiny_run_cfg, monkeypatch):
    _poison(monkeypatch, {3})
    cfg = _cfg(tiny_run_cfg, steps=6, nonfinite="stop")  # records every step, checkpoints every 2
    with pytest.raises(RunFailure, match=r"^step 3: the gradient of layers\.0\.attn\.wq holds a NaN or an inf; "
                                         r"stopped at step 3 \(--optim\.nonfinite stop\)") as e:  # fmt: skip
        trainer.train(cfg, progress=False)
    assert "continue from step 2" in str(e.value)  # the newest checkpoint, saved before the bad step
    assert max(_saved_steps(cfg.run_dir)) == 2


def test_skip_counts_skipped_steps_and_stops_after_three_in_a_row(tiny_run_cfg, monkeypatch):
    _poison(monkeypatch, {2, 4, 5, 6})  # one alone (skipped), then three in a row (the default max)
    cfg = attrs.evolve(_cfg(tiny_run_cfg, steps=8), log_every=4, ckpt_every=0)
    assert (cfg.optim.nonfinite, cfg.optim.max_nonfinite) == ("skip", 3)  # the defaults
    with pytest.raises(RunFailure, match=r"^steps 4-6 all had NaN or inf gradients \(--optim\.max-nonfinite 3\), "
                                         r"the first in layers\.0\.attn\.wq at step 4; stopped at step 8"):  # fmt: skip
        trainer.train(cfg, progress=False)
    records = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["nonfinite_steps"]) for r in records] == [(4, 2.0), (8, 4.0)]  # the skip count
    assert _saved_steps(cfg.run_dir) == []  # --ckpt-every 0: the end would have saved; the stop came first


def test_a_huge_init_stops_after_the_first_three_steps(tiny_run_cfg):
    cfg = _cfg(attrs.evolve(tiny_run_cfg, model=attrs.evolve(tiny_run_cfg.model, init_std=1e30)), steps=6)
    with pytest.raises(RunFailure, match=r"^steps 1-3 all had NaN or inf gradients .* stopped at step 3 "):
        trainer.train(cfg, progress=False)
    assert _saved_steps(cfg.run_dir) == [2]  # finite: the initial params, no update applied (2 skips, no halt yet)


def test_a_nonfinite_state_is_never_checkpointed(tiny_run_cfg, monkeypatch):
    _poison(monkeypatch, {3})
    cfg = _cfg(tiny_run_cfg, steps=6, nonfinite="off")  # "off": the NaN update is applied
    with pytest.raises(RunFailure, match=r"^step 4: param \S+ holds a NaN or an inf; no checkpoint is saved"):
        trainer.train(cfg, progress=False)
    assert max(_saved_steps(cfg.run_dir)) == 2  # not 4
    _, _, params, _, step = trainer.load_run(cfg.run_dir)  # the newest checkpoint holds finite params
    assert step == 2 and all(torch.isfinite(x).all() for x in tree.leaves(params))


def test_lr_1e6_from_the_cli_stops_with_one_line_and_status_2(tmp_path):
    corpus = tmp_path / "corpus.jsonl"  # small: the test is about the stop, not the data
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(200)))
    args = ["--recipe", "llama3-debug", "--model.n-layers", "2", "--data.seq-len", "64", "--data.batch-size", "8",
            "--steps", "30", "--compile", "False", "--optim.warmup", "2", "--optim.lr", "1e6", "--log-every", "5",
            "--data.corpus", str(corpus), "--data.vocab-size", "300", "--model.vocab-size", "300",
            "--checkpoint.backend", "sync", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ftitan", "train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    # not rc 0 with a NaN loss: a named stop (the steps, the first leaf) and the fix
    assert re.match(r"ftitan train: error: steps \d+-\d+ all had NaN or inf gradients .* the first in \S+ at step "
                    r"\d+; stopped at step \d+", lines[0]), lines  # fmt: skip
    assert "--optim.lr" in lines[0]


@pytest.mark.parametrize(
    ("flags", "culprit"),
    [
        (["--optim.nonfinite", "ignore"], "--optim.nonfinite='ignore': expected one of ('skip', 'stop', 'off')"),
        (["--optim.max-nonfinite", "0"], "--optim.max-nonfinite=0"),
        (["--parallel.timeout-s", "0"], "--parallel.timeout-s=0.0"),
        (["--parallel.timeout-s", "inf"], "--parallel.timeout-s=inf"),
    ],
    ids=["nonfinite", "max-nonfinite", "timeout-zero", "timeout-inf"],
)
def test_the_guard_and_timeout_flags_are_checked(flags, culprit):
    from ftitan.config import parse_train_args

    with pytest.raises(ValueError) as e:
        parse_train_args(["--recipe", "llama3-debug", *flags])
    assert str(e.value).startswith(culprit), str(e.value)
