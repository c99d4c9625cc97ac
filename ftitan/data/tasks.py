"""Synthetic chat tasks that a tiny model learns from scratch in minutes, scored by exact match.

Every task asks a question and is answered in one format, ``"The answer is <answer>."``::

    reverse   user: "Reverse the letters: c a t"   assistant: "The answer is t a c."
    sort      user: "Sort the digits: 7 2 9"       assistant: "The answer is 2 7 9."
    add       user: "What is 37 + 58?"             assistant: "The answer is 95."

Digits and letters are written with spaces so that a byte-level BPE keeps one token a symbol
(``" 7"``; without spaces its merges would cut the string into chunks that reorder into other tokens).

How fast each is learned, from scratch on 2 CPU cores (llama dim 128, 2 layers, 4 heads, a BPE
trained on the task text, AdamW 3e-3 with 50 warmup steps and cosine decay, seq_len 64, loss on
assistant tokens; exact match on 200 held-out items):

- ``sort`` (the default): 3-5 distinct digits. Batch 16, eager, 100 steps (5 s): format from step
  25, exact match 67-79% at step 50 and 99.5-100% at step 100 over 4 seeds. A one-layer
  algorithm: the next digit is the smallest one above the last.
- ``reverse``: 3-5 distinct letters. Format by step 50; exact match sits at 0 through a plateau
  (an induction head run backwards: find the letter just written, write the one before it), then
  jumps, or not: batch 32, 86% at step 1250 of a 2000-step schedule, but 8% after a 1500-step
  one and 0% after a 600-step one (12% with dim 256). For runs longer than a test's.
- ``add``: two numbers in 0..99, carries over BPE number tokens: format by step 100, exact match
  about 1% after 600 steps of batch 32. For models that know arithmetic already.

Splits: a question is held out (``split="eval"``) iff the CRC-32 of its text is 0 mod 10
(:func:`split_of`), so the train and eval splits never share a question, whatever the seed or
count; ``sort`` hashes the answer instead, so no held-out digit set is trained on in any order.
Items are drawn with ``random.Random`` from a string seed of (task, split, seed): the same
arguments give the same items on every machine and Python version. Questions may repeat within
a split (``add`` has only 10,000).

Example::

    items = task_items(200, seed=0, split="eval")             # [{"messages": [user, assistant]}, ...]
    write_task_jsonl("train.jsonl", 20_000, seed=0, split="train")   # read by ftitan.data.read_conversations
    exact_match("The answer is 2 7 9.", item)                 # True when item's answer is "2 7 9"
"""

from __future__ import annotations

import json
import random
import re
import string
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "DEFAULT_TASK", "EVAL_ITEMS", "SPLITS", "TASKS", "Task", "exact_match", "parse_answer", "reference_answer",
    "split_of", "task_items", "write_task_jsonl",
]  # fmt: skip

SPLITS = ("train", "eval")
EVAL_ITEMS = 200  # held-out items an evaluation scores by default
EVAL_MODULUS = 10  # one question in EVAL_MODULUS (by CRC-32) is held out
DEFAULT_TASK = "sort"

# The whole answer: an integer, or single lowercase letters or digits separated by single spaces.
_ANSWER = re.compile(r"The answer is (-?[0-9]+|[a-z0-9](?: [a-z0-9])*)\.")


class Task(NamedTuple):
    """A synthetic task: ``make(rng) -> (question, answer)``, the answer as :func:`parse_answer` returns it."""

    make: Callable[[random.Random], tuple[str, str]]
    doc: str
    # what split_of hashes: "question", or "answer" when many questions share an answer (sort: every order
    # of a digit set), so that no held-out answer is ever trained on
    split_on: str = "question"


def _reverse(rng: random.Random) -> tuple[str, str]:
    letters = rng.sample(string.ascii_lowercase, rng.randint(3, 5))
    return f"Reverse the letters: {' '.join(letters)}", " ".join(reversed(letters))


def _sort(rng: random.Random) -> tuple[str, str]:
    digits = rng.sample(string.digits, rng.randint(3, 5))
    return f"Sort the digits: {' '.join(digits)}", " ".join(sorted(digits))


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}?", str(a + b)


TASKS: Mapping[str, Task] = {
    "reverse": Task(_reverse, "reverse 3-5 distinct space-separated lowercase letters"),
    "sort": Task(_sort, "sort 3-5 distinct space-separated digits ascending", split_on="answer"),
    "add": Task(_add, "add two integers in 0..99"),
}


def split_of(text: str) -> str:
    """``"eval"`` for held-out text (CRC-32 of its UTF-8 0 mod 10), else ``"train"``; the text is a task's
    question or answer (``Task.split_on``)."""
    return "eval" if zlib.crc32(text.encode("utf-8")) % EVAL_MODULUS == 0 else "train"


def _conversation(question: str, answer: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": f"The answer is {answer}."}]}  # fmt: skip


def task_items(n: int, *, seed: int, split: str, task: str = DEFAULT_TASK) -> list[dict[str, Any]]:
    """``n`` conversations ``{"messages": [user, assistant]}`` of ``task``'s ``split`` (``"train"`` or ``"eval"``)."""
    if split not in SPLITS:
        raise ValueError(f"task_items: split={split!r}; expected one of {SPLITS}")
    if task not in TASKS:
        raise ValueError(f"task_items: no task {task!r}; known: {', '.join(sorted(TASKS))}")
    if n < 0:
        raise ValueError(f"task_items: n={n} must be >= 0")
    make, on_answer = TASKS[task].make, TASKS[task].split_on == "answer"
    rng = random.Random(f"ftitan.data.tasks/{task}/{split}/{seed}")  # str seeds hash the same on every run
    items = []
    while len(items) < n:
        question, answer = make(rng)
        if split_of(answer if on_answer else question) == split:
            items.append(_conversation(question, answer))
    return items


def write_task_jsonl(path: str | Path, n: int, seed: int, split: str, *, task: str = DEFAULT_TASK) -> Path:
    """Write :func:`task_items` as chat JSONL (one ``{"messages": ...}`` a line); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for item in task_items(n, seed=seed, split=split, task=task):
            f.write(json.dumps(item) + "\n")
    return path


def parse_answer(text: str) -> str | None:
    """The answer in ``"The answer is <answer>."`` (surrounding whitespace allowed), else ``None``.

    ``<answer>`` is an integer, or single lowercase letters or digits separated by single spaces; anything
    else, before or after, is a format error: ``"The answer is 95"`` and ``"the answer is 95."``
    give ``None``.
    """
    m = _ANSWER.fullmatch(text.strip())
    return None if m is None else m.group(1)


def reference_answer(item: Mapping[str, Any]) -> str:
    """The answer of an item's last (assistant) message; raises ``ValueError`` when it is not in the format."""
    content = item["messages"][-1]["content"]
    answer = parse_answer(content)
    if answer is None:
        raise ValueError(f"reference_answer: the item's last message {content!r} is not 'The answer is <answer>.'")
    return answer


def exact_match(pred_text: str, item: Mapping[str, Any]) -> bool:
    """Whether ``pred_text`` is in the format and its answer equals the item's."""
    answer = parse_answer(pred_text)
    return answer is not None and answer == reference_answer(item)
