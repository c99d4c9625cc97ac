"""ftitan's model class inside vLLM against vLLM's own implementation of the same architecture, against
native ``ft.infer.generate``, and vLLM's sampled-token logprobs against the trainer's recomputation.

Tolerance 1e-5 on fp32 logprobs: both sides compute the same function in fp32 with different
kernels (vLLM's paged CPU attention vs SDPA, fused vs unfused norms); measured gaps are ~2e-6.
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

import ftitan as ft
import ftitan.vllm as fv

LENGTHS = (3, 17, 40, 9)  # ragged: one batch mixes prefill lengths and decodes
TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def family(request: pytest.FixtureRequest) -> str:
    return request.param  # module-scoped: pytest runs each family's tests together, one engine build


def recomputed_logprobs(tiny, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
    """``log_softmax(apply(prompt + completion) / temperature)`` at each completion token: what a trainer
    computes for the policy's logprobs."""
    tokens = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits, _ = tiny.model.apply(tiny.params, tokens)  # (1, T, V)
    lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float() / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_greedy_matches_native_generate(tiny, engines, make_prompts, family):
    t = tiny(family)
    prompts = make_prompts(t.cfg.vocab_size, LENGTHS, seed=1)
    out = fv.complete(engines(family, "ftitan"), prompts, SamplingParams(max_tokens=10, temperature=0.0))
    assert [c.tokens for c in out] == ft.infer.generate(t.model, t.params, prompts, max_new_tokens=10)
    assert all(c.logprobs is None for c in out)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_sampled_logprobs_equal_trainer_recomputation(tiny, engines, make_prompts, family, temperature):
    """raw_logprobs: the model's own distribution whatever the sampling temperature."""
    t = tiny(family)
    prompts = make_prompts(t.cfg.vocab_size, LENGTHS, seed=2)
    sampling = SamplingParams(max_tokens=12, temperature=temperature, seed=3, logprobs=0)
    for prompt, c in zip(prompts, fv.complete(engines(family, "ftitan"), prompts, sampling), strict=True):
        expected = recomputed_logprobs(t, prompt, c.tokens)
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(expected), rtol=0, atol=TOL)


def test_greedy_tokens_and_logprobs_match_vllm_builtin(tiny, engines, make_prompts, family):
    prompts = make_prompts(tiny(family).cfg.vocab_size, LENGTHS)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    ours = fv.complete(engines(family, "ftitan"), prompts, greedy)
    ref = fv.complete(engines(family, "vllm"), prompts, greedy)
    assert [c.tokens for c in ours] == [c.tokens for c in ref]
    assert all(len(c.tokens) == 12 for c in ours)
    assert len({tuple(c.tokens) for c in ours}) == len(prompts)  # the prompts matter (not a constant model)
    torch.testing.assert_close(torch.tensor([c.logprobs for c in ours]), torch.tensor([c.logprobs for c in ref]),
                               rtol=0, atol=TOL)  # fmt: skip
    with pytest.raises(TypeError, match="not a ftitan model class"):  # vLLM's own class: nothing to push into
        fv.push_weights(engines(family, "vllm"), tiny(family).params)


def test_processed_logprobs_equal_tempered_recomputation(tiny, engines, make_prompts):
    """processed_logprobs: the distribution the token was sampled from, after temperature."""
    t = tiny("llama")
    prompts = make_prompts(t.cfg.vocab_size, LENGTHS, seed=4)
    sampling = SamplingParams(max_tokens=12, temperature=0.7, seed=5, logprobs=0)
    for prompt, c in zip(prompts, fv.complete(engines("llama", "processed"), prompts, sampling), strict=True):
        expected = recomputed_logprobs(t, prompt, c.tokens, temperature=0.7)
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(expected), rtol=0, atol=TOL)
        # and not the untempered ones: the test can tell the two modes apart
        untempered = recomputed_logprobs(t, prompt, c.tokens)
        assert max(abs(a - b) for a, b in zip(c.logprobs, untempered, strict=True)) > 1e-3


def test_prompt_embeddings_enter_the_same_layers(tiny, engines, make_prompts):
    """``forward(inputs_embeds=...)`` runs ``model.stage`` after the embedding: the same tokens as from ids."""
    t = tiny("llama")
    prompts = make_prompts(t.cfg.vocab_size, (5, 11), seed=6)
    llm = engines("llama", "embeds")
    embeds = [{"prompt_embeds": t.params["embed"][torch.tensor(p)]} for p in prompts]
    # ignore_eos: with embeddings vLLM stops at the HF config's default eos_token_id (2 for Llama)
    out = llm.generate(embeds, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    native = ft.infer.generate(t.model, t.params, prompts, max_new_tokens=8)
    assert [list(o.outputs[0].token_ids) for o in out] == native
