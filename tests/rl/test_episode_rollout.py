"""Multi-turn tool episodes as training rows: the sequence is the rendered conversation, the loss mask
covers only the model's own tokens (never the tool results or the template's headers), the generator's
log-probs sit on exactly those tokens, and malformed turns or the turn limit end an episode with reward 0.

The policy here is scripted (its turns are given; its "log-probs" are distinct markers), so that what each
row must hold is known exactly; ``test_rl_cli``'s grpo-tools run drives the same code with a trained model.
"""

from __future__ import annotations

import pytest
import torch

import ftitan as ft
from ftitan.rl.envs import ToolEnv
from ftitan.train.losses import IGNORE_INDEX


@pytest.fixture(scope="module")
def tok():
    env = ft.rl.ENVS["prices"]
    template = ft.data.load_chat_template(None)
    return ft.data.train_tokenizer([template.render(list(d)) for d in ft.rl.demonstrations(env, 200, seed=1)],
                                   vocab_size=400)  # fmt: skip


def scripted(turns_of, tok):
    """A generate_fn whose sample for a request is the next of its episode's scripted turns (+ the end marker),
    each token's log-prob a distinct negative number: which request is which is read from its prompt."""
    calls = {"n": 0}

    def generate_fn(model, params, prompts, *, max_new_tokens, sampling, key, eos_id, logprobs):
        assert logprobs
        tokens, lps = [], []
        for ids in prompts:
            text = tok.decode(ids)
            episode = next(i for i, (question, _) in enumerate(turns_of) if question in text)
            turn = text.count("<|assistant|>") - 1
            new = tok.encode(turns_of[episode][1][turn] + "<|end|>")[:max_new_tokens]
            tokens.append(new)
            lps.append([-(calls["n"] * 1000 + j + 1) / 1e4 for j in range(len(new))])
            calls["n"] += 1
        return tokens, lps

    return generate_fn


def test_tool_episodes_mask_only_the_models_tokens(tok):
    env: ToolEnv = ft.rl.ENVS["prices"]
    template = ft.data.load_chat_template(None)
    prompts = env.prompts(3, seed=7, split="train")
    solve = env.demo(prompts[0])  # look up, multiply, answer: three turns, two tool results
    wrong = ["<tool>lookup: nothing</tool>", "The answer is 1."]  # an error result, then a wrong answer
    stubborn = ["<tool>calculator: 1 +</tool>"] * 10  # never answers: the turn limit ends it
    turns_of = [(p.info["question"], t) for p, t in zip(prompts, (solve, wrong, stubborn), strict=True)]
    ro = ft.rl.episode_rollout(None, None, prompts, env=env, tokenizer=tok, template=template, group_size=1,
                               max_new_tokens=40, key=ft.random.key(0), generate_fn=scripted(turns_of, tok))  # fmt: skip
    assert ro.rewards.tolist() == [1.0, 0.0, 0.0]
    assert ro.ids == [0, 1, 2]
    for row, (prompt, turns) in enumerate(zip(prompts, (solve, wrong, stubborn[: env.max_turns]), strict=True)):
        inputs, targets, gen = ro.batch["inputs"][row], ro.batch["targets"][row], ro.batch["gen_logp"][row]
        on = targets != IGNORE_INDEX
        seq = [*inputs[: int((inputs != 0).nonzero().max()) + 1].tolist()]
        # what was trained on is exactly the model's turns, each with its end marker, in order
        assert tok.decode(targets[on].tolist()) == "".join(t + "<|end|>" for t in turns)
        assert int(on.sum()) == int(ro.lengths[row])
        # and the generator's log-probs sit exactly there, in the order they were drawn
        lps = gen[on]
        assert bool((lps < 0).all()) and bool((gen[~on] == 0).all())
        assert bool((lps[1:] < lps[:-1]).all())  # the scripted log-probs fall with every token drawn
        # the whole row is the conversation as the template renders it: tool results included, not trained
        state = env.reset(prompt)
        for t in turns:
            state, done, _ = env.step(state, t)
        rendered = template.render(list(state.messages))
        full = tok.decode([*seq, int(targets[on][-1])])
        assert rendered.startswith(full) and rendered[len(full):] == "\n"
        tools = [m["content"] for m in state.messages if m["role"] == "tool"]
        assert len(tools) == len(turns) - 1  # every turn but the last (an answer, or the turn limit) got a result
        assert all(f"<|tool|>\n{c}<|end|>" in full for c in tools)  # in the row, and (above) not trained on


def test_a_turn_cut_at_max_new_tokens_ends_the_episode_with_reward_zero(tok):
    env: ToolEnv = ft.rl.ENVS["prices"]
    template = ft.data.load_chat_template(None)
    prompts = env.prompts(1, seed=3, split="train")
    turns_of = [(prompts[0].info["question"], env.demo(prompts[0]))]
    ro = ft.rl.episode_rollout(None, None, prompts, env=env, tokenizer=tok, template=template, group_size=2,
                               max_new_tokens=3, key=ft.random.key(0), generate_fn=scripted(turns_of, tok))  # fmt: skip
    assert ro.rewards.tolist() == [0.0, 0.0]
    assert ro.lengths.tolist() == [3, 3]  # one turn, cut: trained on as sampled (its reward says it failed)


def test_a_long_episode_ends_before_it_outgrows_the_row(tok):
    env: ToolEnv = ft.rl.ENVS["prices"]
    template = ft.data.load_chat_template(None)
    prompts = env.prompts(1, seed=3, split="train")
    turns_of = [(prompts[0].info["question"], env.demo(prompts[0]))]
    first = len(tok.encode(template.render(list(prompts[0].messages), add_generation_prompt=True)))
    ro = ft.rl.episode_rollout(None, None, prompts, env=env, tokenizer=tok, template=template, group_size=1,
                               max_new_tokens=30, key=ft.random.key(0), max_len=first + 45,
                               generate_fn=scripted(turns_of, tok))  # fmt: skip
    assert ro.rewards.tolist() == [0.0]
    assert ro.batch["inputs"].shape[1] + 1 <= first + 45
