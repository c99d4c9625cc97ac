"""LoRA SFT on packed conversations under ``torchrun`` (FSDP 2 x TP 2, gloo) reproduces the single-process
run: the same losses (fp32, other summation orders: 1e-5) and the same adapters at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import ftitan as ft
from ftitan.train.trainer import load_run

from ._hf_chat import conversations, make_hf_chat_dir, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_lora_sft_under_fsdp_tp_matches_one_process(tmp_path):
    hf_dir, _ = make_hf_chat_dir(tmp_path / "hf", family="llama")
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(40))
    args = ["train", "--recipe", "sft", "--init.hf", str(hf_dir), "--data.chat", str(data), "--lora.rank", "4",
            "--data.seq-len", "48", "--data.batch-size", "4", "--steps", "3", "--optim.warmup", "0", "--optim.lr",
            "1e-2", "--log-every", "1", "--eval-every", "3", "--eval-batches", "1", "--compile", "False",
            "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    one = subprocess.run([sys.executable, "-m", "ftitan", *args, "--run-dir", str(tmp_path / "one")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    par = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
                          "ftitan", *args, "--parallel.dp-shard", "2", "--parallel.tp", "2", "--run-dir",
                          str(tmp_path / "par")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert par.returncode == 0, par.stderr[-4000:]
    ref, got = _losses(tmp_path / "one"), _losses(tmp_path / "par")
    assert len(got) == len(ref) == 3 and ref[-1] < ref[0]
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= 1e-5, (got, ref)
    # the checkpoints hold the same adapters (written by 4 ranks, read back whole) and the untouched base
    _, _, p_one, _, _ = load_run(tmp_path / "one")
    _, _, p_par, _, _ = load_run(tmp_path / "par")
    for a, b in zip(ft.tree.leaves(p_one), ft.tree.leaves(p_par), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
