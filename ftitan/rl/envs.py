"""RL environments as plain functions: prompts with verifiable rewards, and tool-use episodes.

Every environment answers :func:`~ftitan.data.tasks.parse_answer`'s format, ``"The answer is <answer>."``,
and has two functions (fields of a NamedTuple, so ``env.prompts(...)`` and ``env.reward(...)`` read as
methods)::

    env = ENVS["countdown"]
    prompts = env.prompts(8, seed=0, split="train")      # [Prompt(messages, answer, info), ...]
    prompts[0].messages      # ({"role": "user", "content": "Use 3 5 2 to make 16 ..."},): up to the assistant turn
    prompts[0].answer        # the reference: "(3 + 5) * 2"
    env.reward("The answer is (3 + 5) * 2.", prompts[0])  # 1.0; wrong or malformed text: 0.0, never an exception

Single-turn environments (:class:`SingleTurnEnv`; ``rollout(..., reward=env.reward)`` scores them):

- ``add``, ``sort``, ``reverse``: :mod:`ftitan.data.tasks`'s tasks, the same items :func:`~ftitan.data.tasks.task_items`
  gives for a seed and split; reward 1 on an exact match.
- ``countdown``: 3-4 numbers in 1..12 and a target in 1..100; reward 1 for an expression of integers,
  ``+ - * /`` and parentheses that uses each number at most once and equals the target exactly
  (``"The answer is (3 + 5) * 2."``). The expression is read with :mod:`ast`, never evaluated as code.

Splits, as in :mod:`ftitan.data.tasks`: a prompt is held out (``split="eval"``) iff the CRC-32 of its question
(or answer, ``split_on="answer"``) is 0 mod 10, so train and eval never share a question; prompts are drawn by
``random.Random`` from a string seed of (environment, split, seed), the same on every machine.

A new single-turn task is one function from an RNG to a :class:`Prompt`::

    def mul(rng: random.Random) -> Prompt:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return user_prompt(f"What is {a} * {b}?", str(a * b))

    ENVS["mul"] = single_turn("mul", mul)   # reward: exact match of "The answer is <answer>." (answer_reward)

Multi-turn tool use (:class:`ToolEnv`, ``ENVS["prices"]``): the model calls tools with
``<tool>name: argument</tool>`` (the first call of a turn runs), the environment appends the result as a
``tool`` message, and the episode ends with reward ``env.reward(text, prompt)`` when the model writes
``"The answer is"`` without a tool call, or with reward 0 after ``max_turns`` assistant turns. A malformed or
unknown call gets an ``"error: ..."`` result and the episode goes on. A tool is one function ``(arg: str) -> str``
(an exception it raises becomes an ``"error: ..."`` result)::

    env = ToolEnv(tools={"calculator": calculator, "shout": str.upper})
    state = env.reset(prompt)                                   # the prompt's own tools come from env.prompt_tools
    state, done, reward = env.step(state, "<tool>lookup: pear</tool>")   # + assistant and tool messages
    state, done, reward = env.step(state, "The answer is 48.")          # done, reward 1.0
    ids, mask = episode_tokens(state.messages, template, tokenizer)     # mask 1 on assistant tokens only
"""

from __future__ import annotations

import ast
import operator
import random
import re
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from ftitan.data.chat import ChatTemplate, encode_chat
from ftitan.data.tasks import SPLITS, TASKS, parse_answer, reference_answer, split_of, task_items

__all__ = [
    "ENVS", "EpisodeState", "Prompt", "SingleTurnEnv", "Tool", "ToolEnv", "answer_reward", "calculator",
    "countdown_reward", "demonstrations", "episode_tokens", "evaluate_arithmetic", "from_task", "lookup_tool", "price_prompts",
    "run_episode", "single_turn", "user_prompt",
]  # fmt: skip

Tool = Callable[[str], str]  # a tool: its argument text -> its result text
MAX_EXPRESSION_CHARS = 200  # longer expressions are refused before parsing (bounds nesting and number size)


class Prompt(NamedTuple):
    """One prompt: the chat up to the assistant's turn, the reference answer, and what a reward needs besides."""

    messages: tuple[dict[str, str], ...]
    answer: str  # the reference, as it follows "The answer is "
    # what a reward needs besides, e.g. countdown's {"numbers": (3, 5, 2), "target": 16}; "question", when
    # present, is what the split hashes instead of the last user message (prices: without the tool help).
    # A plain dict, so that prompts pickle and deepcopy; rewards only read it.
    info: Mapping[str, Any]


def user_prompt(question: str, answer: str, **info: Any) -> Prompt:
    """A one-message prompt: ``question`` as the user's turn."""
    return Prompt(({"role": "user", "content": question},), answer, info)


def answer_reward(text: str, prompt: Prompt) -> float:
    """1.0 when ``text`` is ``"The answer is <prompt.answer>."`` (:func:`~ftitan.data.tasks.parse_answer`), else 0.0."""
    return float(parse_answer(text) == prompt.answer)


# ---------------------------------------------------------------------------------------------- single turn


class SingleTurnEnv(NamedTuple):
    """A task scored on one completion: ``prompts(n, *, seed, split)`` and ``reward(text, prompt)``."""

    name: str
    prompts: Callable[..., list[Prompt]]  # (n, *, seed, split) -> n prompts of that split
    reward: Callable[[str, Prompt], float]  # (completion text, prompt) -> reward; malformed text -> 0.0
    doc: str = ""


def _check_split(name: str, n: int, split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"{name}.prompts: split={split!r}; expected one of {SPLITS}")
    if n < 0:
        raise ValueError(f"{name}.prompts: n={n} must be >= 0")


def _question(prompt: Prompt) -> str:
    """What the split hashes for ``split_on="question"``: ``info["question"]``, else the last user message."""
    if "question" in prompt.info:
        return str(prompt.info["question"])
    return next(m["content"] for m in reversed(prompt.messages) if m["role"] == "user")


def _draw(name: str, make: Callable[[random.Random], Prompt], split_on: str) -> Callable[..., list[Prompt]]:
    """``prompts(n, *, seed, split)``: ``make``'s prompts whose question (or answer) hashes into ``split``."""
    key = _question if split_on == "question" else (lambda p: p.answer)

    def prompts(n: int, *, seed: int, split: str) -> list[Prompt]:
        _check_split(name, n, split)
        rng = random.Random(f"ftitan.rl.envs/{name}/{split}/{seed}")  # str seeds hash the same on every run
        out: list[Prompt] = []
        for _ in range(100 * n + 1000):  # eval takes 1 in 10: this many tries only fail for a degenerate make
            if len(out) == n:
                return out
            p = make(rng)
            if split_of(key(p)) == split:
                out.append(p)
        if len(out) == n:
            return out
        raise ValueError(f"{name}.prompts: drew {len(out)} of {n} {split!r} prompts in {100 * n + 1000} tries; "
                         f"make({name!r}) gives too few distinct {split_on}s for this split")  # fmt: skip

    return prompts


def single_turn(name: str, make: Callable[[random.Random], Prompt],
                reward: Callable[[str, Prompt], float] = answer_reward, *, split_on: str = "question",
                doc: str = "") -> SingleTurnEnv:  # fmt: skip
    """An environment from ``make(rng) -> Prompt`` (see the module docstring); ``split_on="answer"`` hashes the
    answer for the split when many questions share one (every order of a set to sort)."""
    if split_on not in ("question", "answer"):
        raise ValueError(f"single_turn({name!r}): split_on={split_on!r}; expected 'question' or 'answer'")
    return SingleTurnEnv(name, _draw(name, make, split_on), reward, doc)


def from_task(task: str) -> SingleTurnEnv:
    """:mod:`ftitan.data.tasks`'s ``task`` as an environment: ``prompts`` are :func:`task_items`'s questions."""
    if task not in TASKS:
        raise ValueError(f"from_task: no task {task!r}; known: {', '.join(sorted(TASKS))}")

    def prompts(n: int, *, seed: int, split: str) -> list[Prompt]:
        items = task_items(n, seed=seed, split=split, task=task)
        return [Prompt(tuple(it["messages"][:-1]), reference_answer(it), {}) for it in items]

    return SingleTurnEnv(task, prompts, answer_reward, TASKS[task].doc)


# ---------------------------------------------------------------------------------------------- arithmetic

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_arithmetic(expr: str, *, unary: bool = True) -> tuple[Fraction, tuple[int, ...]]:
    """The exact value of an expression of integers, ``+ - * /`` and parentheses, and the integers it uses.

    Read with :func:`ast.parse` and walked node by node, never evaluated as code: anything else (names, calls,
    attributes, floats, ``**``) raises ``ValueError``, as do division by zero and expressions longer than
    ``MAX_EXPRESSION_CHARS``. ``unary=False`` also refuses unary ``-`` and ``+``.
    """
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression of {len(expr)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        with warnings.catch_warnings():  # model text like "1a" would warn "invalid decimal literal" on every call
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expr!r:.80}") from None
    used: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and b == 0:
                raise ValueError("division by zero")
            return _BINARY[type(node.op)](a, b)
        if unary and isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.Constant) and type(node.value) is int:  # not bool, which is an int too
            used.append(node.value)
            return Fraction(node.value)
        allowed = "integers, + - * / and parentheses" + ("" if unary else " (no unary minus)")
        raise ValueError(f"{type(node).__name__} is not arithmetic: only {allowed}")

    return value(tree.body), tuple(used)


def calculator(arg: str) -> str:
    """A tool: the value of an arithmetic expression (:func:`evaluate_arithmetic`), ``"84"`` or ``"3.5"``."""
    v, _ = evaluate_arithmetic(arg)
    if abs(v) > 10**18:
        raise ValueError("result too large")
    return str(v.numerator) if v.denominator == 1 else repr(float(v))


# ---------------------------------------------------------------------------------------------- countdown

# tasks.py's answer format with an expression as the answer: "The answer is (3 + 5) * 2."
_EXPRESSION_ANSWER = re.compile(r"The answer is ([^\n]+)\.")
_COUNTDOWN_DOC = "reach a target in 1..100 with + - * / over 3-4 numbers in 1..12, each at most once"
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _random_expression(rng: random.Random, numbers: Sequence[int]) -> tuple[str, Fraction]:
    """A random expression over all of ``numbers`` (in a shuffled order) with minimal parentheses."""
    terms = [(str(x), Fraction(x), 3) for x in rng.sample(list(numbers), len(numbers))]  # (text, value, precedence)
    while len(terms) > 1:
        i = rng.randrange(len(terms) - 1)
        (ta, a, pa), (tb, b, pb) = terms[i], terms[i + 1]
        op = rng.choice("+-*/" if b != 0 and (a / b).denominator == 1 else "+-*")
        p = _PRECEDENCE[op]
        ta = ta if pa >= p else f"({ta})"
        tb = tb if pb > p or (pb == p and op in "+*") else f"({tb})"  # a - (b + c), a / (b * c) keep theirs
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
        terms[i : i + 2] = [(f"{ta} {op} {tb}", value, p)]
    return terms[0][0], terms[0][1]


def _countdown(rng: random.Random) -> Prompt:
    while True:
        numbers = tuple(rng.randint(1, 12) for _ in range(rng.randint(3, 4)))
        expr, target = _random_expression(rng, numbers)
        if target.denominator == 1 and 1 <= target <= 100:
            break
    question = (f"Use {' '.join(map(str, numbers))} to make {target}: + - * / and parentheses, each number at most "
                f"once. Write 'The answer is <expression>.'")  # fmt: skip
    return user_prompt(question, expr, numbers=numbers, target=int(target))


def countdown_reward(text: str, prompt: Prompt) -> float:
    """1.0 when ``text`` is ``"The answer is <expression>."`` and the expression uses only
    ``prompt.info["numbers"]``, each at most once, with ``+ - * /`` and parentheses, and equals
    ``prompt.info["target"]`` exactly; else 0.0."""
    m = _EXPRESSION_ANSWER.fullmatch(text.strip())
    if m is None:
        return 0.0
    try:
        value, used = evaluate_arithmetic(m.group(1), unary=False)
    except ValueError:
        return 0.0
    left = Counter(prompt.info["numbers"])
    left.subtract(used)
    return float(value == prompt.info["target"] and min(left.values()) >= 0)


# ---------------------------------------------------------------------------------------------- tool use

_FRUITS = ("apple", "pear", "fig", "plum", "kiwi", "lime", "mango", "peach", "grape", "lemon", "melon", "cherry")
TOOL_HELP = ("Tools: <tool>lookup: apple</tool> gives a price, <tool>calculator: 12 * 7</tool> does arithmetic. "
             "Finish with 'The answer is N.'")  # fmt: skip


def lookup_tool(store: Mapping[str, str]) -> Tool:
    """A tool reading ``store``: the value of a key (case and surrounding spaces ignored)."""

    def lookup(arg: str) -> str:
        key = arg.strip().lower()
        if key not in store:
            raise ValueError(f"no key {key!r:.40}; keys: {', '.join(sorted(store))}")
        return store[key]

    return lookup


def _prices(rng: random.Random) -> Prompt:
    fruits = rng.sample(_FRUITS, 4)
    store = {f: str(rng.randint(1, 20)) for f in fruits}
    fruit, times = rng.choice(fruits), rng.randint(2, 9)
    question = f"What is the price of {fruit} times {times}? Use the tools."
    return Prompt(({"role": "user", "content": f"{question}\n{TOOL_HELP}"},), str(int(store[fruit]) * times),
                  {"question": question, "store": store, "fruit": fruit, "times": times})  # fmt: skip


def _prices_demo(prompt: Prompt) -> list[str]:
    """How a ``prices`` question is solved with the tools: look the price up, multiply, answer."""
    fruit, times = prompt.info["fruit"], prompt.info["times"]
    price = prompt.info["store"][fruit]
    return [f"<tool>lookup: {fruit}</tool>", f"<tool>calculator: {price} * {times}</tool>",
            f"The answer is {prompt.answer}."]  # fmt: skip


# the split hashes the question without TOOL_HELP, so changing the help text keeps the splits
price_prompts = _draw("prices", _prices, "question")


def _prompt_store_tools(prompt: Prompt) -> Mapping[str, Tool]:
    store = prompt.info.get("store")
    return {} if store is None else {"lookup": lookup_tool(store)}


class EpisodeState(NamedTuple):
    """One tool-use episode: the chat so far (the prompt's, then assistant and tool turns) and its outcome."""

    prompt: Prompt
    messages: tuple[dict[str, str], ...]
    turns: int = 0  # assistant turns taken
    done: bool = False
    reward: float = 0.0


_TOOL_CALL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)


def _call_tool(text: str, tools: Mapping[str, Tool]) -> str:
    """The result of ``text``'s first ``<tool>name: argument</tool>``: the tool's output or ``"error: ..."``."""
    usage = "write <tool>name: argument</tool>"
    m = _TOOL_CALL.search(text)
    if m is None:
        return f"error: malformed tool call, no closing </tool>; {usage}"
    name, colon, arg = m.group(1).partition(":")
    name = name.strip()
    if not colon or not name:
        return f"error: malformed tool call {m.group(0)!r:.80}; {usage}"
    if name not in tools:
        return f"error: unknown tool {name!r:.40}; tools: {', '.join(sorted(tools))}"
    try:
        return str(tools[name](arg.strip()))
    except Exception as e:  # noqa: BLE001 -- a tool's failure on model text is the model's to read, not a crash
        return f"error: {name}: {e}"


class ToolEnv(NamedTuple):
    """Multi-turn tool use over :class:`EpisodeState` (see the module docstring): ``reset`` and ``step``."""

    tools: Mapping[str, Tool] = MappingProxyType({"calculator": calculator})  # shared by every episode
    prompt_tools: Callable[[Prompt], Mapping[str, Tool]] = _prompt_store_tools  # a prompt's own: lookup on its store
    max_turns: int = 4  # assistant turns before the episode ends with reward 0
    prompts: Callable[..., list[Prompt]] = price_prompts  # (n, *, seed, split) -> prompts
    reward: Callable[[str, Prompt], float] = answer_reward  # of the final answer's text
    demo: Callable[[Prompt], Sequence[str]] | None = _prices_demo  # a solving episode's assistant turns (for SFT)

    def reset(self, prompt: Prompt) -> EpisodeState:
        return EpisodeState(prompt, tuple(prompt.messages))

    def step(self, state: EpisodeState, model_text: str) -> tuple[EpisodeState, bool, float]:
        """Append the assistant's ``model_text``; run its tool call (appending the result), or score its answer."""
        if state.done:
            raise ValueError(f"ToolEnv.step: the episode ended after {state.turns} turns; reset a new one")
        turns = state.turns + 1
        messages = (*state.messages, {"role": "assistant", "content": model_text})
        if "<tool>" not in model_text and "The answer is" in model_text:
            reward = float(self.reward(model_text, state.prompt))
            return EpisodeState(state.prompt, messages, turns, True, reward), True, reward
        if turns >= self.max_turns:
            return EpisodeState(state.prompt, messages, turns, True, 0.0), True, 0.0
        if "<tool>" in model_text:
            result = _call_tool(model_text, {**self.tools, **self.prompt_tools(state.prompt)})
        else:
            result = "error: no tool call and no answer; write <tool>name: argument</tool> or 'The answer is N.'"
        messages = (*messages, {"role": "tool", "content": result})
        return EpisodeState(state.prompt, messages, turns), False, 0.0


def run_episode(env: ToolEnv, prompt: Prompt, policy: Callable[[tuple[dict[str, str], ...]], str]) -> EpisodeState:
    """Step ``policy(messages) -> text`` until the episode ends; the final state."""
    state = env.reset(prompt)
    while not state.done:
        state, _, _ = env.step(state, policy(state.messages))
    return state


def episode_tokens(messages: Sequence[dict[str, str]], template: ChatTemplate, tokenizer: Any, *,
                   seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A whole episode rendered with ``template`` and tokenized: ``(ids, mask)``, both ``(T,)`` int64.

    ``mask`` is 1 only on what the assistant wrote (its text and the template's end of turn), 0 on the
    system, user and tool turns and the headers (:func:`~ftitan.data.chat.encode_chat`). ``seq_len`` bounds
    the length (a longer episode raises ``ValueError``); ``None``: no bound.
    """
    enc = encode_chat(messages, template, tokenizer, seq_len=sys.maxsize if seq_len is None else seq_len,
                      where="<episode>")  # fmt: skip
    return enc.ids, enc.mask


def demonstrations(env: SingleTurnEnv | ToolEnv, n: int, *, seed: int) -> list[tuple[dict[str, str], ...]]:
    """``n`` solved conversations of ``env``'s train split, to warm a policy up by SFT (``ftitan rl
    --rl.sft-steps``): a single-turn prompt answered ``"The answer is <answer>."``, a tool episode played
    through ``env.step`` with ``env.demo``'s turns (the tool results are the tools' own)."""
    prompts = env.prompts(n, seed=seed, split="train")
    if isinstance(env, SingleTurnEnv):
        return [(*p.messages, {"role": "assistant", "content": f"The answer is {p.answer}."}) for p in prompts]
    if env.demo is None:
        raise ValueError("demonstrations: this ToolEnv has no demo(prompt) -> assistant turns; give it one, or warm "
                         "the policy up elsewhere (ftitan rl --rl.init-run DIR)")  # fmt: skip
    out = []
    for p in prompts:
        state = env.reset(p)
        for text in env.demo(p):
            state, done, reward = env.step(state, text)
        if not (state.done and state.reward == 1.0):
            raise ValueError(f"demonstrations: env.demo's turns for {p.messages[-1]['content']!r:.60} do not solve "
                             f"it (reward {state.reward}, done {state.done})")  # fmt: skip
        out.append(state.messages)
    return out


ENVS: dict[str, SingleTurnEnv | ToolEnv] = {
    **{task: from_task(task) for task in TASKS},
    "countdown": single_turn("countdown", _countdown, countdown_reward, doc=_COUNTDOWN_DOC),
    "prices": ToolEnv(),
}
