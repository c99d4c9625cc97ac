"""An ftitan run directory as the engine's source: its newest checkpoint and its tokenizer, so vLLM
takes text prompts and generates what native generation does from the same checkpoint."""

from __future__ import annotations

import json

import pytest
from vllm import SamplingParams

import ftitan as ft
import ftitan.vllm as fv
from ftitan.config import parse_train_args
from ftitan.train.trainer import load_run, train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for _, d in zip(range(40), ft.data.stdlib_corpus())))
    cfg = parse_train_args([
        "--recipe", "llama3-debug", "--data.corpus", str(corpus), "--data.vocab-size", "384",
        "--model.vocab-size", "384", "--model.n-layers", "2", "--data.seq-len", "32", "--data.batch-size", "4",
        "--steps", "2", "--optim.warmup", "1", "--eval-every", "2", "--eval-batches", "1", "--log-every", "1",
        "--ckpt-every", "2", "--compile", "False", "--run-dir", str(root / "llama"),
    ])  # fmt: skip
    train(cfg, progress=False)  # ~3 s
    return root / "llama"


def test_run_directory_generates_from_text_like_native(run_dir, engines):
    engines("llama", "none")  # close the session's live engine: one in-process engine at a time
    _, model, params, tok, step = load_run(run_dir)
    assert step == 2
    llm = fv.engine(run_dir, dtype="float32", kv_cache_bytes=64 << 20)
    try:
        text = "def f(x):\n    return"
        out = llm.generate([text], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)[0]
        assert list(out.prompt_token_ids) == tok.encode(text)
        native = ft.infer.generate(model, params, [tok.encode(text)], max_new_tokens=10, eos_id=tok.eos_id)[0]
        assert list(out.outputs[0].token_ids) == native
        assert out.outputs[0].text == tok.decode(native)
    finally:
        fv.close(llm)
