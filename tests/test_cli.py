"""The ftitan command line, run as a user runs it."""

import json
import subprocess
import sys

import torch


def ftitan(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "ftitan", *args], capture_output=True, text=True, timeout=timeout)


def test_bad_settings_fail_before_any_work_naming_the_flag(tmp_path):
    out = ftitan("train", "--recipe", "llama3-debug", "--data.seq-len", "4096", "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 2 and "--data.seq-len=4096" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists()  # nothing was started
    out = ftitan("train", "--recipe", "llama3-debugg")
    assert out.returncode == 2 and "did you mean 'llama3-debug'" in out.stderr
    out = ftitan("generate", "--run", str(tmp_path / "missing"))
    assert out.returncode == 2 and "no config.json" in out.stderr


def test_train_then_generate_end_to_end(tmp_path):
    run = tmp_path / "run"
    out = ftitan(
        "train", "--recipe", "llama3-debug", "--run-dir", str(run), "--steps", "6", "--optim.warmup", "2", "--eval-every", "3",
        "--ckpt-every", "3", "--log-every", "1", "--compile", "False", "--model.n-layers", "1",
        "--data.seq-len", "64", "--data.batch-size", "4", "--data.vocab-size", "512", "--model.vocab-size", "512",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out loss" in out.stdout + out.stderr and "done: 6 steps" in out.stdout
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["n_layers"] == 1 and cfg["data"]["vocab_size"] == 512
    gen = ftitan("generate", "--run", str(run), "--prompt", "import ", "--n", "2", "--max-new-tokens", "8")
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert "at step 6" in gen.stdout and gen.stdout.count("--- sample") == 2
    assert gen.stdout.count("import ") >= 2  # each sample continues the prompt
    again = ftitan("generate", "--run", str(run), "--prompt", "import ", "--n", "2", "--max-new-tokens", "8",
                   "--device", "cpu")  # fmt: skip
    assert again.stdout == gen.stdout  # seeded sampling; auto is the CPU here
    if not torch.cuda.is_available():
        no_gpu = ftitan("generate", "--run", str(run), "--device", "cuda")
        assert no_gpu.returncode == 2 and "--device='cuda'" in no_gpu.stderr and "Traceback" not in no_gpu.stderr
    bad = ftitan("generate", "--run", str(run), "--top-p", "0")
    assert bad.returncode == 2 and "Sampling.top_p=0.0" in bad.stderr and "Traceback" not in bad.stderr
