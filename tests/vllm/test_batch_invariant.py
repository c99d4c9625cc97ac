"""vLLM in the batch-invariant mode (``ftitan.vllm.engine((model, params))`` of a model in
``ftitan.config.batch_invariant``'s mode): each sampled token's log-prob equals the trainer's recomputation
bit for bit (``torch.equal``), at batch sizes 1, 3 and 16 with ragged prompts, and a request gets the same
tokens and log-probs whatever runs beside it. The default engine agrees only to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

import ftitan as ft
import ftitan.vllm as fv
from ftitan.config import batch_invariant
from ftitan.models import hf
from ftitan.rl.rollout import rows_of
from ftitan.train.losses import IGNORE_INDEX

KV_BYTES = 64 << 20


def _trainer_and_engine(model, params, prompts, completions):
    tokens, lps = [c.tokens for c in completions], [c.logprobs for c in completions]
    batch = rows_of(prompts, tokens, lps)
    with torch.no_grad():
        want, _ = ft.rl.token_logprobs_and_entropy(model, params, batch["inputs"], batch["targets"])
    on = batch["targets"] != IGNORE_INDEX
    return want[on], batch["gen_logp"][on]


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_engine_logprobs_equal_the_trainers_bit_for_bit(tiny, engines, make_prompts, family):
    t = tiny(family)
    prompts = make_prompts(t.cfg.vocab_size, (5, 17, 1, 40, 9, 23, 3, 31, 12, 2, 8, 27, 14, 6, 35, 19), seed=3)
    sampling = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, logprobs=0) for i in range(len(prompts))]
    # the default engine: other kernels, other summation orders (so the equality below can fail)
    default = fv.complete(engines(family, "ftitan"), prompts, sampling)
    trainer, engine = _trainer_and_engine(t.model, t.params, prompts, default)
    assert not torch.equal(trainer, engine) and (trainer - engine).abs().max() <= 1e-5
    engines(family, "none")  # one in-process engine at a time
    model = hf.family_of(t.cfg).model(batch_invariant(t.cfg))
    llm = fv.engine((model, t.params), dtype="float32", kv_cache_bytes=KV_BYTES)
    try:
        runs = {}
        for n in (1, 3, 16):
            out = fv.complete(llm, prompts[:n], sampling[:n])
            trainer, engine = _trainer_and_engine(model, t.params, prompts[:n], out)
            assert torch.equal(trainer, engine), n  # KL(engine || trainer) exactly 0
            runs[n] = out
        assert runs[16][:3] == runs[3] and runs[16][:1] == runs[1]
    finally:
        fv.close(llm)
