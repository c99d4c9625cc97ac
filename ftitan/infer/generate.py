"""Batched generation over ragged prompts: prefill once, then one ``decode_step`` per token.

>>> import ftitan as ft
>>> out = ft.infer.generate(model, params, [[1, 2, 3], [4, 5]], max_new_tokens=8)         # greedy
>>> out = ft.infer.generate(model, params, prompts, max_new_tokens=8, key=ft.random.key(0),
...                         sampling=ft.infer.Sampling(temperature=0.8, top_p=0.95), eos_id=tok.eos_id)

Each request stops at its first ``eos_id`` (kept in its output) or after
``max_new_tokens``; the batch stops when every request has.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
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
from ftitan.models import lora
from ftitan.nn import invariant as nn_invariant

__all__ = ["GREEDY_CHUNK", "MAX_SHAPES", "Compile", "Steps", "generate", "slots_for", "steps_for"]

# greedy tokens per compiled call in generate: fewer calls (guards, wrapper) for a bigger graph to compile
GREEDY_CHUNK = 4


class Steps(NamedTuple):
    """A model's generation steps, all consuming their cache (``donate=True``), and the softmaxes that
    sample from and score its logits."""

    prefill: PrefillFn
    decode_step: DecodeFn
    greedy: GreedyFn | None  # GREEDY_CHUNK argmax steps per call; compiled only (None: eager)
    softmax: Callable[..., torch.Tensor]  # (x, dim) -> probabilities: the model's mode's (batch-invariant or not)
    log_softmax: Callable[..., torch.Tensor]  # (x, dim) -> log-probabilities, likewise


# compiled steps by (model, compile): a new closure per call would compile again on every generate
_STEPS: dict[tuple[int, Any], tuple[Any, Steps]] = {}

# compiled graphs one model's steps may hold: one per (batch size, slot bucket) it generates for
MAX_SHAPES = 64

Compile = bool | str | Callable[..., Any]


def slots_for(n: int) -> int:
    """KV-cache slots ``generate`` gives ``n`` positions (prompt + new tokens): ``n`` rounded up to a
    power of two (at least 16), or above 1024 to a multiple of 1024. The compiled decode steps are
    traced once per (model, batch size, bucket), not once per prompt length; the extra slots stay
    masked, so the tokens do not change."""
    if n < 1:
        raise ValueError(f"slots_for: n={n} must be >= 1")
    return max(16, 1 << (n - 1).bit_length()) if n <= 1024 else -(-n // 1024) * 1024


def _compiled(fn: Callable[..., Any], compile: Compile) -> Callable[..., Any]:
    """``fn`` under ``torch.compile``: fullgraph, static shapes, its own recompile budget.

    Every model's steps are closures over the same code, and dynamo keeps its compiled graphs,
    recompile limit and automatic-dynamic size profile per code object. Without ``dynamic=False``
    and ``isolate_recompiles`` a second model (or shape) counted as a recompile of the first:
    sizes that differed between them became symbolic, and after 8 the fullgraph compile failed."""
    kwargs: dict[str, Any] = dict(fullgraph=True, dynamic=False, isolate_recompiles=True, recompile_limit=MAX_SHAPES)
    if compile is True:  # inductor; its C++ wrapper saves a Python call per kernel, which is most of a
        # decode step's time beside the matmuls (10-20% faster steps on CPU)
        return torch.compile(fn, options={"cpp_wrapper": True}, **kwargs)
    return torch.compile(fn, backend=compile, **kwargs)


def steps_for(model: Any, *, compile: Compile = False) -> Steps:
    """:class:`Steps` of ``model``, the decode steps ``torch.compile``'d (fullgraph, static shapes)
    with ``compile`` (``True``: inductor, or a backend name such as ``"aot_eager"`` or a backend
    callable); built once per model, so repeated generations reuse the compiled graphs: one per
    batch size and :func:`slots_for` bucket, each model with its own recompile budget
    (``MAX_SHAPES``)."""
    cached = _STEPS.get((id(model.apply), compile))
    if cached is not None and cached[0] is model.apply:
        return cached[1]
    # generate never reads a cache twice, so the steps write into it in place (donate)
    prefill, decode = make_prefill(model, donate=True), make_decode_step(model, donate=True)
    greedy = make_greedy_decode(model, steps=GREEDY_CHUNK, donate=True) if compile else None
    invariant = nn_invariant.enabled(model.config)
    softmax = nn_invariant.softmax if invariant else torch.softmax
    log_softmax = nn_invariant.log_softmax if invariant else torch.log_softmax
    if compile:
        decode, greedy = _compiled(decode, compile), _compiled(greedy, compile)
        if invariant:  # some twenty elementwise ops each, one kernel compiled (the same bits: ftitan.nn.invariant)
            softmax, log_softmax = _compiled(softmax, compile), _compiled(log_softmax, compile)
    steps = Steps(prefill, decode, greedy, softmax, log_softmax)
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
    compile: Compile = False,
    fuse: bool = True,
    logprobs: bool = False,
) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:  # the new tokens of each prompt
    """Continue each prompt by up to ``max_new_tokens`` tokens (see the module docstring).

    ``sampling`` is one ``Sampling`` for every request or one per request;
    ``padding`` puts the batch's padding before ("left") or after
    ("right") the shorter prompts (same tokens either way); ``compile``
    runs the decode steps under ``torch.compile`` (``True``: inductor, or a
    backend name or callable), with static shapes: traced once per model, batch size and
    :func:`slots_for` bucket of ``longest prompt + max_new_tokens``, so many models, batch sizes
    and prompt lengths in one process each compile once (the prefill runs eagerly). ``fuse``
    stacks the q/k/v and gate/up projections first (:func:`~ftitan.infer.fuse_projections`; pass
    fused params to skip the copy). ``logprobs=True`` also returns each new token's log-probability
    under the model's raw distribution (``log_softmax`` of the float32 logits: temperature 1, before
    top-k / top-p), what an RL trainer compares its own recomputation with. A model in the
    batch-invariant mode (``ftitan.config.batch_invariant``) gives the same tokens and log-probs
    for a request whatever the batch, padding or prompt lengths beside it, bit-equal to the
    trainer's ``ftitan.rl.token_logprobs_and_entropy`` (``fuse`` is ignored: it keeps the
    trainer's GEMM shapes).
    """
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 1")
    if padding not in ("left", "right"):
        raise ValueError(f"generate: padding={padding!r}; expected 'left' or 'right'")
    rows, keys = _requests(prompts, sampling, key, model.config.vocab_size)
    longest, limit = max(len(p) for p in prompts), model.config.max_seq_len
    if longest + max_new_tokens > limit:  # RoPE runs on, but the model never saw those positions
        warnings.warn(f"generate: the longest prompt ({longest} tokens) + max_new_tokens={max_new_tokens} = "
                      f"{longest + max_new_tokens} positions, more than the model's max_seq_len={limit} (positions "
                      f"it was never trained on); shorten the prompt or lower max_new_tokens", stacklevel=3)  # fmt: skip
    stop = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    if isinstance(model.config, lora.Config):  # a LoRA model: decode the merged weights
        model, params = lora.merged_model(model, params)
    invariant = nn_invariant.enabled(model.config)
    # fusing changes a GEMM's width, and the batch-invariant mode's tiles fix the trainer's (unfused) ones
    params = fuse_projections(params) if fuse and not invariant else params
    tokens, lengths = _pad(prompts, padding, params["embed"].device)
    cache = init_cache(model, params, batch=len(prompts), slots=slots_for(tokens.shape[1] + max_new_tokens))
    steps = steps_for(model, compile=compile)
    logits, cache = steps.prefill(params, tokens, cache, lengths=lengths, padding=padding)
    drawn: list[torch.Tensor] = []  # (B, n) chunks; read back once at the end unless EOS must be watched
    scored: list[torch.Tensor] = []  # (B, 1) log-probs of the drawn tokens (logprobs=True)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=tokens.device)
    stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=tokens.device)
    made = 0
    while True:
        chunked = keys is None and steps.greedy is not None and not logprobs  # argmax steps, no logits kept
        if chunked and made and max_new_tokens - made >= GREEDY_CHUNK:
            chunk, logits, cache = steps.greedy(params, _last(drawn), cache)  # the next GREEDY_CHUNK tokens
        else:
            if made:
                logits, cache = steps.decode_step(params, _last(drawn), cache)
            step_keys = None if keys is None else [random.fold_in(k, made) for k in keys]
            drawn_now = logits.argmax(-1) if keys is None else sample(logits, step_keys, rows, softmax=steps.softmax)
            chunk = drawn_now[:, None]
            if logprobs:  # the batch-invariant mode: the trainer's own log-softmax (ftitan.train.dpo.token_logprobs)
                scored.append(steps.log_softmax(logits.float(), dim=-1).gather(1, chunk))  # (B, 1)
        drawn.append(chunk)
        made += chunk.shape[1]
        if stop:
            done |= torch.isin(chunk, stop_ids).any(dim=1)
            if bool(done.all()):
                break
        if made >= max_new_tokens:
            break
    out = [_until_stop(row, stop) for row in torch.cat(drawn, dim=1).tolist()]
    if not logprobs:
        return out
    lps = torch.cat(scored, dim=1).tolist()
    return out, [lp[: len(row)] for row, lp in zip(out, lps, strict=True)]


def _last(drawn: list[torch.Tensor]) -> torch.Tensor:  # (B,)
    """The newest token of each row, a contiguous tensor of its own: a column view of a (B, n) chunk
    would give the compiled steps another stride (and base) to guard on for every chunk width
    (a plain ``clone`` keeps the stride when B is 1)."""
    return drawn[-1][:, -1].clone(memory_format=torch.contiguous_format)


def _until_stop(row: list[int], stop: set[int]) -> list[int]:
    """``row`` up to and including its first stop token."""
    end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
    return row[:end]
