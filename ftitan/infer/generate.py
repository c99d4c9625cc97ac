"""Batched generation over ragged prompts: prefill once, then one ``decode_step`` per token.

>>> import ftitan as ft
>>> out = ft.infer.generate(model, params, [[1, 2, 3], [4, 5]], max_new_tokens=8)         # greedy
>>> out = ft.infer.generate(model, params, prompts, max_new_tokens=8, key=ft.random.key(0),
...                         sampling=ft.infer.Sampling(temperature=0.8, top_p=0.95), eos_id=tok.eos_id)

Each request stops at its first ``eos_id`` (kept in its output) or after
``max_new_tokens``; the batch stops when every request has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ftitan import random
from ftitan.infer.cache import init_cache
from ftitan.infer.fuse import fuse_projections
from ftitan.infer.sampling import GREEDY, Sampling, sample
from ftitan.infer.step import (
    DecodeFn,
    GreedyFn,
    Padding,
    PrefillFn,
    make_decode_step,
    make_greedy_decode,
    make_prefill,
)

__all__ = ["GREEDY_CHUNK", "Steps", "generate", "steps_for"]

# greedy tokens per compiled call in generate: fewer calls (guards, wrapper) for a bigger graph to compile
GREEDY_CHUNK = 4


class Steps(NamedTuple):
    """A model's generation steps, all consuming their cache (``donate=True``)."""

    prefill: PrefillFn
    decode_step: DecodeFn
    greedy: GreedyFn | None  # GREEDY_CHUNK argmax steps per call; compiled only (None: eager)


# compiled steps by model: a new closure per call would recompile on every generate
_STEPS: dict[tuple[int, bool | str], tuple[Any, Steps]] = {}


def steps_for(model: Any, *, compile: bool | str = False) -> Steps:
    """:class:`Steps` of ``model``, the decode steps ``torch.compile``'d (fullgraph) with ``compile``
    (``True``: inductor, or a backend name such as ``"aot_eager"``); built once per model, so
    repeated generations reuse the compiled graphs."""
    cached = _STEPS.get((id(model.apply), compile))
    if cached is not None and cached[0] is model.apply:
        return cached[1]
    # generate never reads a cache twice, so the steps write into it in place (donate)
    prefill, decode = make_prefill(model, donate=True), make_decode_step(model, donate=True)
    greedy = make_greedy_decode(model, steps=GREEDY_CHUNK, donate=True) if compile else None
    if compile is True:  # inductor; its C++ wrapper saves a Python call per kernel, which is most of a
        # decode step's time beside the matmuls (10-20% faster steps on CPU)
        decode, greedy = (torch.compile(f, fullgraph=True, options={"cpp_wrapper": True}) for f in (decode, greedy))
    elif compile:
        decode, greedy = (torch.compile(f, fullgraph=True, backend=compile) for f in (decode, greedy))
    steps = Steps(prefill, decode, greedy)
    _STEPS[(id(model.apply), compile)] = (model.apply, steps)
    return steps


def _requests(
    prompts: Sequence[Sequence[int]], sampling: Sampling | Sequence[Sampling], key: torch.Tensor | None, vocab: int
) -> tuple[list[Sampling], list[torch.Tensor] | None]:
    """Each request's ``Sampling`` and key (its own seed, else ``fold_in(key, index)``); checks the prompts."""
    if not prompts:
        raise ValueError("generate: no prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token")
        if bad := [t for t in p if not 0 <= int(t) < vocab]:
            raise ValueError(f"generate: prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
    rows = [sampling] * len(prompts) if isinstance(sampling, Sampling) else list(sampling)
    if len(rows) != len(prompts):
        raise ValueError(f"generate: {len(rows)} Sampling settings for {len(prompts)} prompts")
    if all(r.greedy for r in rows):
        return rows, None
    if key is None and any(r.seed is None and not r.greedy for r in rows):
        raise ValueError("generate: sampling needs a key (key=ft.random.key(0)) or a seed in each request's Sampling")
    keys = [random.key(r.seed) if r.seed is not None else random.fold_in(key, i) for i, r in enumerate(rows)]
    return rows, keys


def _pad(prompts: Sequence[Sequence[int]], padding: Padding, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts padded (with token 0, masked out) to the longest: tokens (B, T) and lengths (B,)."""
    t = max(len(p) for p in prompts)
    rows = [[*p, *[0] * (t - len(p))] if padding == "right" else [*[0] * (t - len(p)), *p] for p in prompts]
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor([len(p) for p in prompts], device=device)


@torch.no_grad()
def generate(
    model: Any,
    params: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling | Sequence[Sampling] = GREEDY,
    key: torch.Tensor | None = None,
    eos_id: int | Sequence[int] | None = None,
    padding: Padding = "left",
    compile: bool | str = False,
    fuse: bool = True,
) -> list[list[int]]:  # the new tokens of each prompt
    """Continue each prompt by up to ``max_new_tokens`` tokens (see the module docstring).

    ``sampling`` is one ``Sampling`` for every request or one per request;
    ``padding`` puts the batch's padding before ("left") or after
    ("right") the shorter prompts (same tokens either way); ``compile``
    runs the decode step under ``torch.compile`` (``True``: inductor, or a
    backend name), traced once per model and batch shape. ``fuse`` stacks the q/k/v and gate/up
    projections first (:func:`~ftitan.infer.fuse_projections`; pass fused params to skip the copy).
    """
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 1")
    if padding not in ("left", "right"):
        raise ValueError(f"generate: padding={padding!r}; expected 'left' or 'right'")
    rows, keys = _requests(prompts, sampling, key, model.config.vocab_size)
    stop = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    params = fuse_projections(params) if fuse else params
    tokens, lengths = _pad(prompts, padding, params["embed"].device)
    cache = init_cache(model, params, batch=len(prompts), slots=tokens.shape[1] + max_new_tokens)
    steps = steps_for(model, compile=compile)
    logits, cache = steps.prefill(params, tokens, cache, lengths=lengths, padding=padding)
    drawn: list[torch.Tensor] = []  # (B, n) chunks; read back once at the end unless EOS must be watched
    done = torch.zeros(len(prompts), dtype=torch.bool, device=tokens.device)
    stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=tokens.device)
    made = 0
    while True:
        if keys is None and made and steps.greedy is not None and max_new_tokens - made >= GREEDY_CHUNK:
            chunk, logits, cache = steps.greedy(params, drawn[-1][:, -1], cache)  # the next GREEDY_CHUNK tokens
        else:
            if made:
                logits, cache = steps.decode_step(params, drawn[-1][:, -1], cache)
            step_keys = None if keys is None else [random.fold_in(k, made) for k in keys]
            chunk = (logits.argmax(-1) if keys is None else sample(logits, step_keys, rows))[:, None]
        drawn.append(chunk)
        made += chunk.shape[1]
        if stop:
            done |= torch.isin(chunk, stop_ids).any(dim=1)
            if bool(done.all()):
                break
        if made >= max_new_tokens:
            break
    out = torch.cat(drawn, dim=1).tolist()
    return [_until_stop(row, stop) for row in out]


def _until_stop(row: list[int], stop: set[int]) -> list[int]:
    """``row`` up to and including its first stop token."""
    end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
    return row[:end]
