"""``ftitan train`` with ``--data.preference``: DPO through the CLI, from scratch (``dpo-debug``) and as
LoRA over a tiny HF chat checkpoint made here.

At step 1 the policy is its reference, so every margin is 0 and the sigmoid loss is exactly log 2
(to float32 rounding, 1e-6): a check that the reference is the starting model and reaches the loss.
"""

from __future__ import annotations

import json
import math

import ftitan as ft
from ftitan.__main__ import main

from ._hf_chat import make_hf_chat_dir, write_jsonl

FAST = ["--compile", "False", "--device", "cpu", "--log-every", "1", "--eval-batches", "1"]


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_dpo_debug_learns_the_preference(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--recipe", "dpo-debug", "--run-dir", str(run), "--steps", "10", "--eval-every", "10",
                 "--model.n-layers", "1", *FAST]) == 0  # fmt: skip
    records = _records(run)
    assert records[0]["data.pairs"] > 0 and records[0]["data.truncated"] == 0
    steps = [r for r in records if "loss" in r]
    assert abs(steps[0]["loss"] - math.log(2)) <= 1e-6 and steps[0]["rewards/margin"] == 0.0
    assert steps[-1]["rewards/accuracy"] == 1.0 and steps[-1]["loss"] < 0.3
    assert [r["eval_loss"] for r in records if "eval_loss" in r][-1] < 0.3  # held-out pairs too


def test_lora_dpo_over_an_hf_checkpoint(tmp_path):
    hf_dir, _ = make_hf_chat_dir(tmp_path / "hf")
    pairs = [{"prompt": f"what is {w}", "chosen": f"{w} is red", "rejected": f"no {w}"}
             for w in ("cat", "dog", "sun", "moon", "one", "two", "three", "blue")]  # fmt: skip
    prefs = write_jsonl(tmp_path / "prefs.jsonl", pairs * 3)
    run = tmp_path / "run"
    args = ["--recipe", "sft", "--init.hf", str(hf_dir), "--data.chat", "", "--data.preference", str(prefs),
            "--lora.rank", "4", "--data.seq-len", "32", "--data.batch-size", "4", "--steps", "6", "--eval-every", "6",
            "--optim.lr", "5e-3", "--optim.warmup", "0", "--run-dir", str(run), *FAST]  # fmt: skip
    assert main(["train", *args]) == 0
    steps = [r for r in _records(run) if "loss" in r]
    assert abs(steps[0]["loss"] - math.log(2)) <= 1e-6  # the reference is the base with the adapters off
    assert steps[-1]["loss"] < steps[0]["loss"]
    from ftitan.models import hf
    from ftitan.train.trainer import load_run

    _, _, params, _, _ = load_run(run)
    _, base = hf.load_hf(hf_dir)
    assert all(bool((a == b).all()) for a, b in zip(ft.tree.leaves(params["base"]), ft.tree.leaves(base), strict=True))


def test_reference_free_and_bad_dpo_flags(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--recipe", "dpo-debug", "--run-dir", str(run), "--steps", "2", "--eval-every", "2",
                 "--model.n-layers", "1", "--optim.warmup", "0", "--dpo.reference-free", "True",
                 "--dpo.loss-type", "ipo",
                 *FAST]) == 0  # fmt: skip
    first = next(r for r in _records(run) if "loss" in r)
    assert abs(first["loss"] - math.log(2)) > 1e-3  # no reference: the random policy's own margins count
    assert main(["train", "--recipe", "dpo-debug", "--run-dir", str(tmp_path / "b"), "--dpo.loss-type", "kto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "ftitan train: error: --dpo.loss-type='kto': expected one of ('sigmoid', 'ipo')"
