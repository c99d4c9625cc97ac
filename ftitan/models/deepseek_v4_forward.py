"""DeepSeek-V4's forward pieces under the current parallel layout: one block (hyper-connections around
attention and MoE), the cached forward of generation, the MTP modules' losses and the final collapse.
``ftitan.models.deepseek_v4`` composes them into ``apply``; the seams (``parallel.activations``) are no-ops
without a layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ftitan import nn
from ftitan.models import deepseek_v4_mtp as mtp_
from ftitan.nn import hash_moe as moe_v4
from ftitan.nn import hyper_connections as hc
from ftitan.nn import sparse_attention as sa
from ftitan.parallel import activations as par
from ftitan.parallel import collectives as C
from ftitan.parallel.layout import current

if TYPE_CHECKING:
    from ftitan.models.deepseek_v4 import Config

__all__ = ["block", "cached_forward", "check_layout", "finish", "mtp_losses"]


# replicated over tp, their gradients partial sums over tp: the latent / key / compressor weights feed the
# tp-split heads; the indexer's KL is computed whole on every tp rank, and each rank's loss is a 1/tp share
_SHARED_ATTN = ("wq_a", "q_norm", "wkv", "kv_norm", "compressor", "indexer")


def check_layout(positions: Any, segments: Any) -> None:
    layout = current()
    if layout is not None and (layout.sizes["cp"] > 1 or layout.sizes["ep"] > 1 or layout.sizes["pp"] > 1):
        raise NotImplementedError("deepseek_v4: context, expert and pipeline parallelism are not supported; "
                                  "use dp_shard / dp_replicate / tp")  # fmt: skip
    if segments is not None:
        raise ValueError("deepseek_v4.apply: segments (packed documents) are not supported: the compressed "
                         "attention pools across document boundaries; pass one document per row")  # fmt: skip


def _heads_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel ranks (each holds some heads); identity without tp."""
    layout = current()
    if layout is None or layout.tp == 1:
        return x
    return C.psum(x, layout.group("tp"))


def _attention(cfg: sa.SparseAttentionConfig, p: Mapping[str, Any], x: torch.Tensor, positions: torch.Tensor,
               context: torch.Tensor | None, with_kl: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Attention under the current layout: heads over tp (column-parallel in, row-parallel out)."""
    x = par.column_input(x)
    p = {k: _tp_shared_tree(v) if k in _SHARED_ATTN else v for k, v in p.items()}
    y, kl = sa.attention(x, p, cfg, positions, context=context, compute_indexer_loss=with_kl, head_sum=_heads_sum)
    return par.row_output(y), kl


def _tp_shared_tree(p: Any) -> Any:
    # params may be a lazily gathering Mapping view (parallel.gathered): walk it by key, not with optree
    if isinstance(p, Mapping):
        return {k: _tp_shared_tree(v) for k, v in p.items()}
    return par.tp_shared(p, "heads")


def _moe(cfg: Config, p: Mapping[str, Any], x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The MoE block under the current layout: every tp rank routes all tokens, expert widths split over tp."""
    x = par.column_input(x)
    p = {**p, "router": par.tp_shared(p["router"], "mlp")}
    y, stats = moe_v4.hash_moe(x, p, tokens, top_k=cfg.top_k, routed_scale=cfg.routed_scale, limit=cfg.swiglu_limit)
    return par.row_output(y), stats


def _norm(cfg: Config, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return nn.rms_norm(h, par.tp_shared(w, "norm_seq"), cfg.norm_eps, kernels=cfg.kernels)


def _shared(p: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: par.tp_shared(w, "norm_seq") for k, w in p.items()}  # applied to this rank's tokens


def block(
    cfg: Config,
    attn_cfg: sa.SparseAttentionConfig,
    p: Mapping[str, Any],
    h: torch.Tensor,  # (B, T_local, N, D) streams
    tokens: torch.Tensor,  # (B, T) int
    positions: torch.Tensor,  # (T,) | (B, T)
    *,
    with_kl: bool = False,
    attend: Callable[[torch.Tensor], torch.Tensor] | None = None,  # x (B, T, D) -> y: a cache's attention
) -> tuple[torch.Tensor, Any, torch.Tensor | None]:  # streams, router stats, indexer KL (B, T) or None
    """One block: attention and MoE, each between a hyper-connection's collapse and expansion."""
    kw = dict(sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
    pre, post, comb = hc.hc_weights(h, _shared(p["attn_hc"]), **kw)
    x = _norm(cfg, hc.hc_collapse(h, pre), p["attn_norm"])
    if attend is None:
        y, kl = _attention(attn_cfg, p["attn"], x, positions, None, with_kl)
    else:
        y, kl = attend(x), None
    h = hc.hc_expand(h, y, post, comb)
    pre, post, comb = hc.hc_weights(h, _shared(p["mlp_hc"]), **kw)
    y, stats = _moe(cfg, p["moe"], _norm(cfg, hc.hc_collapse(h, pre), p["mlp_norm"]), tokens)
    return hc.hc_expand(h, y, post, comb), stats, kl


def cached_forward(
    cfg: Config,
    attn_cfgs: Mapping[str, sa.SparseAttentionConfig],
    params: Mapping[str, Any],
    tokens: torch.Tensor,  # (B, T) int
    positions: torch.Tensor | None,  # (T,) | (B, T)
    cache: Any,
) -> tuple[torch.Tensor, Any]:  # streams (B, T, N, D), cache
    """The blocks over new tokens through a cache (``base.RecurrentCache``): each layer's state is the
    buffer of its attention inputs by position (``sparse_attention.context_scan``), from which its keys
    and compressed entries are recomputed, so the result is the full forward's."""
    b, t = tokens.shape
    pos = torch.arange(t, device=tokens.device) if positions is None else positions
    pos = pos.expand(b, t) if pos.dim() == 1 else pos
    h = par.embed(tokens, params["embed"]).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)
    for i in range(cfg.n_layers):
        p, attn_cfg = params["layers"][str(i)], attn_cfgs[cfg.layer_types[i]]
        scan = functools.partial(sa.context_scan, p=p["attn"], cfg=attn_cfg, max_seq_len=cfg.max_seq_len)
        box = [cache]

        def attend(x: torch.Tensor, layer: int = i, scan: Any = scan, box: list[Any] = box) -> torch.Tensor:
            y, box[0] = box[0].recur(layer, scan, {"x": x, "pos": pos})
            return y

        h, _, _ = block(cfg, attn_cfg, p, h, tokens, pos, attend=attend)
        cache = box[0]
    return h, cache


def mtp_losses(cfg: Config, attn_cfgs: Mapping[str, sa.SparseAttentionConfig], params: Mapping[str, Any],
         h: torch.Tensor, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[Any]]:  # fmt: skip
    layout = current()
    if layout is not None and layout.tp > 1:
        raise NotImplementedError("deepseek_v4: the MTP modules under tensor parallelism are not supported; "
                                  "train them with dp_shard / dp_replicate, or set n_mtp_layers=0")  # fmt: skip

    def mtp_block(p: Mapping[str, Any], x: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor) -> Any:
        return block(cfg, attn_cfgs["sliding"], p, x, tok, pos)

    return mtp_.mtp_losses(cfg, params["mtp"], params["embed"], params["head"], h, tokens, mtp_block)


def finish(cfg: Config, params: Mapping[str, Any], h: torch.Tensor, *, logits: bool) -> torch.Tensor:
    """Streams -> final-normed hidden states (whole on every tp rank) -> logits."""
    h = hc.hc_head(h, _shared(params["hc_head"]), eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
    h = par.column_input(_norm(cfg, h, params["norm"]))
    return nn.linear(h, par.gather_vocab(params["head"]), kernels=cfg.kernels) if logits else h
