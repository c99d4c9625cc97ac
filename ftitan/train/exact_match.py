"""Exact-match evaluation of a chat model by greedy generation (the score of :mod:`ftitan.data.tasks`).

Each item's prompt (its messages but the last, with the template's generation prompt) is
tokenized as training tokenizes it (no special tokens added: the template writes its own),
greedily continued by :func:`ftitan.infer.generate` in batches (ragged prompts left-padded,
masked), and cut at the first stop token (the tokenizer's EOS, or the template's end marker
when it is one token) and at the template's end marker in the text. The completion is then
scored by :func:`ftitan.data.tasks.parse_answer` / :func:`~ftitan.data.tasks.exact_match`.
Greedy decoding makes it deterministic.

Example::

    scores = exact_match_eval(model, params, tok, load_chat_template(None), task_items(200, seed=0, split="eval"),
                              max_new_tokens=24, batch_size=50)
    scores["parse_rate"], scores["exact_match"]      # fractions of the items, in [0, 1]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ftitan.data.chat import ChatTemplate
from ftitan.data.tasks import exact_match, parse_answer
from ftitan.infer import GREEDY, fuse_projections, generate
from ftitan.infer.generate import Compile

__all__ = ["completion_text", "end_marker", "exact_match_eval", "greedy_completions", "greedy_tokens",
           "score_completions"]  # fmt: skip

_SENTINEL = "\x00ftitan-end-marker\x00"


def end_marker(template: ChatTemplate) -> str | None:
    """The text the template writes after an assistant message, whitespace stripped (``"<|end|>"`` for
    the built-in template, ``"<|im_end|>"`` for ChatML); ``None`` when it writes none."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
    text = template.render(messages)
    if _SENTINEL not in text:
        raise ValueError(f"{template.origin}: the render of an assistant message does not contain its content")
    return text.split(_SENTINEL, 1)[1].strip() or None


def _stop_ids(tokenizer: Any, marker: str | None) -> list[int]:
    stop = [tokenizer.eos_id]
    hf = getattr(tokenizer, "hf", None)
    marker_id = None if marker is None or hf is None else hf.token_to_id(marker)
    if marker_id is not None and marker_id not in stop:  # a special token (ChatML's <|im_end|>): stop on it
        stop.append(marker_id)
    return stop


def greedy_tokens(
    model: Any,
    params: Any,
    tokenizer: Any,  # ftitan.data.Tokenizer: encode, decode, eos_id
    template: ChatTemplate,
    items: Sequence[Mapping[str, Any]],  # {"messages": [..., last assistant turn]}
    *,
    max_new_tokens: int,
    batch_size: int,
    compile: Compile = False,
) -> list[list[int]]:
    """The greedy continuation of each item's prompt, ``batch_size`` prompts a :func:`~ftitan.infer.generate`
    call, up to (not including) its first stop token (the tokenizer's EOS, or a one-token end marker)."""
    if batch_size < 1:
        raise ValueError(f"greedy_tokens: batch_size={batch_size} must be >= 1")
    stop = _stop_ids(tokenizer, end_marker(template))
    prompts = [tokenizer.encode(template.render(it["messages"][:-1], add_generation_prompt=True)) for it in items]
    fused = fuse_projections(params)  # once, not once a batch
    out = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        for ids in generate(model, fused, batch, max_new_tokens=max_new_tokens, sampling=GREEDY, eos_id=stop,
                            compile=compile, fuse=False):  # fmt: skip
            out.append(ids[:next((i for i, t in enumerate(ids) if t in stop), len(ids))])
    return out


def completion_text(ids: Sequence[int], tokenizer: Any, template: ChatTemplate) -> str:
    """The text of generated ``ids`` up to the template's end marker."""
    text, marker = tokenizer.decode(ids), end_marker(template)
    return text if marker is None else text.split(marker, 1)[0]


def greedy_completions(
    model: Any,
    params: Any,
    tokenizer: Any,
    template: ChatTemplate,
    items: Sequence[Mapping[str, Any]],
    *,
    max_new_tokens: int,
    batch_size: int,
    compile: Compile = False,
) -> list[str]:
    """The :func:`completion_text` of each item's :func:`greedy_tokens`."""
    outs = greedy_tokens(model, params, tokenizer, template, items, max_new_tokens=max_new_tokens,
                         batch_size=batch_size, compile=compile)  # fmt: skip
    return [completion_text(ids, tokenizer, template) for ids in outs]


def score_completions(completions: Sequence[str], items: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``{"parse_rate", "exact_match"}``: the fractions of completions in the task's format, and right."""
    if len(completions) != len(items):
        raise ValueError(f"score_completions: {len(completions)} completions for {len(items)} items")
    if not items:
        raise ValueError("score_completions: no items to score")
    parsed = sum(parse_answer(c) is not None for c in completions)
    right = sum(exact_match(c, it) for c, it in zip(completions, items))
    return {"parse_rate": parsed / len(items), "exact_match": right / len(items)}


def exact_match_eval(
    model: Any,
    params: Any,
    tokenizer: Any,
    template: ChatTemplate,
    items: Sequence[Mapping[str, Any]],
    *,
    max_new_tokens: int,
    batch_size: int,
    compile: Compile = False,
) -> dict[str, float]:
    """:func:`score_completions` of :func:`greedy_completions` (see the module docstring)."""
    completions = greedy_completions(model, params, tokenizer, template, items, max_new_tokens=max_new_tokens,
                                     batch_size=batch_size, compile=compile)  # fmt: skip
    return score_completions(completions, items)
