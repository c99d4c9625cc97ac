"""Every model family's debug recipe trains through the real trainer (CLI parsing, data, compiled-or-not
step, metrics, checkpoint) with falling loss, MoE runs log their router load, and a run reloads from
its checkpoint into the right family. One subprocess runs all recipes (a launch costs seconds)."""

import json
import subprocess
import sys

import pytest

import ftitan as ft
from ftitan import config

# (the other zoo-II recipes train through the CLI in their own slow-tier tests)
RECIPES = ["qwen3-debug", "qwen3-moe-debug", "deepseek-v3-debug", "kimi-k2-debug", "qwen3.5-moe-debug"]
MOE = {"qwen3-moe-debug", "deepseek-v3-debug", "kimi-k2-debug", "qwen3.5-moe-debug"}

SCRIPT = """
import json, sys, torch
from ftitan.config import parse_train_args
from ftitan.train.trainer import train, load_run
corpus, root = sys.argv[1], sys.argv[2]
for name in sys.argv[3:]:
    cfg = parse_train_args([
        "--recipe", name, "--data.corpus", corpus, "--data.vocab-size", "384", "--model.vocab-size", "384",
        "--model.n-layers", "2", "--data.seq-len", "32", "--data.batch-size", "8", "--steps", "30", "--optim.warmup", "3",
        "--eval-every", "30", "--eval-batches", "1", "--log-every", "1", "--ckpt-every", "30", "--compile", "False",
        "--run-dir", f"{root}/{name}",
    ])
    out = train(cfg, progress=False)
    rcfg, model, params, tok, step = load_run(f"{root}/{name}")
    logits, _ = model.apply(params, torch.tensor([tok.encode("def f(x):")]))
    same = bool(torch.equal(params["embed"], out["params"]["embed"]))
    print(json.dumps({"name": name, "family": type(rcfg.model).__module__, "step": step, "same": same,
                      "finite": bool(torch.isfinite(logits).all())}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for _, d in zip(range(60), ft.data.stdlib_corpus())))
    script = root / "run.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(corpus), str(root), *RECIPES],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]  # the trainer prints evals too
    reloads = {r["name"]: r for r in map(json.loads, lines)}
    records = {n: [json.loads(x) for x in (root / n / "metrics.jsonl").read_text().splitlines()] for n in RECIPES}
    return reloads, records


@pytest.mark.parametrize("name", RECIPES)
def test_debug_recipe_trains_with_falling_loss(runs, name):
    _, records = runs
    losses = [r["loss"] for r in records[name] if "loss" in r]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_runs_log_router_load(runs, name):
    _, records = runs
    rec = [r for r in records[name] if "loss" in r]
    cfg = config.get_recipe(name).model
    for r in rec:
        load = r["moe.tokens_per_expert"]  # (L_moe, E)
        assert len(load[0]) == cfg.n_experts
        assert all(sum(row) == 8 * 32 * cfg.top_k for row in load)  # every token sent to top_k experts
        assert r["moe.max_load"] >= 1.0 and "moe.aux_loss" in r and r["ce_loss"] <= r["loss"] + 1e-6


@pytest.mark.parametrize("name", RECIPES)
def test_run_reloads_into_its_family(runs, name):
    reloads, _ = runs
    r = reloads[name]
    assert r["family"] == type(config.get_recipe(name).model).__module__
    assert r["step"] == 30 and r["same"] and r["finite"]
