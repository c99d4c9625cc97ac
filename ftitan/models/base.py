"""``Model``: a model family's pure functions bundled with its config.

Every family module (``llama``, later ``qwen3``, ``deepseek_v3``, ...) exposes
``model(cfg) -> Model``. Nothing here holds state: params live in the tree
``init`` returns and are passed to ``apply`` on each call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from ftitan import tree

__all__ = ["ApplyFn", "InitFn", "Model"]


class InitFn(Protocol):
    def __call__(
        self, key: torch.Tensor, *, dtype: torch.dtype = ..., device: torch.device | str | None = ...
    ) -> tree.Tree: ...


class ApplyFn(Protocol):
    def __call__(
        self,
        params: tree.Tree,
        tokens: torch.Tensor,  # (B, T) int
        *,
        positions: torch.Tensor | None = ...,  # (T,) | (B, T) int; default arange(T)
        cache: Any = ...,
        logits: bool = ...,
    ) -> tuple[torch.Tensor, Any]: ...


class Model(NamedTuple):
    """A model family instantiated for one config.

    - ``init(key, *, dtype=torch.float32, device=None) -> params``: leaf
      ``path`` drawn from ``random.fold_in(key, path)``; ``device="meta"``
      builds shapes only.
    - ``apply(params, tokens, *, positions=None, cache=None, logits=True)
      -> (out, cache)``: ``out`` is logits ``(B, T, V)``, or with
      ``logits=False`` the final-normed hidden states ``(B, T, D)`` (to feed
      a chunked cross-entropy against ``head(params)`` without building all
      logits). ``positions`` (default ``arange(T)``) place the tokens for
      RoPE; ``cache`` is the KV-cache seam (``None`` until inference lands).
    - ``head(params) -> (V, D)``: weight of the output projection (the
      embedding table when tied).
    - ``param_axes``: tree of logical-axis tuples, one per param leaf.
    - ``flops_per_token(seq_len) -> float``: training (forward + backward)
      FLOPs per token, see the family's docstring for the formula.
    """

    config: Any
    init: InitFn
    apply: ApplyFn
    head: Callable[[tree.Tree], torch.Tensor]
    param_axes: tree.Tree
    flops_per_token: Callable[[int], float]
