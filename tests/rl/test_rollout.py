"""Rollouts from the same pure model: the generator's log-probs of the sampled tokens against the
trainer's recomputation with ``apply`` over the whole sequence (float32, other summation orders:
1e-5; bit-equality is the batch-invariant mode's job), the rows' targets on the completion only,
and rollouts as a pure function of their key."""

from __future__ import annotations

from typing import Any, NamedTuple

import attrs
import torch

import ftitan as ft
from ftitan.data import tasks
from ftitan.models import llama
from ftitan.rl.rollout import rollout, rows_of
from ftitan.train.dpo import token_logprobs
from ftitan.train.losses import IGNORE_INDEX

CFG = attrs.evolve(llama.Config.debug(), vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                   max_seq_len=128, init_std=0.2)  # fmt: skip


class Prompt(NamedTuple):
    messages: tuple[dict[str, str], ...]
    item: dict[str, Any]


def _trainer_logp(model, params, batch):
    h, _ = model.apply(params, batch["inputs"], logits=False)
    t = batch["targets"].reshape(-1)
    lp = token_logprobs(h.reshape(-1, h.shape[-1]), model.head(params), t).reshape(batch["targets"].shape)
    return lp


def test_generate_logprobs_are_the_models_own():
    model = llama.model(CFG)
    params = model.init(ft.random.key(0))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    key = ft.random.key(3)
    plain = ft.infer.generate(model, params, prompts, max_new_tokens=6, sampling=ft.infer.Sampling(), key=key)
    tokens, logprobs = ft.infer.generate(model, params, prompts, max_new_tokens=6, sampling=ft.infer.Sampling(),
                                         key=key, logprobs=True)  # fmt: skip
    assert tokens == plain  # asking for log-probs changes no token
    batch = rows_of(prompts, tokens, logprobs)
    with torch.no_grad():
        want = _trainer_logp(model, params, batch)
    on = batch["targets"] != IGNORE_INDEX
    assert int(on.sum()) == sum(len(t) for t in tokens)
    assert (want[on] - batch["gen_logp"][on]).abs().max() <= 1e-5
    assert (batch["gen_logp"][on] < 0).all()


def test_rows_put_targets_on_the_completion_only():
    batch = rows_of([[1, 2, 3], [4]], [[7, 8], [9, 10, 11]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]], pad_id=0)
    assert batch["inputs"].tolist() == [[1, 2, 3, 7], [4, 9, 10, 0]]
    assert batch["targets"].tolist() == [[-100, -100, 7, 8], [9, 10, 11, -100]]
    assert batch["gen_logp"].tolist() == [[0, 0, -0.5, -0.25], [-1.0, -2.0, -3.0, 0]]


def test_rollout_groups_rewards_and_determinism():
    items = tasks.task_items(3, seed=0, split="train", task="sort")
    prompts = [Prompt(tuple(it["messages"][:-1]), it) for it in items]
    template = ft.data.load_chat_template(None)
    tok = ft.data.train_tokenizer([template.render(it["messages"]) for it in tasks.task_items(500, seed=0,
                                   split="train", task="sort")], vocab_size=300)  # fmt: skip
    model = llama.model(CFG)
    params = model.init(ft.random.key(0))
    kw = dict(reward=lambda text, p: float(tasks.exact_match(text, p.item)), tokenizer=tok, template=template,
              group_size=4, max_new_tokens=12, first_id=100)  # fmt: skip
    a = rollout(model, params, prompts, key=ft.random.key(7), **kw)
    b = rollout(model, params, prompts, key=ft.random.key(7), **kw)
    c = rollout(model, params, prompts, key=ft.random.key(8), **kw)
    assert a.ids == list(range(100, 112)) and a.rewards.shape == (12,) and set(a.rewards.tolist()) <= {0.0, 1.0}
    assert all(torch.equal(a.batch[k], b.batch[k]) for k in a.batch) and a.texts == b.texts  # pure in its key
    assert a.texts != c.texts
    # each sample's row starts with its prompt's tokens; its targets are its completion
    for i in range(12):
        prompt = tok.encode(template.render(list(prompts[i // 4].messages), add_generation_prompt=True))
        assert a.batch["inputs"][i, : len(prompt)].tolist() == prompt
        assert int((a.batch["targets"][i] != IGNORE_INDEX).sum()) == int(a.lengths[i])
    with torch.no_grad():
        want = _trainer_logp(model, params, a.batch)
    on = a.batch["targets"] != IGNORE_INDEX
    assert (want[on] - a.batch["gen_logp"][on]).abs().max() <= 1e-5
