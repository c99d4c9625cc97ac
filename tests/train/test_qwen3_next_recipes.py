"""``qwen3.5-debug``, ``qwen3.5-moe-debug`` and ``qwen3-next-debug`` train through ``ftitan train`` (CLI
parsing, data, step, metrics, checkpoint) with falling loss, and each run reloads into the family and
generates through its hybrid cache. Shrunk by flags (2 layers: one Gated DeltaNet, one gated attention;
vocab 384, 32-token rows); ~40 s each on 2 cores, so in the slow tier: ``tests/models/test_qwen3_next.py``
trains and compiles the debug model in-process by default."""

import json
import subprocess
import sys

import pytest

import ftitan as ft
from ftitan.models import qwen3_next
from ftitan.train.trainer import load_run


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["qwen3.5-debug", "qwen3.5-moe-debug", "qwen3-next-debug"])
def test_debug_recipe_trains_through_the_cli(recipe, tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for _, d in zip(range(60), ft.data.stdlib_corpus())))
    run = tmp_path / "run"
    args = ["--recipe", recipe, "--data.corpus", str(corpus), "--data.vocab-size", "384",
            "--model.vocab-size", "384", "--model.n-layers", "2", "--model.attention-every", "2",
            "--data.seq-len", "32", "--data.batch-size", "8", "--steps", "20", "--optim.warmup", "3",
            "--eval-every", "20", "--eval-batches", "1", "--log-every", "1", "--ckpt-every", "20",
            "--compile", "False", "--run-dir", str(run)]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "ftitan", "train", *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    cfg, model, params, tok, step = load_run(run)
    assert isinstance(cfg.model, qwen3_next.Config) and cfg.model.attention_layers == (1,) and step == 20
    out = ft.infer.generate(model, params, [tok.encode("def f(x):"), tok.encode("import")], max_new_tokens=4)
    alone = [ft.infer.generate(model, params, [tok.encode(p)], max_new_tokens=4)[0] for p in ("def f(x):", "import")]
    assert out == alone
