"""One GRPO step as function composition: rollout (the pure model samples), group advantages, the
trainer's old log-probs, and ``make_train_step`` over ``grpo_loss_fn``: no second model definition."""

from __future__ import annotations

import attrs
import torch

import ftitan as ft
from ftitan.models import llama

CFG = attrs.evolve(llama.Config.debug(), vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                   max_seq_len=128, init_std=0.2)  # fmt: skip
G = 4


def test_a_grpo_step_raises_the_log_probs_of_better_samples():
    env = ft.rl.ENVS["sort"]
    prompts = env.prompts(3, seed=0, split="train")
    template = ft.data.load_chat_template(None)
    tok = ft.data.train_tokenizer([template.render(list(p.messages)) + p.answer for p in env.prompts(300, seed=1,
                                   split="train")], vocab_size=286)  # fmt: skip
    model = llama.model(CFG)
    params = model.init(ft.random.key(0))

    def reward(text: str, prompt) -> float:  # an untrained model never answers: a shaped reward that varies
        return float(len(text) % 3 == 0)

    ro = ft.rl.rollout(model, params, prompts, reward=reward, tokenizer=tok, template=template, group_size=G,
                       max_new_tokens=10, key=ft.random.key(1))  # fmt: skip
    adv = ft.rl.group_advantages(ro.rewards, G)
    assert adv.abs().sum() > 0  # some group has both outcomes
    with torch.no_grad():
        old, _ = ft.rl.token_logprobs_and_entropy(model, params, ro.batch["inputs"], ro.batch["targets"])
    batch = {**ro.batch, "old_logp": old, "advantages": adv}
    opt = ft.optim.adamw(1e-2, weight_decay=0.0)
    step = ft.train.make_train_step(ft.rl.grpo_loss_fn(model, tis_cap=2.0), opt)
    state, m = step(ft.train.init_state(params, opt), batch)
    assert m["clip_fraction"] == 0.0  # the first update starts at ratio 1
    assert float(m["mismatch_kl"]) <= 1e-5  # generator and trainer agree (to float32 rounding)
    with torch.no_grad():
        new, _ = ft.rl.token_logprobs_and_entropy(model, state.params, ro.batch["inputs"], ro.batch["targets"])
    on = ro.batch["targets"] != -100
    gain = ((new - old) * on).sum(dim=1)  # (N,) each sample's change in log-prob
    assert float((gain * adv).sum()) > 0  # better-than-group samples became more likely, worse ones less
