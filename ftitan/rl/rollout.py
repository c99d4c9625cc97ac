"""Rollouts: G sampled completions per prompt from the same pure model, scored, as a training batch.

A rollout adds no second model: the prompts are rendered with the run's chat template, the
completions are :func:`ftitan.infer.generate` samples at temperature 1 (the generator's log-probs
of the sampled tokens come with them), and the rows a train step reads are the prompt + completion
token ids with targets on the completion only::

    ro = rollout(model, params, prompts, reward=env.reward, tokenizer=tok, template=template,
                 group_size=8, max_new_tokens=32, key=ft.random.fold_in(key, step))
    ro.batch["inputs"], ro.batch["targets"]   # (P * G, T): targets IGNORE_INDEX off the completion
    ro.batch["gen_logp"]                       # (P * G, T): the generator's log-prob of each target
    ro.rewards, ro.lengths, ro.ids             # (P * G,): sample i is prompt i // G's (i % G)-th draw

Sample ``i`` draws from ``fold_in(key, i)``: a rollout is a pure function of its arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ftitan.data.chat import ChatTemplate
from ftitan.infer import Sampling, generate
from ftitan.train.exact_match import _stop_ids, completion_text, end_marker
from ftitan.train.losses import IGNORE_INDEX

__all__ = ["Rollouts", "rollout", "rows_of"]


class Rollouts(NamedTuple):
    """``P * G`` scored samples, prompt-major (``G`` consecutive samples per prompt)."""

    batch: dict[str, torch.Tensor]  # inputs, targets, gen_logp: (N, T)
    rewards: torch.Tensor  # (N,) float32
    lengths: torch.Tensor  # (N,) int64: completion tokens (the stop token included)
    ids: list[int]  # a unique id per sample (first_id + i), to account for every rollout
    texts: list[str]  # each completion's text up to the template's end marker


def rows_of(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
            logprobs: Sequence[Sequence[float]], *, pad_id: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
    """Training rows of ``prompt + completion``: ``inputs = seq[:-1]``, ``targets = seq[1:]`` where the
    target is a completion token (``IGNORE_INDEX`` elsewhere), ``gen_logp`` aligned with ``targets``
    (0 off the completion), right-padded to the longest row."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
    n = len(prompts)
    batch = {
        "inputs": torch.full((n, width), pad_id, dtype=torch.int64),
        "targets": torch.full((n, width), IGNORE_INDEX, dtype=torch.int64),
        "gen_logp": torch.zeros((n, width), dtype=torch.float32),
    }
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs, strict=True)):
        if not p or len(lp) != len(c):
            raise ValueError(f"rows_of: sample {i}: an empty prompt, or {len(lp)} log-probs for {len(c)} tokens")
        seq = torch.tensor([*p, *c], dtype=torch.int64)
        batch["inputs"][i, : len(seq) - 1] = seq[:-1]
        done = slice(len(p) - 1, len(seq) - 1)  # the positions whose target is a completion token
        batch["targets"][i, done] = seq[len(p) :]
        batch["gen_logp"][i, done] = torch.tensor(lp, dtype=torch.float32)
    return batch


@torch.no_grad()
def rollout(
    model: Any,
    params: Any,
    prompts: Sequence[Any],  # each with .messages: the chat up to the assistant's turn
    *,
    reward: Callable[[str, Any], float],  # (completion text, prompt) -> reward; malformed text -> 0
    tokenizer: Any,  # ftitan.data.Tokenizer (encode without special tokens, decode, eos_id)
    template: ChatTemplate,
    group_size: int,
    max_new_tokens: int,
    key: torch.Tensor,
    first_id: int = 0,
) -> Rollouts:
    """``group_size`` samples of each prompt at temperature 1, scored by ``reward`` (see the module docstring)."""
    if group_size < 1 or not prompts:
        raise ValueError(f"rollout: group_size={group_size} must be >= 1 and prompts non-empty")
    encoded = [tokenizer.encode(template.render(list(p.messages), add_generation_prompt=True)) for p in prompts]
    requests = [ids for ids in encoded for _ in range(group_size)]
    tokens, logprobs = generate(model, params, requests, max_new_tokens=max_new_tokens, sampling=Sampling(),
                                key=key, eos_id=_stop_ids(tokenizer, end_marker(template)), logprobs=True)  # fmt: skip
    texts = [completion_text(t, tokenizer, template) for t in tokens]
    rewards = torch.tensor([float(reward(text, prompts[i // group_size])) for i, text in enumerate(texts)])
    return Rollouts(
        batch=rows_of(requests, tokens, logprobs),
        rewards=rewards,
        lengths=torch.tensor([len(t) for t in tokens], dtype=torch.int64),
        ids=list(range(first_id, first_id + len(requests))),
        texts=texts,
    )

