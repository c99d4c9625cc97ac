"""Token embedding: a ``(vocab, embed)`` table looked up by token id."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftitan.nn.param import Param, init, normal_init

__all__ = ["EMBED_AXES", "embed", "embed_param", "init_embed"]

EMBED_AXES = ("vocab", "embed")


def embed(
    tokens: torch.Tensor,  # (B, T) int
    table: torch.Tensor,  # (V, D)
) -> torch.Tensor:  # (B, T, D)
    """Rows of ``table`` at ``tokens``."""
    return F.embedding(tokens, table)


def embed_param(vocab_size: int, dim: int, *, std: float = 0.02) -> Param:
    """Spec of a ``(vocab_size, dim)`` table, normal with ``std`` (as HF Llama)."""
    return Param(shape=(vocab_size, dim), axes=EMBED_AXES, init=normal_init(std))


def init_embed(
    key: torch.Tensor,
    vocab_size: int,
    dim: int,
    *,
    std: float = 0.02,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # (V, D)
    return init(embed_param(vocab_size, dim, std=std), key, dtype=dtype, device=device)
