"""DeepSeek-V4's hybrid attention (DeepSeek-AI 2026, "DeepSeek-V4", sec. 2.3): sliding window, CSA, HCA.

Every layer is shared-KV multi-query attention: one ``head_dim`` key per
token, RMS-normed, that is also the value. Queries come through a low-rank
latent (``q_a``, its norm, ``q_b``) and an unweighted RMS norm per head;
RoPE is *interleaved* and covers the last ``rope_dim`` dims of each head,
and the attention output's rope dims are rotated back by the query's angle
(the values carried the keys' rotation). Each head has a learned sink logit
(a softmax slot with no value). A grouped low-rank output projection maps
the ``H * Dh`` outputs in ``o_groups`` blocks to ``o_lora_rank`` each, then
to the model width. Keys are:

- the raw keys of the last ``window`` positions (every layer kind), plus
- ``kind="hca"`` (heavily compressed): one entry per ``rate`` tokens, the
  softmax-gated sum (gate + learned position bias) of the window's
  projections, RMS-normed and RoPE'd at the window's first position; a
  query sees the entries of its completed windows;
- ``kind="csa"`` (compressed sparse): the same with overlapping windows of
  ``2 * rate`` tokens (two projections per token: one for its own window,
  one for the next), of which a lightning indexer keeps ``index_topk`` per
  query: ``score_s = sum_h w_h relu(q_h . k_s)`` over its own compressed
  keys (``index_head_dim``), ``w`` a projection of the input.

Here the sparse selection is computed as a mask over all compressed
entries (exactly the reference's math; the dense form costs ``T * T / rate``
scores, fine for training at moderate lengths, not a long-context kernel).
``compute_indexer_loss=True`` also returns the indexer's training signal
(:func:`indexer_kl`): the KL divergence from the main attention's
head-summed probabilities over the compressed entries (dense, detached) to
the indexer's softmax, DeepSeek-V3.2's warm-up objective.

``context`` (B, S, D): the normed inputs of every position so far (a
cache's; default the queries' own ``x``), from which keys, compressed
entries and the indexer's keys are computed: the cache of
``ftitan.models.deepseek_v4`` keeps just those, so decoding is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import torch

from ftitan.nn.hyper_connections import unweighted_rms_norm
from ftitan.nn.linear import linear, linear_param
from ftitan.nn.norm import norm_param, rms_norm
from ftitan.nn.param import Param, zeros_init
from ftitan.nn.rope import YarnRopeScaling, rope_inv_freq

__all__ = ["KINDS", "SparseAttentionConfig", "apply_rope_interleaved", "attention", "attention_params",
           "compress", "context_scan", "indexer_kl", "rope_pairs", "sink_attention"]  # fmt: skip

Kind = Literal["sliding", "csa", "hca"]
KINDS: tuple[str, ...] = ("sliding", "csa", "hca")


@attrs.frozen(kw_only=True)
class SparseAttentionConfig:
    """One attention layer's shapes and kind (``deepseek_v4.Config.attention(kind)`` builds it)."""

    kind: str  # "sliding" (window only), "csa" (window + indexer-selected compressed), "hca" (window + compressed)
    n_heads: int  # H: query heads (one shared key/value head)
    head_dim: int  # Dh: width of a head, of the shared key/value and of a compressed entry
    rope_dim: int  # Dr: trailing dims of each head that get (interleaved) RoPE
    q_lora_rank: int  # Rq: query latent width
    o_groups: int  # G: head groups of the output projection
    o_lora_rank: int  # Ro: per-group output latent width
    window: int  # raw keys a query sees: itself and the window - 1 before it
    rate: int  # tokens per compressed entry (csa / hca; unused for sliding)
    index_heads: int  # indexer query heads (csa)
    index_head_dim: int  # indexer key width (csa)
    index_topk: int  # compressed entries each query keeps (csa)
    rope_theta: float  # RoPE base of this layer's queries/keys (and its compressor/indexer)
    rope_scaling: YarnRopeScaling | None  # YaRN of the compressed layers' rope (its attention factor is 1)
    norm_eps: float  # epsilon of every norm

    @property
    def overlap(self) -> bool:
        return self.kind == "csa"


def attention_params(dim: int, cfg: SparseAttentionConfig, *, std: float, out_std: float) -> dict[str, Any]:
    """Spec tree of one layer (names follow the HF checkpoint: wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b)."""
    h, dh, rq, g = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups
    specs: dict[str, Any] = {
        "wq_a": linear_param(dim, rq, axes=("q_lora", "embed"), std=std),
        "q_norm": norm_param(rq),
        "wq_b": linear_param(rq, h * dh, axes=("heads", "q_lora"), std=std),
        "wkv": linear_param(dim, dh, axes=(None, "embed"), std=std),
        "kv_norm": norm_param(dh),
        # (G * Ro, H * Dh / G): block g maps the heads of group g; dim 1 FSDP-sharded like a model dim
        "wo_a": linear_param(h * dh // g, g * cfg.o_lora_rank, axes=("heads", "embed"), std=std),
        "wo_b": linear_param(g * cfg.o_lora_rank, dim, axes=("embed", "heads"), std=out_std),
        "sinks": Param(shape=(h,), axes=("heads",), init=zeros_init),
    }
    if cfg.kind != "sliding":
        specs["compressor"] = _compressor_params(dim, dh, cfg, std=std)
    if cfg.kind == "csa":
        specs["indexer"] = {
            "compressor": _compressor_params(dim, cfg.index_head_dim, cfg, std=std),
            "wq_b": linear_param(rq, cfg.index_heads * cfg.index_head_dim, axes=(None, "q_lora"), std=std),
            "weights_proj": linear_param(dim, cfg.index_heads, axes=(None, "embed"), std=std),
        }
    return specs


def _compressor_params(dim: int, width: int, cfg: SparseAttentionConfig, *, std: float) -> dict[str, Param]:
    out = 2 * width if cfg.overlap else width  # csa: a projection for its own window and one for the next
    return {
        "wkv": linear_param(dim, out, axes=(None, "embed"), std=std),
        "wgate": linear_param(dim, out, axes=(None, "embed"), std=std),
        "ape": Param(shape=(cfg.rate, out), axes=(None, None), init=zeros_init),  # position bias of the gates
        "norm": norm_param(width),
    }


def rope_pairs(positions: torch.Tensor, dim: int, theta: float,
               scaling: YarnRopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``cos``/``sin`` (..., dim / 2) float32 of ``positions`` (T,) | (B, T): one angle per interleaved pair.
    YaRN changes the frequencies only (DeepSeek-V4 fixes its attention factor to 1)."""
    inv_freq = rope_inv_freq(dim, theta, scaling, device=positions.device)
    angles = positions[..., None].to(torch.float32) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` dims of ``x`` (B, T, H, D) as pairs ``(x_2i, x_2i+1)`` by the
    angles in ``cos``/``sin`` (T | B, T, Dr / 2), in float32 (float64 kept); the leading dims pass unchanged."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)
    dr = cos.shape[-1]
    nope, rope = x[..., :-dr], x[..., -dr:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)  # (-x_2i+1, x_2i) pairs
    acc = torch.promote_types(x.dtype, torch.float32)
    rotated = (rope.to(acc) * cos + turned.to(acc) * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def compress(
    x: torch.Tensor,  # (B, S, D) normed inputs of positions 0 .. S-1
    p: Mapping[str, torch.Tensor],
    cfg: SparseAttentionConfig,
    width: int,  # Dh (main compressor) or index_head_dim (indexer)
) -> torch.Tensor:  # (B, S // rate, width)
    """The compressed entries of every completed window (a trailing partial window gives none):
    entry ``w`` is ``norm(sum_j softmax_j(gate_j + ape_j) * kv_j)`` over window ``w`` (csa: the
    second half of window ``w``'s projections and the first half of window ``w - 1``'s), RoPE'd
    at position ``w * rate``."""
    b, s, _ = x.shape
    r = cfg.rate
    n = s // r
    if n == 0:
        return x.new_zeros(b, 0, width)
    kv = linear(x[:, : n * r], p["wkv"]).unflatten(1, (n, r))  # (B, n, r, width | 2 width)
    gate = linear(x[:, : n * r], p["wgate"]).unflatten(1, (n, r)) + p["ape"]
    if cfg.overlap:  # window w: [previous window's first halves | own second halves]; none before window 0
        pad_kv = kv.new_zeros(b, 1, r, width)
        pad_gate = gate.new_full((b, 1, r, width), float("-inf"))
        prev_kv = torch.cat([pad_kv, kv[:, :-1, :, :width]], dim=1)
        prev_gate = torch.cat([pad_gate, gate[:, :-1, :, :width]], dim=1)
        kv = torch.cat([prev_kv, kv[..., width:]], dim=2)  # (B, n, 2r, width)
        gate = torch.cat([prev_gate, gate[..., width:]], dim=2)
    weights = gate.softmax(dim=2, dtype=torch.promote_types(gate.dtype, torch.float32))  # float32; float64 kept
    pooled = (kv * weights.to(kv.dtype)).sum(dim=2)
    entries = rms_norm(pooled, p["norm"], cfg.norm_eps)  # (B, n, width)
    positions = torch.arange(n, device=x.device) * r
    cos, sin = rope_pairs(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    return apply_rope_interleaved(entries.unsqueeze(2), cos.to(x.dtype), sin.to(x.dtype)).squeeze(2)


def _completed(positions: torch.Tensor, n: int, rate: int) -> torch.Tensor:  # (T | B, T) -> (T | B, T, n) bool
    """Entry ``w`` is visible at ``t`` once its window closed: ``w < (t + 1) // rate``."""
    return torch.arange(n, device=positions.device) < ((positions + 1) // rate)[..., None]


def _indexer_scores(
    x: torch.Tensor,  # (B, T, D) queries' inputs
    q_latent: torch.Tensor,  # (B, T, Rq)
    keys: torch.Tensor,  # (B, n, Di) the indexer's compressed keys
    p: Mapping[str, Any],
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg: SparseAttentionConfig,
) -> torch.Tensor:  # (B, T, n) float32 (float64 for float64 inputs)
    b, t, _ = x.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    q = linear(q_latent, p["wq_b"]).view(b, t, cfg.index_heads, cfg.index_head_dim)
    q = apply_rope_interleaved(q, cos, sin)
    scores = torch.matmul(q.to(acc), keys.transpose(-1, -2).to(acc).unsqueeze(1))  # (B, T, Hi, n)
    scores = torch.relu(scores) * cfg.index_head_dim**-0.5
    w = linear(x, p["weights_proj"]).to(acc) * cfg.index_heads**-0.5  # (B, T, Hi)
    return (scores * w.unsqueeze(-1)).sum(dim=2)


def _select(scores: torch.Tensor, completed: torch.Tensor, k: int) -> torch.Tensor:  # (B, T, n) -> bool
    """The ``k`` best completed entries per query (fewer when fewer are completed)."""
    n = scores.shape[-1]
    completed = completed.expand_as(scores)
    top = scores.masked_fill(~completed, float("-inf")).topk(min(k, n), dim=-1).indices
    keep = completed.gather(-1, top)  # a pick among the not-yet-completed (too few completed) is dropped
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter(-1, top, keep)


def sink_attention(
    q: torch.Tensor,  # (B, T, H, Dh)
    kv: torch.Tensor,  # (B, S, Dh) shared key = value
    sinks: torch.Tensor,  # (H,) sink logits
    visible: torch.Tensor,  # (T, S) | (B, T, S) bool
    scale: float,
) -> torch.Tensor:  # (B, T, H, Dh)
    """Softmax attention with one extra logit per head (the sink) that takes probability but adds nothing."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bthd,bsd->bhts", q, kv).to(acc) * scale
    scores = scores.masked_fill(~(visible.unsqueeze(-3) if visible.dim() == 3 else visible), float("-inf"))
    b, h, t, _ = scores.shape
    sink = sinks.to(acc).view(1, h, 1, 1).expand(b, h, t, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhts,bsd->bthd", probs.to(kv.dtype), kv)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _stop_gradient(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` outside the reverse-mode graph, as ``x.detach()``, that keeps ``x``'s forward-mode
    tangent (``torch.no_grad`` blocks reverse mode only; ``detach`` drops both): the gradient is the same,
    and a ``jvp`` of the gradient (forward-over-reverse Hessian-vector products) differentiates all of
    what the gradient depends on, so it equals finite differences of the gradient."""
    with torch.no_grad():
        return x.clone()


def indexer_kl(
    q: torch.Tensor,  # (B, T, H, Dh) the main attention's queries
    kv: torch.Tensor,  # (B, S, Dh) raw keys
    entries: torch.Tensor,  # (B, n, Dh) compressed keys
    sinks: torch.Tensor,
    window_visible: torch.Tensor,  # (T, S) | (B, T, S)
    completed: torch.Tensor,  # (T, n) | (B, T, n)
    index_scores: torch.Tensor,  # (B, T, n) float32, differentiable in the indexer's params
    scale: float,
    head_sum: Callable[[torch.Tensor], torch.Tensor] = _identity,  # sums over ranks holding other heads (tp)
) -> torch.Tensor:  # (B, T) float32: 0 where a query has no completed entry
    """The indexer's training signal: ``KL(p_t || softmax(I_t))`` over the completed entries, ``p_t`` the
    main attention's probabilities of those entries under dense attention (all of them visible), summed
    over heads and L1-normalized, detached (DeepSeek-V3.2 sec. 2.1, the dense warm-up): ``p_t`` is computed
    under ``torch.no_grad``, so no gradient reaches ``q``/``kv``/``entries``/``sinks`` while their
    forward-mode tangents still flow (see :func:`_stop_gradient`)."""
    with torch.no_grad():
        keys = torch.cat([kv, entries], dim=1)
        vis = torch.cat([window_visible.expand(*completed.shape[:-1], -1), completed], dim=-1)
        acc = torch.promote_types(q.dtype, torch.float32)
        scores = torch.einsum("bthd,bsd->bhts", q, keys).to(acc) * scale
        scores = scores.masked_fill(~(vis.unsqueeze(-3) if vis.dim() == 3 else vis), float("-inf"))
        b, h, t, _ = scores.shape
        sink = sinks.to(acc).view(1, h, 1, 1).expand(b, h, t, 1)
        probs = head_sum(torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., kv.shape[1] : -1].sum(1))
        target = probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)
    completed = completed.expand_as(index_scores)
    logq = torch.log_softmax(index_scores.masked_fill(~completed, float("-inf")), dim=-1)
    terms = torch.where(completed & (target > 0), target * (torch.log(target.clamp(min=1e-30)) - logq), 0.0)
    return terms.sum(-1)


def attention(
    x: torch.Tensor,  # (B, T, D) normed inputs of the queries
    p: Mapping[str, Any],
    cfg: SparseAttentionConfig,
    positions: torch.Tensor,  # (T,) | (B, T) int positions of the queries
    *,
    context: torch.Tensor | None = None,  # (B, S, D) inputs of positions 0 .. S-1 (default x: positions arange(T))
    compute_indexer_loss: bool = False,
    head_sum: Callable[[torch.Tensor], torch.Tensor] = _identity,  # for the indexer loss under tp
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (B, T, D); (B, T) indexer KL or None
    """One layer of DeepSeek-V4 attention (see the module docstring). Head counts come from the weights'
    shapes, so a rank holding ``H / tp`` heads of ``wq_b``/``sinks``/``wo_a`` and ``G / tp`` groups of
    ``wo_b`` computes just those (the latent, key and compressor weights whole)."""
    ctx = x if context is None else context
    b, t, _ = x.shape
    s, dh = ctx.shape[1], cfg.head_dim
    cos, sin = rope_pairs(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    q_latent = rms_norm(linear(x, p["wq_a"]), p["q_norm"], cfg.norm_eps)
    q = unweighted_rms_norm(linear(q_latent, p["wq_b"]).unflatten(-1, (-1, dh)), cfg.norm_eps)
    q = apply_rope_interleaved(q, cos, sin)  # (B, T, H_local, Dh)
    key_pos = torch.arange(s, device=x.device)
    kcos, ksin = rope_pairs(key_pos, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    kv = rms_norm(linear(ctx, p["wkv"]), p["kv_norm"], cfg.norm_eps).unsqueeze(2)
    kv = apply_rope_interleaved(kv, kcos.to(x.dtype), ksin.to(x.dtype)).squeeze(2)  # (B, S, Dh)
    gap = positions[..., None] - key_pos  # (T | B, T, S)
    window = (gap >= 0) & (gap < cfg.window)
    keys, visible, kl = kv, window, None
    if cfg.kind != "sliding":
        entries = compress(ctx, p["compressor"], cfg, dh)  # (B, n, Dh)
        completed = _completed(positions, entries.shape[1], cfg.rate)
        chosen = completed
        if cfg.kind == "csa":
            ip = p["indexer"]
            x_i, latent_i, ctx_i = x, q_latent, ctx
            if compute_indexer_loss:  # the indexer trains on its own loss only (V3.2: inputs detached)
                x_i, latent_i = _stop_gradient(x), _stop_gradient(q_latent)
                ctx_i = x_i if context is None else _stop_gradient(ctx)
            ikeys = compress(ctx_i, ip["compressor"], cfg, cfg.index_head_dim)
            iscores = _indexer_scores(x_i, latent_i, ikeys, ip, cos, sin, cfg)
            chosen = _select(iscores.detach(), completed, cfg.index_topk)
            if compute_indexer_loss:
                kl = indexer_kl(q, kv, entries, p["sinks"], window, completed, iscores, dh**-0.5, head_sum)
        keys = torch.cat([kv, entries], dim=1)
        visible = torch.cat([window.expand(*chosen.shape[:-1], -1), chosen], dim=-1)
    o = sink_attention(q, keys, p["sinks"], visible, dh**-0.5)  # (B, T, H_local, Dh)
    o = apply_rope_interleaved(o, cos, -sin)  # undo the values' rotation at the query's angle
    groups = p["wo_a"].shape[0] // cfg.o_lora_rank  # G (G / tp under tensor parallelism)
    w_a = p["wo_a"].view(groups, cfg.o_lora_rank, -1)  # (G, Ro, H * Dh / G)
    o = torch.einsum("btgi,goi->btgo", o.reshape(b, t, groups, -1), w_a).flatten(2)  # (B, T, G * Ro)
    return linear(o, p["wo_b"]), kl


def context_scan(
    inputs: Mapping[str, torch.Tensor],  # {"x": (B, T, D) normed inputs, "pos": (B, T) int positions}
    state: Mapping[str, torch.Tensor] | None,  # {"x": (B, P + 1, D)}: inputs by position, row P a trash row
    valid: torch.Tensor | None,  # (B, T) bool: real tokens (padding is not written)
    *,
    p: Mapping[str, Any],
    cfg: SparseAttentionConfig,
    max_seq_len: int,  # P: positions the buffer holds
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # (B, T, D), new state
    """One layer's attention through a cache (``base.RecurrentCache.recur``'s ``scan``): write the new
    inputs at their positions, then attend with the buffer as the ``context``. Keys, compressed entries and
    the indexer's keys are recomputed from it, so decoding gives the full forward's values (exact, at the
    cost of recomputing ``O(S)`` projections per step; what a query cannot see, positions after it or
    windows not yet complete, is masked, so stale rows never matter)."""
    x, pos = inputs["x"], inputs["pos"]
    b, t, d = x.shape
    buf = x.new_zeros(b, max_seq_len + 1, d) if state is None else state["x"]
    row = pos if valid is None else torch.where(valid, pos, max_seq_len)  # padding goes to the trash row
    buf = buf.index_put((torch.arange(b, device=x.device)[:, None].expand(b, t), row), x.to(buf.dtype))
    n = max_seq_len if torch.compiler.is_compiling() else int(pos.max()) + 1  # eager: only the positions used
    y, _ = attention(x, p, cfg, pos, context=buf[:, :n].to(x.dtype))
    return y, {"x": buf}
