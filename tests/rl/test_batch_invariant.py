"""The batch-invariant mode (``ftitan.config.batch_invariant``): the generator's log-prob of each sampled
token equals the trainer's recomputation bit for bit (``torch.equal``: the mismatch KL is exactly 0), for
a dense model and two MoE models (Qwen3-MoE; DeepSeek-V3 with MLA), at batch sizes 1, 3 and 16 with mixed prompt lengths, left or right padding,
prefill + decode against one forward over padded rows; a request gets the same tokens and log-probs
whatever the batch around it. Without the mode the two agree only to float32 rounding (so these tests
can fail), and a GRPO step trains under the mode, eager and compiled."""

from __future__ import annotations

import attrs
import pytest
import torch

import ftitan as ft
from ftitan.config import batch_invariant
from ftitan.models import deepseek_v3, llama, qwen3_moe
from ftitan.rl.rollout import rows_of
from ftitan.train.losses import IGNORE_INDEX

DENSE = attrs.evolve(llama.Config.debug(), vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                     max_seq_len=128, init_std=0.2)  # fmt: skip
MOE = attrs.evolve(qwen3_moe.Config.debug(), vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   n_experts=4, top_k=2, expert_dim=32, ffn_dim=128, max_seq_len=128, init_std=0.2)  # fmt: skip
# DeepSeek-V3: MLA, sigmoid group-limited routing with a balancing bias, a shared expert, a dense first layer
MLA_MOE = attrs.evolve(deepseek_v3.Config.debug(), vocab_size=300, dim=64, n_shared_experts=1, moe_ffn_dim=32,
                       ffn_dim=128, max_seq_len=128, init_std=0.2)  # fmt: skip
CONFIGS = pytest.mark.parametrize("cfg", [DENSE, MOE, MLA_MOE], ids=["llama", "qwen3_moe", "deepseek_v3"])
_g = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(1, 300, (int(n),), generator=_g).tolist() for n in torch.randint(1, 14, (16,), generator=_g)]


def _model(cfg):
    family = {llama.Config: llama, qwen3_moe.Config: qwen3_moe, deepseek_v3.Config: deepseek_v3}[type(cfg)]
    return family.model(cfg)


def _sample(model, params, prompts, **kw):
    return ft.infer.generate(model, params, prompts, max_new_tokens=8, sampling=ft.infer.Sampling(),
                             key=ft.random.key(3), logprobs=True, **kw)  # fmt: skip


def _trainer_and_generator(model, params, prompts, tokens, logprobs, width=None):
    """The trainer's log-probs of the sampled tokens (one forward over the padded rows) and the generator's."""
    batch = rows_of(prompts, tokens, logprobs, width=width)
    with torch.no_grad():
        want, _ = ft.rl.token_logprobs_and_entropy(model, params, batch["inputs"], batch["targets"])
    on = batch["targets"] != IGNORE_INDEX
    assert int(on.sum()) == sum(len(t) for t in tokens)
    return want[on], batch["gen_logp"][on]


@CONFIGS
def test_generator_logprobs_equal_the_trainers_bit_for_bit(cfg):
    model = _model(batch_invariant(cfg))
    params = model.init(ft.random.key(0))
    runs = {}
    for n in (1, 3, 16):
        tokens, lps = _sample(model, params, PROMPTS[:n])
        trainer, generator = _trainer_and_generator(model, params, PROMPTS[:n], tokens, lps)
        assert torch.equal(trainer, generator), n  # KL(generator || trainer) exactly 0
        runs[n] = tokens, lps
    # a request's tokens and log-probs do not depend on the batch around it
    for n in (1, 3):
        assert runs[16][0][:n] == runs[n][0] and runs[16][1][:n] == runs[n][1]
    # nor on the padding side, nor on how wide the trainer's rows are padded
    tokens, lps = _sample(model, params, PROMPTS, padding="right")
    assert (tokens, lps) == runs[16]
    widest = max(len(p) + len(t) for p, t in zip(PROMPTS, tokens, strict=True))
    trainer, generator = _trainer_and_generator(model, params, PROMPTS, tokens, lps, width=widest + 9)
    assert torch.equal(trainer, generator)


@CONFIGS
def test_without_the_mode_they_differ(cfg):
    model = _model(cfg)
    params = model.init(ft.random.key(0))
    tokens, lps = _sample(model, params, PROMPTS)
    trainer, generator = _trainer_and_generator(model, params, PROMPTS, tokens, lps)
    assert not torch.equal(trainer, generator)  # other summation orders ...
    assert (trainer - generator).abs().max() <= 1e-5  # ... to float32 rounding


@CONFIGS
def test_the_mode_computes_the_same_model(cfg):
    """The invariant ops change the rounding only: logits within 1e-4 of the default ops' (values of order 10)."""
    tokens = torch.tensor([PROMPTS[3][:5], PROMPTS[5][:5]])
    model, invariant = _model(cfg), _model(batch_invariant(cfg))
    params = model.init(ft.random.key(0))
    want, _ = model.apply(params, tokens)
    got, _ = invariant.apply(params, tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _grpo_batch(model, params):
    tokens, lps = _sample(model, params, PROMPTS[:6])
    batch = rows_of(PROMPTS[:6], tokens, lps)
    with torch.no_grad():
        old, _ = ft.rl.token_logprobs_and_entropy(model, params, batch["inputs"], batch["targets"])
    return {**batch, "old_logp": old, "advantages": torch.linspace(-1.0, 1.0, 6)}


@pytest.mark.parametrize("cfg", [DENSE, pytest.param(MOE, marks=pytest.mark.slow)], ids=["llama", "qwen3_moe"])
def test_a_grpo_step_trains_under_the_mode_eager_and_compiled(cfg):
    model, plain = _model(batch_invariant(cfg)), _model(cfg)
    params = model.init(ft.random.key(0))
    batch = _grpo_batch(model, params)
    assert torch.equal(batch["old_logp"], batch["gen_logp"])
    opt = ft.optim.adamw(1e-2, weight_decay=0.0)
    step = ft.train.make_train_step(ft.rl.grpo_loss_fn(model, tis_cap=2.0), opt)
    state, m = step(ft.train.init_state(params, opt), batch)
    assert float(m["mismatch_kl"]) == 0.0 and torch.isfinite(m["loss"])
    # the gradient of the default ops, to float32 rounding (gradients of order 1e-2; Adam's first step,
    # about lr * sign(g), would magnify the rounding of near-zero entries, so the gradients are compared)
    grads = [torch.func.grad(lambda p, m=m_: ft.rl.grpo_loss_fn(m, tis_cap=2.0)(p, batch)[0])(params)
             for m_ in (model, plain)]  # fmt: skip
    for a, e in zip(ft.tree.leaves(grads[0]), ft.tree.leaves(grads[1]), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    c_state, c_m = compiled(ft.train.init_state(params, opt), batch)
    assert float(c_m["mismatch_kl"]) == 0.0
    torch.testing.assert_close(c_m["loss"], m["loss"], rtol=1e-6, atol=0)
    for a, e in zip(ft.tree.leaves(c_state.params), ft.tree.leaves(state.params), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_inductor_compiled_trainer_and_generator_give_the_eager_bits():
    """Under inductor too (the trainer's compiled step, ``generate(compile=True)``): about 60 s of compiles.
    (A compiled GRPO step's ``mismatch_kl`` is exactly 0 as well: checked by hand, 90-140 s per model.)"""
    model = _model(batch_invariant(DENSE))
    params = model.init(ft.random.key(0))
    tokens, lps = _sample(model, params, PROMPTS)
    batch = rows_of(PROMPTS, tokens, lps)
    on = batch["targets"] != IGNORE_INDEX
    recompute = torch.compile(lambda p, i, t: ft.rl.token_logprobs_and_entropy(model, p, i, t)[0], fullgraph=True)
    with torch.no_grad():
        assert torch.equal(recompute(params, batch["inputs"], batch["targets"])[on], batch["gen_logp"][on])
    assert _sample(model, params, PROMPTS, compile=True) == (tokens, lps)
