"""``Model``: a model family's pure functions bundled with its config.

Every family module (``llama``, later ``qwen3``, ``deepseek_v3``, ...) exposes
``model(cfg) -> Model``. Nothing here holds state: params live in the tree
``init`` returns and are passed to ``apply`` on each call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from ftitan import random, tree

if TYPE_CHECKING:
    from ftitan.nn.moe import MoEStats

__all__ = ["ApplyAuxFn", "ApplyFn", "AttentionCache", "InitFn", "Model", "RecurrentCache", "StageFn", "StageOut",
           "drop_aux", "soft_cap"]


class AttentionCache(Protocol):
    """What ``apply(..., cache=...)`` attends through: each layer's attention calls
    ``cache.attend(layer, q, k, v, impl=, causal=, scale=)`` with its RoPE'd queries ``(B, T, H, Dk)``,
    keys ``(B, T, KV, Dk)`` and values ``(B, T, KV, Dv)``, and gets the attention output
    ``(B, T, H, Dv)`` and the cache with the layer's keys/values written; ``apply`` returns the cache
    after the last layer.

    ``ftitan.infer.KVCache`` is the native one (a tree of static-shape tensors);
    ``ftitan.vllm`` passes one whose ``attend`` is vLLM's paged ``Attention``. The model never
    looks inside: positions come from the caller (``positions=``).
    """

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, impl: str, causal: bool, scale: float
    ) -> tuple[torch.Tensor, AttentionCache]: ...


class RecurrentCache(AttentionCache, Protocol):
    """A cache that also keeps the state of recurrent layers (linear attention: Gated DeltaNet's conv
    and delta-rule state), next to the keys/values of attention layers.

    A recurrent layer calls ``cache.recur(layer, scan, inputs)`` (through ``decoder.recur``) where
    ``scan(inputs, state, valid) -> (out, new_state)`` is the layer's own pure step over its new tokens:
    ``state`` is the layer's state tree as the cache holds it (``None``: start from zeros, as without
    a cache), ``valid`` (B, T) bool marks the real tokens (padding must leave the state unchanged;
    ``None``: all real). The cache returns ``out`` and itself with ``new_state`` kept. Which layers
    attend and which recur is the model's business; the cache stores whatever each layer hands it
    (``ftitan.infer.init_cache`` learns the state shapes from a one-token ``apply``).
    """

    def recur(self, layer: int, scan: Any, inputs: Any) -> tuple[Any, RecurrentCache]: ...


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
        segments: torch.Tensor | None = ...,  # (B, T) int document ids of packed rows
        logits: bool = ...,
    ) -> tuple[torch.Tensor, Any]: ...


class ApplyAuxFn(Protocol):
    """``apply`` that also returns ``aux``: a flat ``dict[str, Tensor]`` of auxiliary outputs.

    ``aux["loss"]`` (0-d, already weighted by its coefficient) is added to the
    training loss by ``ftitan.train.next_token_loss``; every other entry
    (e.g. ``"moe.tokens_per_expert"`` (L_moe, E), ``"moe.aux_loss"``) is a
    metric of the step.
    """

    def __call__(
        self,
        params: tree.Tree,
        tokens: torch.Tensor,  # (B, T) int
        *,
        positions: torch.Tensor | None = ...,
        cache: Any = ...,
        segments: torch.Tensor | None = ...,
        logits: bool = ...,
    ) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor]]: ...


class StageOut(NamedTuple):
    """What a pipeline stage returns (:class:`StageFn`).

    - ``h`` (B, T, D): the stage's output (see :class:`StageFn`).
    - ``stats``: ``{global layer index: MoEStats}`` of the stage's MoE
      layers, in layer order, this rank's tokens only (not yet summed over
      the data axes); ``{}`` for dense stages. The pipeline turns them into
      the stage's share of the balancing loss and the router-load metrics;
      ``apply_with_aux`` over one stage of every layer passes
      ``list(stats.values())`` to ``ftitan.parallel.expert.moe_aux``.
    - ``cache``: the :class:`AttentionCache` the stage's layers wrote to
      (``None`` without one).
    """

    h: torch.Tensor
    stats: Mapping[int, MoEStats]
    cache: Any = None


class StageFn(Protocol):
    """One pipeline stage: the embedding (``first``), the blocks ``layers``, the final norm (``last``).

    ``x`` is the tokens ``(B, T)`` on the first stage and the previous
    stage's output ``(B, T, D)`` otherwise; ``params`` needs only the
    stage's subtree (``layers.{i}`` for ``i`` in ``layers``, ``embed`` when
    ``first``, ``norm`` when ``last``). The last stage returns what
    ``apply(..., logits=False)`` does (the final-normed hidden states, for a
    chunked cross-entropy against ``head(params)``); stages over consecutive
    layer ranges compose to it exactly. Returns a :class:`StageOut`: the
    hidden states and the router statistics of the stage's MoE layers
    (``{}`` for dense families).
    """

    def __call__(
        self,
        params: tree.Tree,
        x: torch.Tensor,  # (B, T) int if first, else (B, T, D)
        *,
        layers: range,
        first: bool,
        last: bool,
        positions: torch.Tensor | None = ...,  # (T,) | (B, T) int; default arange(T)
        cache: AttentionCache | None = ...,
        segments: torch.Tensor | None = ...,  # (B, T) int document ids of packed rows
    ) -> StageOut: ...  # h (B, T, D), stats, cache


def drop_aux(apply_with_aux: ApplyAuxFn) -> ApplyFn:
    """The plain ``apply`` of an ``apply_with_aux``: ``(out, cache)`` without the aux dict."""

    def apply(params: tree.Tree, tokens: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        out, cache, _ = apply_with_aux(params, tokens, **kwargs)
        return out, cache

    return apply


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma 2's logit soft-cap, Team et al. 2024); ``logits`` unchanged when
    ``cap`` is None. Elementwise, so every consumer of :attr:`Model.logit_softcap` gets the same bits."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


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
      RoPE; with a ``cache`` (:class:`AttentionCache`: ``ftitan.infer``'s
      KV cache, vLLM's paged attention) every layer attends through it
      instead of causally over ``tokens`` alone, and the returned cache
      holds the new keys/values. ``segments`` ``(B, T)`` int (packed rows,
      no cache): the document id of each token; attention is
      block-diagonal causal (a token sees only the earlier tokens of its
      own document) and positions default to restarting at each document,
      so each document computes what it would alone
      (``ftitan.data.pack_documents`` builds such rows).
    - ``head(params) -> (V, D)``: weight of the output projection (the
      embedding table when tied); inside a tensor-parallel step, this
      rank's ``(V / tp, D)`` vocab slice (``ftitan.train.losses.cross_entropy``
      is vocab-parallel there).
    - ``param_axes``: tree of logical-axis tuples, one per param leaf.
    - ``flops_per_token(seq_len) -> float``: training (forward + backward)
      FLOPs per token, see the family's docstring for the formula (MoE
      families count active parameters only).
    - ``apply_with_aux`` (MoE families; ``None`` otherwise): ``apply`` that
      also returns the aux dict (router load, load-balancing loss), see
      :class:`ApplyAuxFn`.
    - ``frozen``: glob patterns of leaves that are state, not weights (e.g.
      DeepSeek-V3's routing bias): optimizers leave them unchanged.
    - ``update_buffers(params, metrics) -> params`` (or ``None``): the pure
      update of the frozen leaves after each optimizer step, from the
      step's metrics (e.g. the aux-loss-free balancing bias from expert load).
    - ``stage`` (or ``None``): the model split into pipeline stages, see
      :class:`StageFn`; families without it cannot run with ``pp > 1``
      (``ftitan.parallel.pipeline``).
    - ``logit_softcap`` (or ``None``): the logits are ``cap * tanh(z / cap)`` of the head's
      ``z = h @ head(params).T`` (:func:`soft_cap`; Gemma 2's final soft-cap). ``apply(..., logits=True)``
      applies it itself; every consumer of ``apply(..., logits=False)`` + ``head`` (the training
      loss, ``ftitan.infer``'s steps, log-probs for DPO and RL, the pipeline's last stage) reads it.
    """

    config: Any
    init: InitFn
    apply: ApplyFn
    head: Callable[[tree.Tree], torch.Tensor]
    param_axes: tree.Tree
    flops_per_token: Callable[[int], float]
    apply_with_aux: ApplyAuxFn | None = None
    frozen: tuple[str, ...] = ()
    update_buffers: Callable[[tree.Tree, dict[str, torch.Tensor]], tree.Tree] | None = None
    stage: StageFn | None = None
    logit_softcap: float | None = None

    def __repr__(self) -> str:
        """One line: the family, its key sizes and the parameter count, e.g.
        ``Model(llama, vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, params=8.03B)``."""
        cfg = self.config
        family = type(cfg).__module__.rsplit(".", 1)[-1]
        sizes = [f"{label}={getattr(cfg, name)}" for name, label in _REPR_FIELDS if getattr(cfg, name, None) is not None]
        return f"Model({', '.join([family, *sizes, *_param_count(self)])})"


# config fields Model's repr shows, where the family has them: (field, label)
_REPR_FIELDS = (("vocab_size", "vocab"), ("dim", "dim"), ("n_layers", "layers"), ("n_heads", "heads"),
                ("n_kv_heads", "kv_heads"), ("n_experts", "experts"), ("top_k", "top_k"))  # fmt: skip


def _param_count(model: Model) -> list[str]:
    """``["params=1.2M"]`` from a shapes-only init; ``[]`` if the model cannot build one (a repr never raises)."""
    try:
        n = tree.size(model.init(random.key(0), device="meta"))
    except Exception:  # noqa: BLE001  (a broken config still gets a repr)
        return []
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            v = n / scale  # three significant digits: 4.07M, 40.7M, 671B
            return [f"params={v:.{2 if v < 10 else 1 if v < 100 else 0}f}{suffix}"]
    return [f"params={n}"]
