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
from ftitan import random
from ftitan.infer import GREEDY, Sampling, generate
from ftitan.train.exact_match import _stop_ids, completion_text, end_marker
from ftitan.train.losses import IGNORE_INDEX

__all__ = ["Rollouts", "episode_rollout", "rollout", "rows_of", "sequence_rows", "turn_end", "vllm_generate_fn"]


class Rollouts(NamedTuple):
    """``P * G`` scored samples, prompt-major (``G`` consecutive samples per prompt)."""

    batch: dict[str, torch.Tensor]  # inputs, targets, gen_logp: (N, T)
    rewards: torch.Tensor  # (N,) float32
    lengths: torch.Tensor  # (N,) int64: completion tokens (the stop token included)
    ids: list[int]  # a unique id per sample (first_id + i), to account for every rollout
    texts: list[str]  # each completion's text up to the template's end marker


def rows_of(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
            logprobs: Sequence[Sequence[float]], *, pad_id: int = 0, width: int | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Training rows of ``prompt + completion``: ``inputs = seq[:-1]``, ``targets = seq[1:]`` where the
    target is a completion token (``IGNORE_INDEX`` elsewhere), ``gen_logp`` aligned with ``targets``
    (0 off the completion), right-padded to the longest row (or to ``width``)."""
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs, strict=True)):
        if not p or len(lp) != len(c):
            raise ValueError(f"rows_of: sample {i}: an empty prompt, or {len(lp)} log-probs for {len(c)} tokens")
    return sequence_rows([[*p, *c] for p, c in zip(prompts, completions)],
                         [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions)],
                         [[0.0] * len(p) + list(lp) for p, lp in zip(prompts, logprobs)], pad_id=pad_id, width=width)  # fmt: skip


def sequence_rows(seqs: Sequence[Sequence[int]], trained: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                  *, pad_id: int = 0, width: int | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Training rows of whole token sequences (an episode: prompt, model turns, tool results): token ``j`` is a
    target iff ``trained[j]`` (the model wrote it), with its generator log-prob ``logprobs[j]``. ``inputs =
    seq[:-1]``, ``targets = seq[1:]`` (``IGNORE_INDEX`` where not trained), right-padded to the longest row or
    to ``width`` (a longer row raises ``ValueError``)."""
    longest = max(len(q) for q in seqs) - 1
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"sequence_rows: a sequence of {longest + 1} tokens does not fit rows of width {width} "
                         f"(width + 1 tokens); raise the width (ftitan rl: --data.seq-len) or lower max_new_tokens")  # fmt: skip
    n = len(seqs)
    batch = {
        "inputs": torch.full((n, width), pad_id, dtype=torch.int64),
        "targets": torch.full((n, width), IGNORE_INDEX, dtype=torch.int64),
        "gen_logp": torch.zeros((n, width), dtype=torch.float32),
    }
    for i, (q, m, lp) in enumerate(zip(seqs, trained, logprobs, strict=True)):
        if not len(q) == len(m) == len(lp) or (len(q) and m[0]):
            raise ValueError(f"sequence_rows: sequence {i}: {len(q)} tokens, {len(m)} mask entries, {len(lp)} "
                             f"log-probs (one each), and its first token cannot be trained (nothing precedes it)")  # fmt: skip
        seq = torch.tensor(q, dtype=torch.int64)
        on = torch.tensor(m[1:], dtype=torch.bool)
        batch["inputs"][i, : len(q) - 1] = seq[:-1]
        batch["targets"][i, : len(q) - 1] = torch.where(on, seq[1:], IGNORE_INDEX)
        batch["gen_logp"][i, : len(q) - 1] = torch.where(on, torch.tensor(lp[1:], dtype=torch.float32), 0.0)
    return batch


def turn_end(ids: Sequence[int], tokenizer: Any, marker: str | None, stop: Sequence[int]) -> int | None:
    """How many of the generated ``ids`` make the turn: up to and including the first stop token, or the token
    that completes the template's end ``marker`` in the decoded text (a marker the tokenizer splits into
    several tokens, e.g. a BPE trained on chat text: ``".<|" "end" "|>"``); ``None`` when the turn never ends."""
    for j, t in enumerate(ids):
        if t in stop:
            return j + 1
        if marker is not None and marker in tokenizer.decode(list(ids[: j + 1])):
            return j + 1
    return None


def _cut(tokens: list[list[int]], logprobs: list[list[float]], tokenizer: Any,
         template: ChatTemplate) -> tuple[list[list[int]], list[list[float]], list[bool]]:  # fmt: skip
    """Each sample up to the end of its turn (:func:`turn_end`): what is trained on and scored; and whether it ended."""
    marker, stop = end_marker(template), _stop_ids(tokenizer, end_marker(template))
    out_t, out_l, ended = [], [], []
    for t, lp in zip(tokens, logprobs, strict=True):
        n = turn_end(t, tokenizer, marker, stop)
        out_t.append(t[:n] if n else t)
        out_l.append(lp[:n] if n else lp)
        ended.append(n is not None)
    return out_t, out_l, ended


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
    key: torch.Tensor | None,  # None: greedy (an evaluation)
    first_id: int = 0,
    generate_fn: Callable[..., Any] = generate,  # the generator: ftitan.infer.generate's signature
) -> Rollouts:
    """``group_size`` samples of each prompt at temperature 1, scored by ``reward`` (see the module docstring)."""
    if group_size < 1 or not prompts:
        raise ValueError(f"rollout: group_size={group_size} must be >= 1 and prompts non-empty")
    encoded = [tokenizer.encode(template.render(list(p.messages), add_generation_prompt=True)) for p in prompts]
    requests = [ids for ids in encoded for _ in range(group_size)]
    tokens, logprobs = generate_fn(model, params, requests, max_new_tokens=max_new_tokens,
                                sampling=GREEDY if key is None else Sampling(), key=key, eos_id=_stop_ids(tokenizer, end_marker(template)), logprobs=True)  # fmt: skip
    tokens, logprobs, _ = _cut(tokens, logprobs, tokenizer, template)  # past the end of the turn: not trained on
    texts = [completion_text(t, tokenizer, template) for t in tokens]
    rewards = torch.tensor([float(reward(text, prompts[i // group_size])) for i, text in enumerate(texts)])
    return Rollouts(
        batch=rows_of(requests, tokens, logprobs),
        rewards=rewards,
        lengths=torch.tensor([len(t) for t in tokens], dtype=torch.int64),
        ids=list(range(first_id, first_id + len(requests))),
        texts=texts,
    )



@torch.no_grad()
def episode_rollout(
    model: Any,
    params: Any,
    prompts: Sequence[Any],
    *,
    env: Any,  # ftitan.rl.ToolEnv: reset(prompt) -> state, step(state, text) -> (state, done, reward)
    tokenizer: Any,
    template: ChatTemplate,
    group_size: int,
    max_new_tokens: int,  # per assistant turn
    key: torch.Tensor | None,  # None: greedy
    first_id: int = 0,
    max_len: int | None = None,  # an episode that would outgrow this many tokens ends with reward 0
    generate_fn: Callable[..., Any] = generate,  # the generator: ftitan.infer.generate's signature
) -> Rollouts:
    """``group_size`` multi-turn episodes of each prompt in ``env`` (a tool environment), every active
    episode's next turn one batched :func:`~ftitan.infer.generate` call.

    An episode is one token sequence: the rendered prompt, then each assistant turn as the model sampled it
    (its tokens and the generator's log-probs kept as they are, never re-tokenized) and each tool result
    rendered by the template (the text the template adds after the assistant's turn, tokenized: not
    trained on). The episode ends when ``env.step`` says so (an answer, or ``env.max_turns``), with reward 0
    when a turn runs out of ``max_new_tokens`` before the template's end marker or the episode would pass
    ``max_len`` tokens. Turn ``t``'s request ``j`` samples from ``fold_in(fold_in(key, t), j)``.
    ``texts``: the assistant turns of each episode joined by newlines.
    """
    if group_size < 1 or not prompts:
        raise ValueError(f"episode_rollout: group_size={group_size} must be >= 1 and prompts non-empty")
    stop = _stop_ids(tokenizer, end_marker(template))
    states = [env.reset(p) for p in prompts for _ in range(group_size)]
    texts = [template.render(list(s.messages), add_generation_prompt=True) for s in states]  # what ids decode to
    ids = [tokenizer.encode(t) for t in texts]
    trained = [[0] * len(q) for q in ids]
    logps: list[list[float]] = [[0.0] * len(q) for q in ids]
    rewards, said = [0.0] * len(states), [[] for _ in states]
    active, turn = list(range(len(states))), 0
    sampling = GREEDY if key is None else Sampling()
    if max_len is not None:  # a prompt with no room for one turn: its episodes end at once, reward 0
        active = [i for i in active if len(ids[i]) + max_new_tokens <= max_len]
    while active:
        tokens, lps = generate_fn(model, params, [ids[i] for i in active], max_new_tokens=max_new_tokens,
                               sampling=sampling, key=None if key is None else random.fold_in(key, turn),
                               eos_id=stop, logprobs=True)  # fmt: skip
        tokens, lps, ended = _cut(tokens, lps, tokenizer, template)
        still = []
        for i, c, lp, end in zip(active, tokens, lps, ended, strict=True):
            ids[i] += c
            trained[i] += [1] * len(c)
            logps[i] += lp
            text = completion_text(c, tokenizer, template)
            said[i].append(text)
            if not end:  # cut at max_new_tokens mid-turn: the episode ends, reward 0
                continue
            texts[i] += tokenizer.decode(c)
            states[i], done, rewards[i] = env.step(states[i], text)
            if done:
                continue
            follow = template.render(list(states[i].messages), add_generation_prompt=True)
            if not follow.startswith(texts[i]):  # the template re-renders the turn otherwise: cannot extend ids
                continue
            extra = tokenizer.encode(follow[len(texts[i]):])  # the tool's result and the next generation prompt
            if max_len is not None and len(ids[i]) + len(extra) + max_new_tokens > max_len:
                continue  # no room for another turn: the episode ends here, reward 0
            ids[i] += extra
            trained[i] += [0] * len(extra)
            logps[i] += [0.0] * len(extra)
            texts[i] = follow
            still.append(i)
        active, turn = still, turn + 1
    return Rollouts(
        batch=sequence_rows(ids, trained, logps),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        lengths=torch.tensor([sum(m) for m in trained], dtype=torch.int64),
        ids=list(range(first_id, first_id + len(states))),
        texts=["\n".join(s) for s in said],
    )


def vllm_generate_fn(llm: Any) -> Callable[..., Any]:
    """A ``generate_fn`` for :func:`rollout` / :func:`episode_rollout` that samples with the in-process vLLM
    engine ``llm`` (``ftitan.vllm.engine``) instead of :func:`ftitan.infer.generate`: the same arguments,
    the same ``(tokens, logprobs)`` result. Request ``i`` samples with the seed ``key_data(fold_in(key, i))``
    (greedy when ``key`` is None); the log-probs are vLLM's raw ones (temperature 1; in the batch-invariant
    mode the model's invariant log-softmax: the trainer's bits). The engine's weights are the caller's to
    keep current (``ftitan.vllm.push_weights``)."""
    from vllm import SamplingParams

    from ftitan.vllm import complete

    def generate_fn(model: Any, params: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    sampling: Any, key: torch.Tensor | None, eos_id: Any = None,
                    logprobs: bool = False) -> Any:  # fmt: skip
        stop = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id)
        greedy = key is None or sampling.greedy
        requests = [SamplingParams(max_tokens=max_new_tokens, temperature=0.0 if greedy else 1.0,
                                   seed=None if greedy else random.key_data(random.fold_in(key, i)) % 2**31,
                                   stop_token_ids=stop, logprobs=0 if logprobs else None)
                    for i in range(len(prompts))]  # fmt: skip
        out = complete(llm, prompts, requests)
        tokens = [c.tokens for c in out]
        return (tokens, [list(c.logprobs or []) for c in out]) if logprobs else tokens

    return generate_fn
