"""No train step waits for the host: metrics are read back only on record steps.

A CUDA step that calls ``.item()`` stalls the GPU's queue every step. On the
CPU there is no queue to stall, so the check counts what would stall one: every
conversion of a tensor the step produced (params, optimizer state, metrics)
into a Python value (``item``, ``float``, ``int``, ``bool``, ``tolist``,
``numpy``, ``cpu``). With CUDA, ``torch.cuda.set_sync_debug_mode`` does the same.
"""

from __future__ import annotations

import functools
import json

import attrs
import pytest
import torch

import ftitan as ft
from ftitan.config.schema import DataConfig, OptimConfig, TrainConfig
from ftitan.models import llama
from ftitan.train import runtime, trainer

_CONVERSIONS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu")
_TAG = "_ftitan_step_output"


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    docs = [d for _, d in zip(range(40), ft.data.stdlib_corpus())]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _tag(tree):
    for x in ft.tree.leaves(tree):
        if isinstance(x, torch.Tensor):
            setattr(x, _TAG, True)


def test_compiled_loop_reads_back_only_on_record_steps(tmp_path, corpus, monkeypatch):
    seen: list[tuple[int, str]] = []
    current = {"step": 0}

    def counting(name, original):
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            if getattr(self, _TAG, False):
                seen.append((current["step"], name))
            return original(self, *args, **kwargs)

        return method

    for name in _CONVERSIONS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    make_step = runtime.Runtime.make_step

    def tagged_make_step(self, *args, **kwargs):
        step_fn = make_step(self, *args, **kwargs)

        def step(state, batch):
            current["step"] += 1
            state, metrics = step_fn(state, batch)
            _tag((state, metrics))
            return state, metrics

        return step

    monkeypatch.setattr(runtime.Runtime, "make_step", tagged_make_step)
    cfg = TrainConfig(
        recipe="tiny",
        model=attrs.evolve(llama.Config.debug(), dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=384),
        data=DataConfig(corpus=str(corpus), vocab_size=384, seq_len=32, batch_size=4),
        optim=OptimConfig(warmup=2),
        steps=7, log_every=3, eval_every=0, eval_batches=1, ckpt_every=0, compile=True, device="cpu",
        run_dir=str(tmp_path / "run"),
    )  # fmt: skip
    out = trainer.train(cfg, progress=False)
    assert [r["step"] for r in out["records"] if "loss" in r] == [3, 6, 7]
    steps_with_readback = sorted({s for s, _ in seen})
    assert steps_with_readback == [3, 6, 7], seen  # record steps (and the final eval + checkpoint) only
    assert {n for _, n in seen} >= {"__float__"}  # the check sees the record steps' readback
