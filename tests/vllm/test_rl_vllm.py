"""``ftitan rl --rl.generator vllm``: the RL loop samples with the in-process vLLM engine running the same pure
model, its weights pushed before every step; in the batch-invariant mode the engine's log-probs of the
sampled tokens are the trainer's bit for bit (mismatch KL exactly 0), without it they agree to rounding."""

from __future__ import annotations

import pytest

from ftitan.config import parse_train_args
from ftitan.rl.loop import rl_train

COMMON = ["--recipe", "grpo-arith", "--compile", "False", "--rl.eval-prompts", "0", "--optim.warmup", "1",
          "--rl.prompts", "4", "--model.n-heads", "4", "--model.n-kv-heads", "2"]  # fmt: skip (head_dim 32: vLLM CPU)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A short SFT warm start (its own tokenizer and chat template)."""
    run = tmp_path_factory.mktemp("rl-vllm") / "warm"
    rl_train(parse_train_args([*COMMON, "--rl.sft-steps", "10", "--steps", "1", "--run-dir", str(run)], rl=True),
             progress=False)
    return run / "sft"


def run_with_vllm(tmp_path, warm, *extra):
    cfg = parse_train_args([*COMMON, "--rl.init-run", str(warm), "--rl.sft-steps", "0", "--steps", "2",
                            "--run-dir", str(tmp_path / "run"), "--rl.generator", "vllm", *extra], rl=True)  # fmt: skip
    return [r for r in rl_train(cfg, progress=False)["records"] if "loss" in r]


def test_vllm_generator_in_the_batch_invariant_mode_matches_the_trainer_bit_for_bit(tmp_path, warm, engines):
    engines("llama", "none")  # one in-process engine at a time: the loop builds its own
    steps = run_with_vllm(tmp_path, warm, "--rl.batch-invariant", "True")
    assert len(steps) == 2 and all(r["response_length"] > 0 for r in steps)
    assert [r["mismatch_kl"] for r in steps] == [0.0, 0.0]


@pytest.mark.slow
def test_vllm_generator_without_the_mode_agrees_to_rounding(tmp_path, warm, engines):
    engines("llama", "none")
    steps = run_with_vllm(tmp_path, warm)
    kls = [r["mismatch_kl"] for r in steps]
    assert all(abs(k) < 1e-6 for k in kls) and any(k != 0.0 for k in kls)
