"""The RL recipes do what they promise, from the command line (slow tier: minutes each on 2 cores)."""

from __future__ import annotations

import json
import math

import pytest

from ftitan.__main__ import main
from ftitan.config import get_recipe

pytestmark = pytest.mark.slow


def run(tmp_path, recipe, *extra):
    out = tmp_path / recipe
    assert main(["rl", "--recipe", recipe, "--run-dir", str(out), *extra]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], out


def test_grpo_arith_visibly_learns(tmp_path):
    records, out = run(tmp_path, "grpo-arith")
    rewards = [r["reward"] for r in records if "reward" in r]
    assert len(rewards) == get_recipe("grpo-arith").steps
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + 0.2, (first, last)
    assert (out / "reward.png").stat().st_size > 0


def test_grpo_moe_stays_near_its_reference(tmp_path):
    cfg = get_recipe("grpo-moe")
    records, _ = run(tmp_path, "grpo-moe")
    steps = [r for r in records if "loss" in r]
    assert len(steps) == cfg.steps >= 100
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    assert max(r["kl"] for r in steps) < cfg.rl.kl_bound


def test_grpo_tools_trains_multi_turn_episodes(tmp_path):
    records, _ = run(tmp_path, "grpo-tools", "--steps", "20", "--eval-every", "10")
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 20 and all(math.isfinite(r["loss"]) for r in steps)
    held = [r["eval.reward"] for r in records if "eval.reward" in r]
    assert held[0] >= 0.8  # the SFT stage taught the tool calls and to copy the fruit's name
    assert held[-1] >= held[0] - 0.2  # and RL keeps it
    assert sum(r["reward"] for r in steps) / 20 > 0.1  # sampled episodes solve it too, some of the time
    assert sum(r["response_length"] for r in steps) / 20 > 15  # several turns per episode
