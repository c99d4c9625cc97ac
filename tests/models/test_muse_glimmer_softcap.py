"""Muse Glimmer's logit soft-cap (``cap * tanh(z / cap)``, ``Model.logit_softcap``) in every consumer of
``apply(..., logits=False)`` + ``head``: the training loss (against transformers' own loss and gradients),
the fused and plain cross-entropy paths, RL/DPO log-probs (and the batch-invariant generator's, bit for
bit), and vLLM's refusal of the family.

The configs are tiny and random with a head whose logits reach well into the tanh's bend (|z| up to
~0.9 cap at cap 2), so a consumer that skipped the cap would be off by ~0.1 in the loss, far outside
the tolerances. Tolerances (float32): the loss and log-probs 1e-5 absolute, as the family's logits parity
(measured <= 5e-7); gradients 1e-5 relative to the largest one (:func:`rel_diff`). The largest is the
embedding's (~6 for the loss, ~200 for the randomly weighted log-probs): the weight-less embedding norm
divides by the rms of a 0.02-std table, so float32 rounding of the residual stream (~3e-5 absolute there,
see test_muse_glimmer.py) reaches it amplified. Measured: vs transformers 5.5e-6, fused vs plain and vs
``torch.func.grad`` <= 8.5e-7.
"""

import attrs
import pytest
import torch
import torch.nn.functional as F
import transformers

import ftitan as ft
from ftitan import random, tree
from ftitan.config import batch_invariant
from ftitan.models import hf, muse_glimmer
from ftitan.rl.rollout import rows_of
from ftitan.train.losses import IGNORE_INDEX

ATOL = 1e-5
CFG = muse_glimmer.Config(vocab_size=96, dim=64, n_layers=5, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=80,
                          window=4, max_seq_len=128, output_multiplier=0.7, logit_softcap=2.0)  # fmt: skip


def hf_model(cfg, seed=0):
    """``MuseGlimmerForConditionalGeneration`` (tiny vision tower), centered norms off 0, a head reaching the cap."""
    text = {k: v for k, v in hf.config_to_hf(cfg)["text_config"].items() if k != "model_type"}
    text = transformers.MuseGlimmerTextConfig(**text, bos_token_id=None, eos_token_id=None)
    hcfg = transformers.MuseGlimmerConfig(text_config=text.to_dict(), out_hidden_size=128, projector_hidden_size=32,
                                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                             num_attention_heads=2))  # fmt: skip
    torch.manual_seed(seed)
    m = transformers.MuseGlimmerForConditionalGeneration._from_config(hcfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.15 if name == "lm_head.weight" else 0.02))
    return m.eval()


def batch_for(cfg, b=2, t=20, seed=1):
    """Next-token rows with a few ignored targets; also the HF ``labels`` (unshifted) of the same tokens."""
    tok = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    targets = tok[:, 1:].clone()
    targets[0, :3] = IGNORE_INDEX
    labels = tok.clone()
    labels[:, 1:] = targets
    return {"inputs": tok[:, :-1], "targets": targets}, tok, labels


def rel_diff(got, want) -> float:
    """Largest absolute difference of two gradient trees (or leaf lists) over the largest gradient of ``want``."""
    pairs = list(zip(tree.leaves(got), tree.leaves(want), strict=True))
    return max(float((a - b).abs().max()) for a, b in pairs) / max(float(b.abs().max()) for _, b in pairs)


@pytest.fixture(scope="module")
def setup():
    hm = hf_model(CFG)
    params = hf.from_hf(hm.state_dict(), CFG)  # the live module's names: model.language_model.*, vision towers
    return hm, muse_glimmer.model(CFG), params


@pytest.mark.parametrize("fused", [True, False])
def test_training_loss_and_grads_equal_transformers(setup, fused):
    hm, model, params = setup
    batch, tokens, labels = batch_for(CFG)
    hm.zero_grad()
    out = hm(input_ids=tokens, labels=labels)  # transformers' loss: its soft-capped logits, shifted labels
    out.loss.backward()
    assert out.logits.abs().max() > 0.8 * CFG.logit_softcap  # deep in the tanh's bend
    loss_fn = ft.train.next_token_loss(model, chunk_size=7, fused=fused)
    grads, (loss, _) = ft.train.value_and_grad(loss_fn)(params, batch)
    assert abs(float(loss.detach()) - float(out.loss.detach())) <= ATOL
    want = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE_INDEX)
    assert abs(float(loss.detach()) - float(want.detach())) <= ATOL
    # every gradient against transformers' autograd, matched by name (to_hf exports the multimodal names)
    hf_grads = {n: p.grad for n, p in hm.named_parameters() if p.grad is not None}
    ours = hf.to_hf(grads, CFG)
    assert set(ours) == {n for n in hf_grads if not n.startswith("model.vision")}
    assert rel_diff([ours[n] for n in ours], [hf_grads[n] for n in ours]) <= ATOL
    # the uncapped loss is ~0.1 away: a consumer that skipped the cap would fail above
    h, _ = model.apply(params, batch["inputs"], logits=False)
    with torch.no_grad():
        uncapped = ft.train.chunked_cross_entropy(h.flatten(0, 1), model.head(params), batch["targets"].flatten())
    assert abs(float(uncapped) - float(out.loss.detach())) > 5e-2


def test_fused_grads_equal_plain_path_and_torch_func_grad_of_the_formula(setup):
    _, model, params = setup
    batch, _, _ = batch_for(CFG, seed=2)
    fused, _ = ft.train.value_and_grad(ft.train.next_token_loss(model, chunk_size=7))(params, batch)
    plain, _ = ft.train.value_and_grad(ft.train.next_token_loss(model, chunk_size=7, fused=False))(params, batch)

    def formula(p):  # the capped logits of apply, then F.cross_entropy
        z, _ = model.apply(p, batch["inputs"])
        return F.cross_entropy(z.flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE_INDEX)

    want = torch.func.grad(formula)(params)
    assert rel_diff(fused, want) <= ATOL and rel_diff(plain, want) <= ATOL and rel_diff(fused, plain) <= ATOL


def test_rl_and_dpo_logprobs_are_log_softmax_of_the_capped_logits(setup):
    _, model, params = setup
    batch, _, _ = batch_for(CFG, seed=3)
    inputs, targets = batch["inputs"], batch["targets"]
    logits, _ = model.apply(params, inputs)
    assert float(logits.abs().max()) <= CFG.logit_softcap
    logp_all = torch.log_softmax(logits, dim=-1)
    on = targets != IGNORE_INDEX
    want = torch.where(on, logp_all.gather(-1, targets.clamp(min=0)[..., None])[..., 0], 0.0)
    entropy = torch.where(on, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    with torch.no_grad():
        logp, ent = ft.rl.token_logprobs_and_entropy(model, params, inputs, targets, chunk_size=7)
        summed = ft.train.completion_logprobs(model, params, inputs, targets, chunk_size=7)
    torch.testing.assert_close(logp, want, rtol=0, atol=ATOL)
    torch.testing.assert_close(ent, entropy, rtol=0, atol=ATOL)
    torch.testing.assert_close(summed, want.sum(1), rtol=0, atol=ATOL)
    # gradients of a per-token weighted sum (DPO/GRPO weigh each token): the fused backward (recomputed
    # blocks with the cap's chain factor) vs torch.func.grad of the formula
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(4))

    def ours(p, fused=True):
        lp, _ = ft.rl.token_logprobs_and_entropy(model, p, inputs, targets, chunk_size=7, fused=fused)
        return (lp * weights).sum()

    def formula(p):
        lp = torch.log_softmax(model.apply(p, inputs)[0], dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        return (torch.where(on, lp, 0.0) * weights).sum()

    want_g = torch.func.grad(formula)(params)
    p = tree.map(lambda x: x.detach().requires_grad_(True), params)
    fused_g = torch.autograd.grad(ours(p), tree.leaves(p))  # plain autograd: the fused Function
    assert rel_diff(list(fused_g), want_g) <= ATOL
    assert rel_diff(torch.func.grad(lambda q: ours(q, fused=False))(params), want_g) <= ATOL


def test_batch_invariant_generator_logprobs_equal_the_trainers_bit_for_bit():
    cfg = batch_invariant(attrs.evolve(CFG, init_std=0.2))  # logits up to the cap
    model = muse_glimmer.model(cfg)
    params = model.init(random.key(0))
    prompts = [[5, 17, 3, 48, 41, 9], [11, 2], [70, 71, 72, 73]]
    tokens, lps = ft.infer.generate(model, params, prompts, max_new_tokens=6, sampling=ft.infer.Sampling(),
                                    key=random.key(3), logprobs=True)  # fmt: skip
    batch = rows_of(prompts, tokens, lps)
    with torch.no_grad():
        trainer, _ = ft.rl.token_logprobs_and_entropy(model, params, batch["inputs"], batch["targets"])
        logits, _ = model.apply(params, batch["inputs"])
    on = batch["targets"] != IGNORE_INDEX
    assert float(logits.abs().max()) > 0.9 * cfg.logit_softcap
    assert torch.equal(trainer[on], batch["gen_logp"][on])  # both soft-capped the same way, the same bits


def test_lora_keeps_the_cap(setup):
    _, model, params = setup
    batch, _, _ = batch_for(CFG, seed=5)
    lm = ft.models.lora.lora(model, rank=2, alpha=4.0)
    assert lm.logit_softcap == CFG.logit_softcap
    lp = {**lm.init(random.key(1)), "base": params}  # B starts at 0: the merged weights are the base's
    with torch.no_grad():
        got, _ = ft.train.next_token_loss(lm, chunk_size=7)(lp, batch)
        want, _ = ft.train.next_token_loss(model, chunk_size=7)(params, batch)
    assert abs(float(got) - float(want)) <= ATOL


def test_vllm_refuses_the_family():
    from ftitan.vllm._families import architecture_of

    with pytest.raises(ValueError, match="'muse_glimmer' does not run inside vLLM yet"):
        architecture_of(CFG)
