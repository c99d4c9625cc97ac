"""RL environments: rewards on right, wrong, malformed and adversarial text (never executed), prompts as a
function of (seed, split) with disjoint splits, scripted tool-use episodes, and the episode mask on the
assistant's tokens only (built-in and ChatML templates)."""

from __future__ import annotations

import pickle
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ftitan.data import tasks
from ftitan.data.chat import BUILTIN_TEMPLATE, ChatTemplate
from ftitan.rl.envs import (
    ENVS, Prompt, SingleTurnEnv, ToolEnv, answer_reward, calculator, countdown_reward, episode_tokens,
    evaluate_arithmetic, run_episode, single_turn, user_prompt,
)  # fmt: skip

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ADVERSARIAL = [
    "__import__('pathlib').Path('pwned').touch()",
    "open('pwned', 'w')",
    "(lambda: 16)()",
    "[16][0]",
    "x",
    "2 ** 4",
    "16.0",
    "True * 16",
    "1 / 0",
    "5 // 2",
    "9" * 300,
    "(" * 100 + "1" + ")" * 100,
    "1 +",
    "",
]
PRICE = user_prompt("What is the price of pear times 7? Use the tools.", "98", store={"pear": "14", "fig": "3"})


def _split_key(name: str, p: Prompt) -> str:
    if name == "sort":
        return p.answer
    return p.info.get("question", p.messages[-1]["content"])


# ---------------------------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("name", sorted(ENVS))
def test_prompts_are_deterministic_and_splits_disjoint(name):
    env = ENVS[name]
    train = env.prompts(150, seed=0, split="train")
    assert len(train) == 150 and train == env.prompts(150, seed=0, split="train")
    assert train != env.prompts(150, seed=1, split="train")
    evals = env.prompts(30, seed=0, split="eval")
    assert all(tasks.split_of(_split_key(name, p)) == "train" for p in train)
    assert all(tasks.split_of(_split_key(name, p)) == "eval" for p in evals)
    assert not {_split_key(name, p) for p in train} & {_split_key(name, p) for p in evals}
    assert all(p.messages[-1]["role"] == "user" for p in train)
    assert pickle.loads(pickle.dumps(train)) == train  # prompts travel to worker processes


@pytest.mark.parametrize("name", sorted(ENVS))
def test_reference_answer_scores_one_and_others_zero(name):
    env = ENVS[name]
    for p in env.prompts(40, seed=3, split="train"):
        assert env.reward(f"The answer is {p.answer}.", p) == 1.0
        assert env.reward(f"  The answer is {p.answer}.\n", p) == 1.0  # surrounding whitespace allowed
        for bad in (f"The answer is {p.answer}", f"the answer is {p.answer}.", p.answer, "", "The answer is 1000.",
                    f"Hmm. The answer is {p.answer}.", f"The answer is {p.answer}. Done."):  # fmt: skip
            assert env.reward(bad, p) == 0.0, bad


def test_task_envs_ask_the_task_items_questions():
    for name in ("add", "sort", "reverse"):
        items = tasks.task_items(20, seed=5, split="eval", task=name)
        prompts = ENVS[name].prompts(20, seed=5, split="eval")
        assert [p.messages for p in prompts] == [tuple(it["messages"][:1]) for it in items]
        assert [p.answer for p in prompts] == [tasks.reference_answer(it) for it in items]
    p = user_prompt("What is 37 + 58?", "95")
    assert answer_reward("The answer is 95.", p) == 1.0
    assert answer_reward("The answer is 96.", p) == 0.0


def test_prompts_refuse_bad_arguments():
    with pytest.raises(ValueError, match="split='test'"):
        ENVS["countdown"].prompts(1, seed=0, split="test")
    with pytest.raises(ValueError, match="n=-1"):
        ENVS["countdown"].prompts(-1, seed=0, split="train")


def test_single_turn_adds_a_task_with_one_function():
    def mul(rng: random.Random) -> Prompt:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return user_prompt(f"What is {a} * {b}?", str(a * b))

    env = single_turn("mul", mul)
    assert isinstance(env, SingleTurnEnv) and env.name == "mul"
    ps = env.prompts(10, seed=0, split="train")
    assert ps == env.prompts(10, seed=0, split="train")
    a, b = (int(x) for x in ps[0].messages[0]["content"][8:-1].split(" * "))
    assert env.reward(f"The answer is {a * b}.", ps[0]) == 1.0
    assert env.reward(f"The answer is {a * b + 1}.", ps[0]) == 0.0
    # a make with one question only ever falls in one split: refused with the reason, not an endless loop
    one = single_turn("one", lambda rng: user_prompt("What is 1 + 1?", "2"))
    other = "eval" if tasks.split_of("What is 1 + 1?") == "train" else "train"
    with pytest.raises(ValueError, match="too few distinct questions"):
        one.prompts(2, seed=0, split=other)


# ---------------------------------------------------------------------------------------------- countdown


def test_countdown_reward():
    p = user_prompt("Use 3 5 2 to make 16", "(3 + 5) * 2", numbers=(3, 5, 2), target=16)
    for right in ("(3 + 5) * 2", "2 * (5 + 3)", "((3 + 5)) * 2"):
        assert countdown_reward(f"The answer is {right}.", p) == 1.0, right
    for wrong in ("3 * 5 + 2", "(3 + 5) * 2 * 1", "(3 + 5) * 2 + 3 - 3", "16", "-(3) + 19", "(3 + 5) * 2 / 1"):
        assert countdown_reward(f"The answer is {wrong}.", p) == 0.0, wrong
    q = user_prompt("Use 4 2 8 to make 16", "8 * 2", numbers=(4, 2, 8), target=16)
    assert countdown_reward("The answer is 8 * 2.", q) == 1.0  # a subset of the numbers is fine
    assert countdown_reward("The answer is 4 * 4.", q) == 0.0  # 4 twice is not
    r = user_prompt("Use 3 6 2 to make 1", "6 / (3 * 2)", numbers=(3, 6, 2), target=1)
    assert countdown_reward("The answer is 2 / 6 * 3.", r) == 1.0  # exact rationals: 1/3 * 3 == 1


@pytest.mark.parametrize("expr", ADVERSARIAL)
def test_adversarial_expressions_are_refused_never_run(expr, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = user_prompt("Use 16 1 to make 16", "16", numbers=(16, 1), target=16)
    assert countdown_reward(f"The answer is {expr}.", p) == 0.0
    with pytest.raises(ValueError):
        evaluate_arithmetic(expr)
    state, done, _ = ToolEnv().step(ToolEnv().reset(PRICE), f"<tool>calculator: {expr}</tool>")
    assert not done and state.messages[-1]["content"].startswith("error: calculator: ")
    assert not (tmp_path / "pwned").exists()


def test_calculator():
    assert calculator("12 * 7") == "84"
    assert calculator(" (1 + 2) * -3 ") == "-9"
    assert calculator("7 / 2") == "3.5"
    assert evaluate_arithmetic("(3 + 5) * 2") == (16, (3, 5, 2))
    with pytest.raises(ValueError, match="unary minus"):
        evaluate_arithmetic("-3 + 5", unary=False)
    with pytest.raises(ValueError, match="too large"):
        calculator("99999999999 * 99999999999")


# ---------------------------------------------------------------------------------------------- tool use


def test_scripted_episode_reaches_reward_one():
    env = ToolEnv()
    state = env.reset(PRICE)
    state, done, reward = env.step(state, "<tool>lookup: Pear</tool>")
    assert (done, reward) == (False, 0.0)
    assert state.messages[-2:] == ({"role": "assistant", "content": "<tool>lookup: Pear</tool>"},
                                   {"role": "tool", "content": "14"})  # fmt: skip
    state, done, reward = env.step(state, "I multiply. <tool>calculator: 14 * 7</tool>")
    assert (done, reward, state.messages[-1]["content"]) == (False, 0.0, "98")
    state, done, reward = env.step(state, "The answer is 98.")
    assert (done, reward) == (True, 1.0) and (state.done, state.reward, state.turns) == (True, 1.0, 3)
    assert [m["role"] for m in state.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    with pytest.raises(ValueError, match="episode ended"):
        env.step(state, "The answer is 98.")


def test_wrong_or_malformed_final_answer_scores_zero():
    env = ToolEnv()
    for text in ("The answer is 97.", "The answer is 98", "So. The answer is 98. Bye"):
        state, done, reward = env.step(env.reset(PRICE), text)
        assert (done, reward) == (True, 0.0), text


def test_turn_limit_scores_zero():
    env = ToolEnv(max_turns=3)
    state = run_episode(env, PRICE, lambda messages: "<tool>calculator: 14 * 7</tool>")
    assert (state.done, state.reward, state.turns) == (True, 0.0, 3)
    assert [m["role"] for m in state.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    # text with neither a tool call nor an answer is told so, and counts as a turn
    state = run_episode(env, PRICE, lambda messages: "hmm")
    assert (state.reward, state.turns) == (0.0, 3) and state.messages[2]["content"].startswith("error: no tool call")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool>calculator 14 * 7</tool>", "error: malformed tool call"),
        ("<tool>: 14 * 7</tool>", "error: malformed tool call"),
        ("<tool>calculator: 14 * 7", "error: malformed tool call, no closing </tool>"),
        ("<tool>python: import os</tool>", "error: unknown tool 'python'; tools: broken, calculator, lookup"),
        ("<tool>lookup: durian</tool>", "error: lookup: no key 'durian'; keys: fig, pear"),
        ("<tool>calculator: 1 / 0</tool>", "error: calculator: division by zero"),
        ("<tool>broken: x</tool>", "error: broken: division by zero"),
        ("<tool>calculator: 1 +</tool> The answer is 98.", "error: calculator: not an arithmetic expression"),
    ],
)
def test_malformed_tool_calls_get_an_error_result(text, error):
    env = ToolEnv(tools={"calculator": calculator, "broken": lambda arg: str(1 / 0)})
    state, done, reward = env.step(env.reset(PRICE), text)
    assert (done, reward) == (False, 0.0)
    assert state.messages[-1]["role"] == "tool" and state.messages[-1]["content"].startswith(error)


def test_a_user_tool_is_one_function():
    env = ToolEnv(tools={"shout": str.upper})
    state, _, _ = env.step(env.reset(PRICE), "<tool>shout: hi there</tool> and more <tool>shout: ignored</tool>")
    assert state.messages[-1] == {"role": "tool", "content": "HI THERE"}  # the first call of a turn runs


def test_price_prompts_are_solvable_with_the_tools():
    env = ENVS["prices"]
    for p in env.prompts(5, seed=0, split="eval"):
        asked = re.fullmatch(r"What is the price of (\w+) times (\d+)\? Use the tools\.", p.info["question"])
        fruit, times = asked.groups()

        def policy(messages, fruit=fruit, times=times):
            if len(messages) == 1:  # the user's question
                return f"<tool>lookup: {fruit}</tool>"
            if len(messages) == 3:  # + the lookup and its result
                return f"<tool>calculator: {messages[-1]['content']} * {times}</tool>"
            return f"The answer is {messages[-1]['content']}."

        assert run_episode(env, p, policy).reward == 1.0


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from("()+-*/ 0123456789.a_'<>:toolTheanswris\n"), max_size=60))
def test_any_text_scores_or_errors_never_raises(text):
    p = user_prompt("Use 3 5 2 to make 16", "(3 + 5) * 2", numbers=(3, 5, 2), target=16)
    assert countdown_reward(text, p) in (0.0, 1.0)
    assert countdown_reward(f"The answer is {text}.", p) in (0.0, 1.0)
    env = ToolEnv()
    for call in (text, f"<tool>calculator: {text}</tool>", f"<tool>{text}</tool>"):
        state, done, reward = env.step(env.reset(PRICE), call)
        assert reward in (0.0, 1.0) and len(state.messages) == 2 + (not done)


# ---------------------------------------------------------------------------------------------- episode mask


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([PRICE.messages[0]["content"], "<tool>lookup: pear</tool> The answer is 98."] * 5,
                            trainer=trainer)  # fmt: skip
    return tok


def _scripted_state():
    env = ToolEnv()
    state = env.reset(PRICE)
    for text in ("<tool>lookup: pear</tool>", "<tool>calculator: 14 * 7</tool>", "The answer is 98."):
        state, _, _ = env.step(state, text)
    assert state.reward == 1.0
    return state


@pytest.mark.parametrize(("template", "end"), [(ChatTemplate(BUILTIN_TEMPLATE), "<|end|>\n"),
                                               (ChatTemplate(CHATML, origin="chatml"), "<|im_end|>\n")])  # fmt: skip
def test_episode_mask_covers_only_assistant_tokens(tokenizer, template, end):
    state = _scripted_state()
    ids, mask = episode_tokens(state.messages, template, tokenizer)
    assert ids.shape == mask.shape and ids.dtype == mask.dtype == torch.int64
    assert tokenizer.decode(ids.tolist()) == template.render(state.messages)
    trained = tokenizer.decode(ids[mask == 1].tolist())
    assert trained == "".join(m["content"] + end for m in state.messages if m["role"] == "assistant")
    untrained = tokenizer.decode(ids[mask == 0].tolist())
    for m in state.messages:
        if m["role"] != "assistant":
            assert m["content"] in untrained  # user and tool turns, whole, untrained
    with pytest.raises(ValueError, match="longer than seq_len=8"):
        episode_tokens(state.messages, template, tokenizer, seq_len=8)
