"""``push_weights``: train a few steps, push, and vLLM generates what native generation does with the
new weights, cached prefixes included; a tree that does not fit the engine is refused, copying nothing."""

from __future__ import annotations

import time

import attrs
import pytest
import torch
from vllm import SamplingParams

import ftitan as ft
import ftitan.vllm as fv
from ftitan.train import IGNORE_INDEX, init_state, make_train_step, next_token_loss

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    return [c.tokens for c in fv.complete(llm, prompts, GREEDY)]


def trained(model, params, prompt: list[int], target: int, steps: int) -> tuple[dict, list[float]]:
    """``params`` after ``steps`` AdamW steps teaching ``prompt -> target target ...`` (loss on the
    completion only), and the losses."""
    seq = torch.tensor([prompt + [target] * 8])
    targets = seq[:, 1:].clone()
    targets[:, : len(prompt) - 1] = IGNORE_INDEX
    batch = {"inputs": seq[:, :-1], "targets": targets}
    opt = ft.optim.adamw(3e-2, weight_decay=0.0)
    step = make_train_step(next_token_loss(model), opt)
    state, losses = init_state(params, opt), []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state.params, losses


@pytest.fixture(scope="module")
def setup(tiny, engines, make_prompts):
    t = tiny("llama")
    # 200 tokens: more than one 128-token KV block, so vLLM's prefix cache holds part of it
    long, short = make_prompts(t.cfg.vocab_size, (200, 5), seed=7)
    return t, engines("llama", "sync"), [long, short]


def test_push_after_training_matches_native_generation(setup):
    t, llm, prompts = setup
    before = greedy(llm, prompts)  # also puts the long prompt's blocks in the prefix cache
    assert before == ft.infer.generate(t.model, t.params, prompts, max_new_tokens=8)
    target = next(x for x in range(t.cfg.vocab_size) if x != before[0][0])
    params, losses = trained(t.model, t.params, prompts[0], target, steps=4)
    assert losses[-1] < losses[0] - 1.0, losses

    start = time.perf_counter()
    fv.push_weights(llm, params)
    print(f"push_weights: {1e3 * (time.perf_counter() - start):.1f} ms")
    after = greedy(llm, prompts)
    assert after == ft.infer.generate(t.model, params, prompts, max_new_tokens=8)
    assert after[0][0] == target  # the step taught the long prompt its continuation
    assert after != before


def test_prefix_cache_is_reset_by_push(setup):
    """Control: the same copy without the reset reuses the long prompt's stale KV (so the reset matters)."""
    t, llm, prompts = setup
    greedy(llm, prompts)  # the long prompt's blocks are cached under the current weights
    new = ft.tree.map(lambda x: x * 1.5, t.params)  # far from every weight the engine held before
    expected = ft.infer.generate(t.model, new, prompts, max_new_tokens=8)
    llm.apply_model(lambda model: model.copy_params_(new))
    stale = greedy(llm, prompts)
    assert stale[1] == expected[1]  # short prompt: nothing cached, new weights used
    assert stale[0] != expected[0]  # long prompt: its cached prefix still holds the old keys/values
    fv.push_weights(llm, new)  # copies the same values again, and resets the prefix cache
    assert greedy(llm, prompts) == expected


def test_vllm_reload_weights_from_hf_names_lands_in_the_fused_parameters(setup):
    """vLLM's own reload path (HF-named tensors through ``load_weights``) also updates what the model
    runs: q/k/v and gate/up pieces join into the fused parameters, packed GEMMs are rebuilt."""
    t, llm, prompts = setup
    new = ft.tree.map(lambda x: x * 0.7, t.params)
    weights = ft.models.hf.to_hf(new, t.cfg)
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(weights.items()),
                                                     is_checkpoint_format=True))  # fmt: skip
    llm.reset_prefix_cache()
    assert greedy(llm, prompts) == ft.infer.generate(t.model, new, prompts, max_new_tokens=8)
    fv.push_weights(llm, t.params)  # back to the module's weights for the other tests


def test_mismatched_params_are_refused_and_nothing_is_copied(setup):
    t, llm, prompts = setup
    fv.push_weights(llm, t.params)
    before = greedy(llm, prompts)
    missing = {k: v for k, v in t.params.items() if k != "head"}
    with pytest.raises(ValueError, match=r"missing \[head\]"):
        fv.push_weights(llm, missing)
    wide = ft.tree.map(lambda x: x, t.params)
    wide["layers"]["1"]["mlp"]["w1"] = torch.zeros(300, t.cfg.dim)
    wide["embed"] = wide["embed"] * 2  # comes before the bad leaf: must not be copied either
    with pytest.raises(ValueError, match=r"misshapen \[layers\.1\.mlp\.w1 \(300, 128\) \(engine \(256, 128\)\)\]"):
        fv.push_weights(llm, wide)
    deeper = ft.models.llama.model(attrs.evolve(t.cfg, n_layers=3)).init(ft.random.key(0))
    with pytest.raises(ValueError, match=r"unexpected \[layers\.2\..*\]"):
        fv.push_weights(llm, deeper)
    assert greedy(llm, prompts) == before

