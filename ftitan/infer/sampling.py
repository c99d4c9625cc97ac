"""Picking the next token: greedy, temperature, top-k, top-p, each request with its own settings and key.

A row's draw depends only on its logits, its ``Sampling`` and its key: not on
the other rows of the batch, so a request gives the same tokens alone or
batched with others. Sampling is an exponential race (``argmax(p / E)``,
``E ~ Exp(1)`` drawn from the row's key), which picks token ``i`` with
probability ``p_i`` after the filters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from ftitan import random
from ftitan.nn import invariant as nn_invariant

__all__ = ["GREEDY", "Sampling", "sample"]


@attrs.frozen(kw_only=True)
class Sampling:
    """How one request picks its tokens (``Sampling()`` samples from the full distribution)."""

    temperature: float = 1.0  # logits / temperature before the filters; 0: greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # then keep the smallest most-likely set whose probability reaches top_p (Holtzman et al. 2020)
    seed: int | None = None  # this request's own seed; None: derived from generate's key and the request's index

    def __attrs_post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"Sampling.temperature={self.temperature!r}: must be >= 0 (0 is greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"Sampling.top_k={self.top_k!r}: must be an int >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p={self.top_p!r}: must be in (0, 1] (1 keeps every token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling(temperature=0.0)


def _filtered_probs(logits: torch.Tensor, rows: Sequence[Sampling], softmax: Callable[..., torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per row: probabilities in descending order after temperature, top-k and top-p, and that order."""
    v = logits.shape[-1]
    temperature = torch.tensor([r.temperature or 1.0 for r in rows], device=logits.device)
    top_k = torch.tensor([min(r.top_k, v) or v for r in rows], device=logits.device)
    top_p = torch.tensor([r.top_p for r in rows], device=logits.device)
    ordered, order = torch.sort(logits / temperature[:, None], dim=-1, descending=True)
    keep = torch.arange(v, device=logits.device) < top_k[:, None]
    kept = ordered.masked_fill(~keep, float("-inf"))
    probs = softmax(kept, dim=-1)
    # drop a token when the mass before it already reaches top_p (the most likely one always stays)
    keep = keep & (probs.cumsum(-1) - probs < top_p[:, None])
    return probs.masked_fill(~keep, 0.0), order


def sample(
    logits: torch.Tensor,  # (B, V)
    keys: Sequence[torch.Tensor] | None,  # one key per row (ftitan.random keys); None when every row is greedy
    sampling: Sampling | Sequence[Sampling] = GREEDY,
    *,
    invariant: bool = False,
    softmax: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:  # (B,) int64
    """One token per row of ``logits``, by that row's ``Sampling`` (one for all rows, or one per row).
    ``invariant``: the softmax with a fixed-order sum (``ftitan.nn.invariant``), so a row draws the
    same token whatever the batch (the batch-invariant mode); ``softmax`` (``(x, dim) -> probs``)
    overrides the choice (``ftitan.infer.generate`` passes its steps' own, compiled with them)."""
    b = logits.shape[0]
    rows = [sampling] * b if isinstance(sampling, Sampling) else list(sampling)
    if len(rows) != b:
        raise ValueError(f"sample: {len(rows)} Sampling settings for {b} rows of logits")
    logits = logits.float()
    greedy = logits.argmax(-1)
    if all(r.greedy for r in rows):
        return greedy
    if keys is None or len(keys) != b:
        raise ValueError(f"sample: sampling needs one key per row ({b}), got {None if keys is None else len(keys)}")
    softmax = softmax or (nn_invariant.softmax if invariant else torch.softmax)
    probs, order = _filtered_probs(logits, rows, softmax)
    # one batched draw (vmap over the row keys: bit-equal to drawing each row's noise alone)
    row_keys = keys if isinstance(keys, torch.Tensor) else torch.stack(list(keys))
    noise = torch.func.vmap(lambda k: random.exponential(k, (logits.shape[-1],), device=logits.device))(row_keys)
    choice = (probs / noise).argmax(-1, keepdim=True)
    drawn = order.gather(-1, choice)[:, 0]
    is_greedy = torch.tensor([r.greedy for r in rows], device=logits.device)
    return torch.where(is_greedy, greedy, drawn)
