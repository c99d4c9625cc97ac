"""Sampling from logits, and simple generation by full recomputation.

``generate_tokens`` reruns the whole sequence through ``model.apply`` for each
new token (no KV cache): simple and obviously correct, fine for the small
models a CPU trains. The KV-cache path (``prefill`` / ``decode_step``) will
replace it without changing this interface.
"""

from __future__ import annotations

from typing import Any

import torch

from ftitan import random

__all__ = ["generate_tokens", "sample_logits"]


def sample_logits(
    logits: torch.Tensor,  # (B, V)
    key: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # (B,) int64
    """One token per row: greedy at ``temperature == 0``, else sampled after top-k / top-p filtering."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"sample_logits: need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temperature}, {top_p}, {top_k}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first one always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    gen = torch.Generator().manual_seed(random.key_data(key) >> 1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate_tokens(
    model: Any,
    params: Any,
    prompt: list[int],
    *,
    max_new_tokens: int,
    key: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
) -> list[int]:
    """``prompt`` continued by up to ``max_new_tokens`` tokens (stops after ``eos_id``)."""
    if not prompt:
        raise ValueError("generate_tokens: the prompt must have at least one token")
    window = model.config.max_seq_len
    tokens = list(prompt)
    for i in range(max_new_tokens):
        x = torch.tensor([tokens[-window:]], dtype=torch.long)
        logits, _ = model.apply(params, x)
        nxt = int(sample_logits(logits[:, -1], random.fold_in(key, i), temperature=temperature, top_k=top_k, top_p=top_p))
        tokens.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
    return tokens
