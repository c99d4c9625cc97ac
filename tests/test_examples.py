"""The examples run as a user runs them, and they train."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# muon: slow (40 eager Muon steps, ~35 s); Muon's own tests are in tests/optim, and README's loop (the
# test below) trains with it compiled. The default tier runs AdamW with --kernels triton (oneDNN GEMMs on
# the CPU, the autograd path) and fused projections; plain ops train in README's loop below, so their run of
# this is slow tier, as is --float8 rowwise (tests/nn/test_float8.py trains float8 in the default tier).
SLOW = pytest.mark.slow


def _run(args: list[str], *, timeout: int, ranks: int = 0) -> str:
    """An example's stdout; a failed run fails with its stderr's tail. ``ranks``: launched on that many gloo
    ranks by torchrun (a thread each); an aborted rank prints its Python stacks (PYTHONFAULTHANDLER)."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    if ranks:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
        env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"rc {out.returncode}:\n{out.stderr[-4000:]}"
    return out.stdout


@pytest.mark.parametrize("optimizer, kernels, float8, attn, fuse", [("adamw", "triton", "", "gemm", True),
                                                                    pytest.param("adamw", "torch", "", "sdpa", False,
                                                                                 marks=SLOW),
                                                                    pytest.param("muon", "torch", "", "sdpa", False,
                                                                                 marks=SLOW),
                                                                    pytest.param("adamw", "torch", "rowwise", "sdpa",
                                                                                 False, marks=SLOW)])  # fmt: skip
def test_train_loop_example_trains(optimizer, kernels, float8, attn, fuse):
    out = _run([str(ROOT / "examples" / "train_loop.py"), "--steps", "40", "--optimizer", optimizer,
                "--kernels", kernels, "--float8", float8, "--attn-impl", attn, "--no-compile",
                *(["--fuse-projections"] if fuse else []),
                *(["--gemm-library", "aten"] if kernels == "triton" else [])], timeout=300)  # fmt: skip
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 5, out
    assert ("gemm libraries {'pinned': 'aten'}" in out) is (kernels == "triton"), out  # the flag reached the GEMMs
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5, out


def test_readme_training_loop_runs_as_written(tmp_path):
    """The 15-line loop in README.md, run verbatim but for its step count."""
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## A training loop in 15 lines", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 16, "the README loop grew past 15 lines"
    assert "range(200)" in code
    script = tmp_path / "loop.py"
    script.write_text(code.replace("range(200)", "range(3)"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.strip().splitlines()]
    assert [r[0] for r in rows] == ["0", "1", "2"], out.stdout
    losses = [float(r[1]) for r in rows]
    assert all(7.0 < x < 8.5 for x in losses), losses  # ln(2048) = 7.62 at init


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_moe_example_trains_and_reports_expert_load(family):
    out = _run([str(ROOT / "examples" / "moe_train.py"), "--family", family, "--steps", "31", "--no-compile"],
               timeout=300)
    rows = re.findall(r"loss (\d+\.\d+)  max_load (\d+\.\d+)  load \[([\d, ]+)\]", out)
    assert len(rows) == 4, out
    losses = [float(r[0]) for r in rows]
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5, out
    for _, max_load, load in rows:
        counts = [int(x) for x in load.split(",")]
        assert sum(counts) == 8 * 128 * 2  # every token of the batch went to top_k = 2 experts
        assert float(max_load) >= 1.0


def test_parallel_example_trains_on_four_ranks():
    out = _run([str(ROOT / "examples" / "parallel_train.py"), "--tp", "2", "--cp", "2", "--steps", "21"],
               timeout=600, ranks=4)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3, out
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5, out
    assert "Layout(cp=2, tp=2)" in out and "layers.0.attn.wq     (tp, -)" in out, out


def test_flexshard_example_trains_on_four_ranks():
    """examples/flexshard_train.py: int8 gathers, distributed Muon over BlockShard heads and Owned matrices."""
    out = _run([str(ROOT / "examples" / "flexshard_train.py"), "--steps", "21"], timeout=600, ranks=4)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3, out
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5, out
    assert "layers.0.mlp.w1      Owned      owner rank" in out and "BlockShard rows [64, 64, 64, 64]" in out, out


def test_vllm_example_generates_the_same_tokens_natively_and_in_vllm():
    out = _run([str(ROOT / "examples" / "vllm_generate.py"), "--max-new-tokens", "8"], timeout=600)
    assert "native == vllm: True" in out and "push_weights in" in out
    changed = re.search(r"after push: (\d+)/3 completions changed", out)
    assert changed and int(changed.group(1)) >= 1, out  # the pushed weights are the ones served


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_transforms_example_runs_and_checks_itself(family):
    """examples/transforms.py asserts each transform against a plain loop; here it runs as a user runs it."""
    out = _run([str(ROOT / "examples" / "transforms.py"), "--family", family], timeout=300)
    norms = re.search(r"per-example grad norms \[([\d., ]+)\]", out)
    assert norms and len(norms.group(1).split(",")) == 4, out
    assert "ensemble logits (4, 4, 16, 128)" in out, out
    vhv = re.search(r"v\^T H v = (-?\d+\.\d+)", out)
    assert vhv and float(vhv.group(1)) != 0.0, out
    assert re.search(r"filtered grad: \d+ attention weights of \d+ params", out), out


def test_finetune_hf_example_trains_and_saves_what_transformers_loads(tmp_path):
    out = _run([str(ROOT / "examples" / "finetune_hf.py"), "--steps", "20", "--workdir", str(tmp_path)], timeout=600)
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first - 0.2, out  # it trains on the JSONL with the checkpoint's own tokenizer
    assert float(re.search(r"logit difference\| vs ftitan (\S+)", out).group(1)) <= 1e-5
    config = (tmp_path / "run" / "tokenizer_config.json").read_text()
    assert '"</s>"' in config  # the run trained with the checkpoint's tokenizer, copied into its directory


def test_sft_lora_example_runs_all_three_steps():
    out = _run([str(ROOT / "examples" / "sft_lora.py"), "--sft-steps", "40", "--lora-steps", "5", "--dpo-steps", "12"],
               timeout=600)
    losses = {k: [float(x) for x in re.findall(rf"{k} step +\d+  loss (\d+\.\d+)", out)]
              for k in ("sft", "lora", "dpo")}  # fmt: skip
    assert losses["sft"][-1] < losses["sft"][0] - 2.0, out  # SFT learns the task's text
    assert losses["lora"][-1] < losses["lora"][0], out  # the adapters alone keep lowering it
    assert losses["dpo"][-1] < losses["dpo"][0], out  # and DPO moves toward the preferred style
    parse = [float(x) for x in re.findall(r"parse rate (\d\.\d+)", out)]
    assert parse[0] == 0.0 and parse[1] > 0.5, out  # the untrained model's answers never parse


def test_grpo_example_raises_the_reward():
    out = _run([str(ROOT / "examples" / "grpo.py"), "--rl-steps", "40", "--no-compile"], timeout=600)
    rewards = [float(x) for x in re.findall(r"reward (\d+\.\d+)", out)]
    assert len(rewards) == 40 and "sft: 70 steps" in out, out
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.1, out  # GRPO visibly learns


@pytest.mark.slow
def test_hybrid_example_trains_and_generates_through_the_recurrent_cache():
    """examples/hybrid_generate.py: Qwen3.5 trains, its cache holds conv + delta-rule state for the Gated
    DeltaNet layers, generation runs, and prefill + decode equal the full forward."""
    out = _run([str(ROOT / "examples" / "hybrid_generate.py"), "--steps", "30", "--no-compile"], timeout=600)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5, out
    assert out.count("(Gated DeltaNet) keeps conv") == 3 and "(attention) keeps k" in out, out
    assert float(re.search(r"max \|logit diff\| (\S+)", out).group(1)) <= 1e-5, out
