"""``muse-glimmer-debug`` trains through ``ftitan train`` (CLI parsing, data, step, metrics, checkpoint) with
falling loss, and the run reloads into the family. Shrunk by flags (2 layers, vocab 384, 32-token rows, an
8-token window so the sliding layer slides); still ~45 s of CPU (80 s wall on a shared 2-core machine), so
it is in the slow tier; ``tests/models/test_muse_glimmer.py`` trains the debug model in-process by default."""

import json
import subprocess
import sys

import pytest
import torch

import ftitan as ft
from ftitan.models import muse_glimmer
from ftitan.train.trainer import load_run


@pytest.mark.slow
def test_debug_recipe_trains_through_the_cli(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for _, d in zip(range(60), ft.data.stdlib_corpus())))
    run = tmp_path / "run"
    args = ["--recipe", "muse-glimmer-debug", "--data.corpus", str(corpus), "--data.vocab-size", "384",
            "--model.vocab-size", "384", "--model.n-layers", "2", "--model.window", "8", "--data.seq-len", "32",
            "--data.batch-size", "8", "--steps", "20", "--optim.warmup", "3", "--eval-every", "20",
            "--eval-batches", "1", "--log-every", "1", "--ckpt-every", "20", "--compile", "False",
            "--run-dir", str(run)]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "ftitan", "train", *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    cfg, model, params, tok, step = load_run(run)
    assert isinstance(cfg.model, muse_glimmer.Config) and cfg.model.windows == (8, None) and step == 20
    logits, _ = model.apply(params, torch.tensor([tok.encode("def f(x):")]))
    assert torch.isfinite(logits).all() and logits.abs().max() <= cfg.model.logit_softcap
