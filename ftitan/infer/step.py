"""``prefill`` and ``decode_step``: pure functions built from a model's own ``apply`` and a KV cache.

>>> prefill, decode_step = make_prefill(model), make_decode_step(model)
>>> cache = init_cache(model, params, batch=2, slots=64)
>>> logits, cache = prefill(params, tokens, cache, lengths=torch.tensor([5, 3]), padding="right")
>>> logits, cache = decode_step(params, logits.argmax(-1), cache)   # (B, V), one new token per row

Both return the logits of each row's newest token and a new cache; the cache
passed in is not modified. ``decode_step`` keeps every shape static (B rows,
S slots), so ``torch.compile(decode_step, fullgraph=True)`` traces it once
for a whole generation, whatever the tokens or the rows' lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from ftitan import nn
from ftitan.infer.cache import Donated, KVCache
from ftitan.models.base import soft_cap

__all__ = ["DecodeFn", "GreedyFn", "Padding", "PrefillFn", "head_logits", "make_decode_step", "make_greedy_decode",
           "make_prefill"]

Padding = Literal["left", "right"]
PrefillFn = Callable[..., tuple[torch.Tensor, KVCache]]
DecodeFn = Callable[[Any, torch.Tensor, KVCache], tuple[torch.Tensor, KVCache]]


def head_logits(model: Any, params: Any, h: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., V)
    """The logits of final-normed hidden states: the head, then the model's soft-cap (if any), as
    ``apply(..., logits=True)`` computes them."""
    z = nn.linear(h, model.head(params), invariant=nn.invariant.enabled(model.config))
    return soft_cap(z, model.logit_softcap)


def _next_logits(model: Any, params: Any, h: torch.Tensor, last: torch.Tensor) -> torch.Tensor:  # (B, V)
    """Logits of hidden state ``h[b, last[b]]`` of each row (B, T, D) -> (B, V): the head on B rows only."""
    rows = torch.arange(h.shape[0], device=h.device)
    return head_logits(model, params, h[rows, last])


def _run(model: Any, params: Any, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, donate: bool
         ) -> tuple[torch.Tensor, KVCache]:  # fmt: skip
    """``apply(..., logits=False)`` through ``cache`` (its own buffers written when ``donate``)."""
    h, out = model.apply(params, tokens, positions=positions, cache=Donated(cache) if donate else cache, logits=False)
    return h, out.cache if donate else out


def make_prefill(model: Any, *, donate: bool = False) -> PrefillFn:
    """``prefill(params, tokens, cache, *, lengths=None, padding="right") -> (logits (B, V), cache)``.

    ``tokens`` (B, T) are the prompts, padded on ``padding``'s side to
    ``T``; ``lengths`` (B,) counts each row's real tokens (default all
    ``T``). ``cache`` must be fresh (:func:`~ftitan.infer.init_cache`, at
    least ``T`` slots). Each row's tokens get positions ``0 .. len - 1``
    whichever side its padding is on; the logits are those of its last real
    token, equal to the full forward's (``apply(params, prompt)[:, -1]``).
    With ``donate`` the cache passed in is consumed: its buffers are written
    in place (:class:`~ftitan.infer.cache.Donated`).
    """

    def prefill(
        params: Any,
        tokens: torch.Tensor,  # (B, T) int, padded
        cache: KVCache,
        *,
        lengths: torch.Tensor | None = None,  # (B,) int real tokens per row; default T
        padding: Padding = "right",
    ) -> tuple[torch.Tensor, KVCache]:  # (B, V), cache
        b, t = tokens.shape
        if padding not in ("left", "right"):
            raise ValueError(f"prefill: padding={padding!r}; expected 'left' or 'right'")
        if t > cache.slots or cache.start.shape[0] != b:
            raise ValueError(f"prefill: {b} prompts of {t} tokens do not fit a cache of {cache.start.shape[0]} rows "
                             f"x {cache.slots} slots; build it with init_cache(..., batch={b}, slots>={t})")  # fmt: skip
        lengths = torch.full((b,), t, device=tokens.device) if lengths is None else lengths.to(tokens.device)
        if not torch.compiler.is_compiling() and (tuple(lengths.shape) != (b,) or not (
                (lengths >= 1) & (lengths <= t)).all()):  # fmt: skip
            raise ValueError(f"prefill: lengths {lengths.tolist()} must give 1 .. {t} real tokens for each of {b} rows")
        start = t - lengths if padding == "left" else torch.zeros_like(lengths)
        positions = (torch.arange(t, device=tokens.device) - start[:, None]).clamp(min=0)  # (B, T); pads at 0
        end = start + lengths
        # fresh: the prompt fills slots 0 .. T - 1; recurrent layers' states stop at each row's last real token
        cache = KVCache(cache.layers, start, torch.zeros_like(start), end)
        h, cache = _run(model, params, tokens, positions, cache, donate)
        return _next_logits(model, params, h, end - 1), KVCache(cache.layers, start, end)

    return prefill


def make_decode_step(model: Any, *, donate: bool = False) -> DecodeFn:
    """``decode_step(params, token, cache) -> (logits (B, V), cache)``: one new token (B,) per row.

    The token goes into slot ``cache.end`` of its row at position
    ``end - start``; the logits are its next-token logits, equal to the
    full forward's at that position. With ``donate`` the cache passed in is
    consumed (written in place: one slot per row instead of a new copy of
    the whole cache per step; the same values).
    """

    def decode_step(params: Any, token: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        positions = (cache.end - cache.start)[:, None]  # (B, 1)
        h, cache = _run(model, params, token[:, None], positions, cache, donate)
        logits = head_logits(model, params, h[:, 0])
        return logits, KVCache(cache.layers, cache.start, cache.end + 1)

    return decode_step


# (params, token (B,), cache) -> (the next `steps` greedy tokens (B, steps), logits after the last, cache)
GreedyFn = Callable[[Any, torch.Tensor, KVCache], tuple[torch.Tensor, torch.Tensor, KVCache]]


def make_greedy_decode(model: Any, *, steps: int, donate: bool = False) -> GreedyFn:
    """``steps`` decode steps in one function, each feeding its argmax to the next: under
    ``torch.compile`` one graph call per ``steps`` tokens, so the per-call costs (guards, wrapper)
    are paid once for all of them. Token ``j`` is what ``decode_step`` + argmax would give."""
    if steps < 1:
        raise ValueError(f"make_greedy_decode: steps={steps} must be >= 1")
    decode_step = make_decode_step(model, donate=donate)

    def greedy_decode(params: Any, token: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        tokens = []
        for _ in range(steps):
            logits, cache = decode_step(params, token, cache)
            token = logits.argmax(-1)
            tokens.append(token)
        return torch.stack(tokens, dim=1), logits, cache

    return greedy_decode
