"""``ftitan rl``: the GRPO loop from the command line (smoke run, metrics, reward.png), bit-identical resume
in synchronous mode, async mode's accounting of every rollout across a resume, and one-line refusals."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
from pathlib import Path

import pytest
import torch

from ftitan.__main__ import main
from ftitan.config import parse_train_args
from ftitan.rl.loop import rl_train

FAST = ["--rl.eval-prompts", "20", "--compile", "False", "--optim.warmup", "1"]
STEP_KEYS = {"loss", "reward", "reward_std", "response_length", "clip_fraction", "entropy", "mismatch_kl",
             "gen_tokens_per_s", "train_tokens_per_s", "grad_norm", "rl.lag"}  # fmt: skip


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """``ftitan rl --recipe grpo-arith`` for 6 steps, its SFT stage included, each compiled by regions (each
    block compiled once for its layers: ~50 s less cold compiling than whole steps here; whole compiled GRPO
    steps are checked in tests/rl/test_losses.py and test_batch_invariant.py): the run directory."""
    run = tmp_path_factory.mktemp("rl") / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["rl", "--recipe", "grpo-arith", "--steps", "6", "--optim.warmup", "2", "--run-dir", str(run),
                     "--eval-every", "3", "--rl.eval-prompts", "20", "--compile", "regional"]) == 0  # fmt: skip
    assert "done: 6 RL steps" in out.getvalue() and "held-out reward" in out.getvalue()
    return run


def test_grpo_arith_smoke_from_the_cli(smoke, capsys):
    run = smoke
    assert main(["rl", "--recipe", "grpo-arith", "--steps", "4", "--optim.warmup", "2", "--run-dir", str(run),
                 "--resume"]) != 0
    assert "already at step 6" in capsys.readouterr().err
    steps = [r for r in records(run) if "reward" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert all(STEP_KEYS <= r.keys() for r in steps)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    assert all(r["mismatch_kl"] < 1e-6 for r in steps)  # the generator is the trainer's own model
    assert [r["step"] for r in records(run) if "eval.reward" in r] == [0, 3, 6]
    assert (run / "reward.png").stat().st_size > 0 and any((run / "tensorboard").iterdir())
    assert (run / "sft" / "checkpoints").is_dir() and (run / "tokenizer.json").is_file()
    # the run directory is an ordinary one: ftitan generate reads its newest checkpoint
    assert main(["generate", "--run", str(run), "--prompt", "<|user|>\nSort the digits: 3 1 2<|end|>\n<|assistant|>\n",
                 "--max-new-tokens", "8"]) == 0  # fmt: skip


def cfg_for(run: Path, warm: Path, *extra: str):
    """From the smoke run's SFT stage (--rl.init-run): no SFT stage of its own."""
    return parse_train_args(["--run-dir", str(run), "--rl.init-run", str(warm / "sft"), "--rl.sft-steps", "0", *FAST,
                             *extra], rl=True)  # fmt: skip


def test_synchronous_resume_is_bit_identical(tmp_path, smoke):
    whole = rl_train(cfg_for(tmp_path / "a", smoke, "--steps", "4", "--ckpt-every", "2"), progress=False)
    rl_train(cfg_for(tmp_path / "b", smoke, "--steps", "2", "--ckpt-every", "2"), progress=False)
    resumed = rl_train(cfg_for(tmp_path / "b", smoke, "--steps", "4", "--ckpt-every", "2"), resume=True,
                       progress=False)  # fmt: skip
    assert resumed["start_step"] == 2
    a = [r for r in records(tmp_path / "a") if "loss" in r]
    b = [r for r in records(tmp_path / "b") if "loss" in r]
    keys = ("loss", "reward", "grad_norm", "entropy", "response_length")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    for x, y in zip(torch.utils._pytree.tree_leaves(whole["params"]), torch.utils._pytree.tree_leaves(resumed["params"]),
                    strict=True):  # fmt: skip
        assert torch.equal(x, y)


def test_async_loses_and_reuses_no_rollout_across_a_resume_thread_then_process(tmp_path, smoke):
    run = tmp_path / "run"
    first = rl_train(cfg_for(run, smoke, "--steps", "4", "--ckpt-every", "2", "--rl.max-offpolicy-steps", "1"),
                     progress=False)  # fmt: skip
    # resumed with the generator in a separate process (a cluster's layout): its queue carries over as well
    second = rl_train(cfg_for(run, smoke, "--steps", "7", "--ckpt-every", "2", "--rl.max-offpolicy-steps", "1",
                              "--rl.worker", "process"), resume=True, progress=False)  # fmt: skip
    assert second["start_step"] == 4
    for out in (first, second):
        lags = [r["rl.lag"] for r in out["records"] if "rl.lag" in r]
        assert max(lags) <= 1
    l1, l2 = first["ledger"], second["ledger"]
    trained = l1.trained_ids + l2.trained_ids
    assert len(trained) == len(set(trained)) == 7 * 8 * 8  # every step trained P * G distinct rollouts
    assert not set(trained) & set(l1.dropped_ids + l2.dropped_ids)
    # what the first run made and did not train or drop was in its last checkpoint's queue: the resumed run
    # trained those first (it was restored with them), so nothing the first made is unaccounted for
    carried = l1.made_ids - set(l1.trained_ids) - set(l1.dropped_ids)
    assert carried and carried <= set(l2.trained_ids) | set(l2.dropped_ids)
    assert l2.trained_ids[: len(carried)] == sorted(carried)


@pytest.mark.parametrize(("argv", "needle"), [
    (["rl", "--recipe", "llama3-debug"], "is not an RL run"),
    (["train", "--recipe", "grpo-arith"], "run it with `ftitan rl`"),
    (["rl", "--rl.env", "nope"], "--rl.env='nope': no such environment"),
    (["rl", "--rl.sft-steps", "0"], "RL starts from a policy"),
    (["rl", "--rl.init-run", "/nonexistent"], "no run directory with checkpoints there"),
    (["rl", "--rl.compile-generator", "tvm"], "--rl.compile-generator='tvm': expected 'inductor'"),
    (["rl", "--rl.compile-generator", "inductor", "--rl.generator", "vllm"], "vLLM compiles its own"),
])  # fmt: skip
def test_bad_rl_input_is_one_line(argv, needle, capsys):
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_batch_invariant_runs_have_no_generator_trainer_mismatch(tmp_path, smoke):
    out = rl_train(cfg_for(tmp_path / "inv", smoke, "--steps", "2", "--rl.batch-invariant", "True"), progress=False)
    assert out["model"].config.attn_impl == "batch_invariant"
    steps = [r for r in out["records"] if "loss" in r]
    assert [r["mismatch_kl"] for r in steps] == [0.0, 0.0]  # the generator's log-probs are the trainer's, bit for bit
    default = [r["mismatch_kl"] for r in records(smoke) if "mismatch_kl" in r]
    assert any(m != 0.0 for m in default)  # without the mode they differ in the last bits


def test_a_compiled_generator_keeps_the_trainers_bits(tmp_path, smoke):
    """--rl.compile-generator: the decode steps compiled (aot_eager here: a fast compile), the same bits."""
    generate_module = importlib.import_module("ftitan.infer.generate")  # (ftitan.infer.generate: the function)
    before = set(generate_module._STEPS)
    out = rl_train(cfg_for(tmp_path / "c", smoke, "--steps", "2", "--rl.batch-invariant", "True",
                           "--rl.compile-generator", "aot_eager", "--rl.eval-prompts", "0"), progress=False)  # fmt: skip
    made = {key for key in set(generate_module._STEPS) - before if key[1] == "aot_eager"}
    assert made and all(generate_module._STEPS[key][0] is out["model"].apply for key in made)
    assert [r["mismatch_kl"] for r in out["records"] if "loss" in r] == [0.0, 0.0]
