"""DeepSeek-V4 (DeepSeek-AI 2026, "DeepSeek-V4: Towards Highly Efficient Million-Token Context Intelligence")
as pure functions: Flash and Pro.

Each block is pre-norm attention and pre-norm MoE, both wrapped in
manifold-constrained hyper-connections (``ftitan.nn.hyper_connections``):
the residual is ``hc_mult`` streams (B, T, N, D), collapsed into each block's
input and re-expanded with a Sinkhorn-projected mixing.

- **attention** (``ftitan.nn.sparse_attention``): shared-KV multi-query
  attention with per-head sinks, interleaved partial RoPE and a grouped
  low-rank output projection; per layer ``"sliding"`` (window only),
  ``"csa"`` (window + compressed entries every ``csa_rate`` tokens picked by
  a lightning indexer, ``index_topk`` per query) or ``"hca"`` (window +
  every compressed entry of ``hca_rate`` tokens). Compressed layers use
  RoPE base ``compress_rope_theta`` with YaRN ``rope_scaling``; sliding
  layers ``rope_theta`` without scaling.
- **feed-forward** (``ftitan.nn.hash_moe``): every block is MoE, ``top_k``
  of ``n_experts`` clamped-SwiGLU experts plus one shared expert, scored by
  ``sqrt(softplus(.))``; the first ``n_hash_layers`` route by a fixed
  token-id table, the others by top-k with DeepSeek-V3's aux-loss-free
  balancing bias (``Model.update_buffers`` moves it after each step).
- **indexer training**: ``apply_with_aux`` adds ``indexer_loss_coef`` times
  the indexer's KL to the dense attention distribution
  (``sparse_attention.indexer_kl``; its inputs detached, so it trains the
  indexer only); with ``indexer_loss_coef=0`` the indexer gets no gradient
  (top-k is discrete) and ``Model.frozen`` lists its leaves.

Generation: through ``ftitan.infer`` (``init_cache`` / ``prefill`` / ``decode_step`` / ``generate``) the
cache keeps each layer's attention inputs by position (``max_seq_len + 1`` rows per layer and sequence,
``sparse_attention.context_scan``) and recomputes the keys and compressed entries from them, so decoding
equals the full forward (exact, ``O(S)`` recomputation per step: a reference path, not a fast one).

Logits match ``transformers.DeepseekV4ForCausalLM`` (fp32). Not modelled:
(transformers has no MTP either
too), packed ``segments``, context and
expert parallelism and pipeline stages (refused with an error). With ``n_mtp_layers`` the
multi-token-prediction modules of the checkpoints are modelled and trained (``deepseek_v4_mtp``).

Parallel: FSDP (``dp_shard``) and tensor parallel with sequence
parallelism: query heads, sinks and output groups over ``tp``, the expert
and shared-expert widths over ``tp``; the latent, key, compressor and
indexer weights and the hyper-connections replicated.

Params tree::

    {"embed": (V, D),
     "layers": {"0": {"attn_hc": {"fn", "base", "scale"}, "attn_norm": (D,), "attn": {see nn.sparse_attention},
                      "mlp_hc": {...}, "mlp_norm": (D,), "moe": {see nn.hash_moe}}, ...},
     "hc_head": {"fn": (N, N * D), "base": (N,), "scale": (1,)},
     "norm": (D,),
     "head": (V, D)}
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ftitan import nn, tree
from ftitan.kernels.op import check_kernels
from ftitan.models import deepseek_v4_forward as fwd
from ftitan.models import deepseek_v4_mtp as mtp_
from ftitan.models.base import Model
from ftitan.nn import hash_moe as moe_v4
from ftitan.nn import hyper_connections as hc
from ftitan.nn import moe as moe_
from ftitan.nn import sparse_attention as sa
from ftitan.nn.rope import YarnRopeScaling
from ftitan.parallel import activations as par
from ftitan.parallel import expert

__all__ = ["FLAVORS", "Config", "flops_per_token", "frozen", "model", "param_counts", "param_specs",
           "update_router_bias"]  # fmt: skip


def _kinds(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or any(k not in sa.KINDS for k in value):
        raise ValueError(f"deepseek_v4.Config.layer_types={value!r}: expected a sequence of {sa.KINDS}")
    return tuple(value)


def _alternating(n_layers: int, first: tuple[str, ...], even: str, odd: str) -> tuple[str, ...]:
    return first + tuple(even if i % 2 == 0 else odd for i in range(len(first), n_layers))


@attrs.frozen(kw_only=True)
class Config:
    """DeepSeek-V4 architecture. Published sizes: ``Config.flash()`` and ``Config.pro()`` (``FLAVORS``)."""

    vocab_size: int  # V: rows of the embedding / output head
    dim: int  # D: width of each residual stream (HF hidden_size)
    n_layers: int  # L: blocks (the MTP layer not included)
    n_heads: int  # H: query heads (one shared key/value head)
    head_dim: int  # Dh: head width, also the key/value and compressed-entry width
    rope_dim: int = 64  # Dr: trailing dims of a head with RoPE (HF qk_rope_head_dim)
    q_lora_rank: int  # Rq: query latent width
    o_groups: int  # G: head groups of the output projection
    o_lora_rank: int  # Ro: per-group output latent width
    layer_types: tuple[str, ...] = attrs.field(converter=_kinds)  # per layer "sliding" | "csa" | "hca"
    csa_rate: int = 4  # tokens per compressed entry in csa layers
    hca_rate: int = 128  # tokens per compressed entry in hca layers
    window: int = 128  # raw keys each query sees (itself included) (HF sliding_window)
    index_heads: int = 64  # lightning-indexer query heads (HF index_n_heads)
    index_head_dim: int = 128  # indexer key width
    index_topk: int = 512  # compressed entries a csa query keeps
    n_experts: int  # E: routed experts per block (HF n_routed_experts)
    top_k: int  # routed experts per token (HF num_experts_per_tok)
    expert_dim: int  # F: SwiGLU width of one expert and of the shared expert (HF moe_intermediate_size)
    n_hash_layers: int = 3  # the first n blocks route by a token-id table (HF mlp_layer_types "hash_moe")
    routed_scale: float = 1.5  # multiplies the routed weights (HF routed_scaling_factor)
    swiglu_limit: float = 10.0  # clamp of the experts' gate (above) and up (both sides) projections
    hc_mult: int = 4  # N: residual streams of the hyper-connections
    hc_sinkhorn_iters: int = 20  # Sinkhorn-Knopp iterations of the stream mixing
    hc_eps: float = 1e-6  # floor of the mixing weights and Sinkhorn denominators
    norm_eps: float = 1e-6  # epsilon of every RMS norm
    rope_theta: float = 10_000.0  # RoPE base of the sliding layers
    compress_rope_theta: float = 160_000.0  # RoPE base of the csa / hca layers, their compressors and indexers
    rope_scaling: YarnRopeScaling | None = None  # YaRN of the compressed layers' RoPE (attention factor 1)
    max_seq_len: int = 1_048_576  # longest sequence the model is meant for (HF max_position_embeddings)
    bias_update_rate: float = 1e-3  # step of the aux-loss-free balancing bias (DeepSeek-V3's gamma)
    aux_loss_coef: float = 0.0  # weight of the Switch balancing loss over the learned-routing blocks
    indexer_loss_coef: float = 1.0  # weight of the indexer's KL loss; 0: the indexer is frozen
    n_mtp_layers: int = 0  # multi-token-prediction modules (the checkpoints have 1; transformers builds none)
    mtp_loss_weight: float = 0.3  # weight of the mean MTP cross-entropy in the training loss (V3's first lambda)
    init_std: float = 0.02  # std of the (truncated) normal init; residual outputs get init_std/sqrt(2L)
    kernels: str = "torch"  # "torch", "triton" or "helion" (ftitan.kernels on CUDA, their references elsewhere)
    remat: str = "none"  # activation rematerialization of each block (ftitan.config.with_remat): "none", "full", ...

    def __attrs_post_init__(self) -> None:
        check_kernels(self.kernels, "deepseek_v4.Config.kernels")
        ints = ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
                "o_lora_rank", "csa_rate", "hca_rate", "window", "index_heads", "index_head_dim", "index_topk",
                "n_experts", "top_k", "expert_dim", "hc_mult", "hc_sinkhorn_iters", "max_seq_len")  # fmt: skip
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"deepseek_v4.Config.{name}={value!r}: must be a positive int")
        checks = [
            (len(self.layer_types) == self.n_layers,
             f"layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}; give one per layer "
             f"(e.g. --model.layer-types sliding csa)"),
            (self.rope_dim % 2 == 0 and self.rope_dim <= min(self.head_dim, self.index_head_dim),
             f"rope_dim={self.rope_dim} must be even and <= head_dim and index_head_dim"),
            (self.n_heads % self.o_groups == 0, f"n_heads={self.n_heads} is not a multiple of o_groups="
                                                f"{self.o_groups}"),
            (self.top_k <= self.n_experts, f"top_k={self.top_k} exceeds n_experts={self.n_experts}"),
            (0 <= self.n_hash_layers < self.n_layers, f"n_hash_layers={self.n_hash_layers} must be in [0, n_layers)"),
            (min(self.aux_loss_coef, self.indexer_loss_coef, self.bias_update_rate, self.mtp_loss_weight) >= 0,
             "aux_loss_coef, indexer_loss_coef, bias_update_rate and mtp_loss_weight must be >= 0"),
            (isinstance(self.n_mtp_layers, int) and self.n_mtp_layers >= 0,
             f"n_mtp_layers={self.n_mtp_layers!r} must be an int >= 0"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(f"deepseek_v4.Config: {message}")

    def attention(self, kind: str) -> sa.SparseAttentionConfig:
        """The attention config of a ``kind`` layer."""
        compressed = kind != "sliding"
        return sa.SparseAttentionConfig(
            kind=kind, n_heads=self.n_heads, head_dim=self.head_dim, rope_dim=self.rope_dim,
            q_lora_rank=self.q_lora_rank, o_groups=self.o_groups, o_lora_rank=self.o_lora_rank, window=self.window,
            rate=self.csa_rate if kind == "csa" else self.hca_rate, index_heads=self.index_heads,
            index_head_dim=self.index_head_dim, index_topk=self.index_topk,
            rope_theta=self.compress_rope_theta if compressed else self.rope_theta,
            rope_scaling=self.rope_scaling if compressed else None, norm_eps=self.norm_eps,
        )  # fmt: skip

    @property
    def moe(self) -> moe_.MoEConfig:
        """Only what ``parallel.expert.moe_aux`` reads (the balancing-loss weight, expert counts)."""
        return moe_.MoEConfig(n_experts=self.n_experts, top_k=self.top_k, expert_dim=self.expert_dim,
                              score_func="sigmoid", aux_loss_coef=self.aux_loss_coef)  # fmt: skip

    @classmethod
    def debug(cls) -> Config:
        """Tiny model that trains on 2 CPU cores: 4 blocks (sliding, csa, hca, csa), the first hash-routed."""
        return cls(
            vocab_size=2048, dim=128, n_layers=4, n_heads=4, head_dim=32, rope_dim=16, q_lora_rank=64, o_groups=2,
            o_lora_rank=32, layer_types=("sliding", "csa", "hca", "csa"), csa_rate=4, hca_rate=16, window=32,
            index_heads=4, index_head_dim=32, index_topk=8, n_experts=8, top_k=2, expert_dim=64, n_hash_layers=1,
            hc_mult=2, hc_sinkhorn_iters=5, max_seq_len=2048,
        )  # fmt: skip

    # Published sizes: the transformers DeepseekV4Config defaults (checkpoint deepseek-ai/DeepSeek-V4-Flash-Base)
    # and the model cards; the hub config.json files are not reachable offline (see each flavor).
    @classmethod
    def flash(cls) -> Config:
        """DeepSeek-V4-Flash (284B total, 13B active per the model card): transformers' DeepseekV4Config
        defaults, with the card's schedule (layers 0-1 sliding, then csa on even / hca on odd layers) and
        YaRN x16 from 65,536 positions on the compressed layers."""
        return cls(
            vocab_size=129_280, dim=4096, n_layers=43, n_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8,
            o_lora_rank=1024, layer_types=_alternating(43, ("sliding", "sliding"), "csa", "hca"), n_experts=256,
            top_k=6, expert_dim=2048, rope_scaling=_yarn16(),
        )  # fmt: skip

    @classmethod
    def pro(cls) -> Config:
        """DeepSeek-V4-Pro (1.6T total, 49B active per the model card): 61 layers, dim 7168, 128 heads,
        q_lora 1536, 16 output groups, 384 experts top-6 of width 3072, indexer top-1024 (model card and
        public descriptions); schedule 2 hca then hca/csa alternating (transformers' default); the other
        fields as Flash (assumed: the hub config.json was not reachable)."""
        return cls(
            vocab_size=129_280, dim=7168, n_layers=61, n_heads=128, head_dim=512, q_lora_rank=1536, o_groups=16,
            o_lora_rank=1024, layer_types=_alternating(61, ("hca", "hca"), "hca", "csa"), n_experts=384, top_k=6,
            expert_dim=3072, index_topk=1024, routed_scale=2.5, rope_scaling=_yarn16(),
        )  # fmt: skip


def _yarn16() -> YarnRopeScaling:
    return YarnRopeScaling(factor=16.0, original_max_position_embeddings=65_536, beta_fast=32.0, beta_slow=1.0,
                           attention_factor=1.0)  # fmt: skip


FLAVORS = {"debug": Config.debug, "flash": Config.flash, "pro": Config.pro}


def _hash_table_init(n_experts: int) -> nn.Initializer:
    """Token ``v``'s experts: ``(h(v) + j * (E // k)) % E`` for ``j < k``, ``h`` a multiplicative hash:
    ``k`` distinct experts per token, spread evenly (checkpoints bring their own table)."""

    def fn(_key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: Any, *,
           block: nn.param.Block | None = None) -> torch.Tensor:  # fmt: skip
        if str(device) == "meta":
            return torch.empty(nn.param.block_shape(shape, block), dtype=dtype, device=device)
        spans = list(block or ())
        v0, v1 = spans[0] if spans else (0, shape[0])
        k0, k1 = spans[1] if len(spans) > 1 else (0, shape[1])
        tokens = torch.arange(v0, v1, dtype=torch.int64, device=device)
        h = (tokens * 2_654_435_761) % (2**32) % n_experts
        j = torch.arange(k0, k1, dtype=torch.int64, device=device)
        return ((h[:, None] + j * (n_experts // shape[1])) % n_experts).to(dtype)

    return fn


def _block_specs(cfg: Config, kind: str, *, hashed: bool) -> dict[str, Any]:
    d, std = cfg.dim, cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    moe = moe_v4.hash_moe_params(d, cfg.n_experts, cfg.expert_dim, top_k=cfg.top_k, vocab_size=cfg.vocab_size,
                                 hashed=hashed, std=std, out_std=out_std)  # fmt: skip
    if hashed:
        moe["hash_table"] = attrs.evolve(moe["hash_table"], init=_hash_table_init(cfg.n_experts))
    return {
        "attn_hc": hc.hc_params(d, cfg.hc_mult, std=std),
        "attn_norm": nn.norm_param(d),
        "attn": sa.attention_params(d, cfg.attention(kind), std=std, out_std=out_std),
        "mlp_hc": hc.hc_params(d, cfg.hc_mult, std=std),
        "mlp_norm": nn.norm_param(d),
        "moe": moe,
    }


def param_specs(cfg: Config) -> dict[str, Any]:
    """Tree of ``nn.Param`` specs (shape, logical axes, init) shaped like the params."""
    d, std = cfg.dim, cfg.init_std
    specs = {
        "embed": nn.embed_param(cfg.vocab_size, d, std=std),
        "layers": {str(i): _block_specs(cfg, cfg.layer_types[i], hashed=i < cfg.n_hash_layers)
                   for i in range(cfg.n_layers)},  # fmt: skip
        "hc_head": hc.hc_head_params(d, cfg.hc_mult, std=std),
        "norm": nn.norm_param(d),
        "head": nn.linear_param(d, cfg.vocab_size, axes=("vocab", "embed"), std=std),
    }
    if cfg.n_mtp_layers:
        specs["mtp"] = mtp_.mtp_specs(d, cfg.n_mtp_layers, lambda: _block_specs(cfg, "sliding", hashed=False),
                                      hc_mult=cfg.hc_mult, std=std)  # fmt: skip
    return specs


def param_counts(cfg: Config) -> tuple[int, int]:
    """``(total, active)``: ``active`` leaves out the ``E - top_k`` routed experts a token does not use per
    block and keeps everything else (embedding, hash tables and biases included)."""
    total = sum(math.prod(s.shape) for s in tree.leaves(param_specs(cfg)))
    unused = (cfg.n_layers + cfg.n_mtp_layers) * (cfg.n_experts - cfg.top_k) * 3 * cfg.dim * cfg.expert_dim
    return total, total - unused


def flops_per_token(cfg: Config, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N`` over the matmul weights a token goes through (the active ones,
    not the embedding lookup, norms, tables, biases or sinks) plus ``12 * H * Dh`` per key a query scores:
    ``min(T, window)`` raw keys and, per compressed layer, on average ``T / (2 * rate)`` entries (csa:
    at most ``index_topk``); the indexer's scores and the routing are not counted."""
    n = 0
    for path, spec in zip(*tree.flatten_with_paths(param_specs(cfg))[:2], strict=True):
        if path == "embed" or len(spec.shape) < 2 or path.endswith("hash_table") or path.endswith("ape"):
            continue
        size = math.prod(spec.shape)
        n += size * cfg.top_k // cfg.n_experts if ".experts." in path else size
    keys = cfg.n_mtp_layers * min(seq_len, cfg.window)
    for kind in cfg.layer_types:
        keys += min(seq_len, cfg.window)
        if kind == "hca":
            keys += seq_len / (2 * cfg.hca_rate)
        elif kind == "csa":
            keys += min(seq_len / (2 * cfg.csa_rate), cfg.index_topk)
    return float(6 * n + 12 * cfg.n_heads * cfg.head_dim * keys)


def frozen(cfg: Config) -> tuple[str, ...]:
    """Leaves optimizers leave unchanged: balancing biases (moved by ``update_buffers``), the hash tables,
    and the indexers when ``indexer_loss_coef == 0`` (they would get no gradient: top-k is discrete)."""
    globs = ("layers.*.moe.router_bias", "layers.*.moe.hash_table")
    globs += ("mtp.*.block.moe.router_bias",) if cfg.n_mtp_layers else ()
    return globs + (("layers.*.attn.indexer.**",) if cfg.indexer_loss_coef == 0 else ())


# ---------------------------------------------------------------- forward


def _apply_with_aux(
    cfg: Config,
    attn_cfgs: Mapping[str, sa.SparseAttentionConfig],  # built once outside: dynamo cannot trace attrs __init__
    moe_cfg: moe_.MoEConfig,
    params: Mapping[str, Any],
    tokens: torch.Tensor,  # (B, T) int
    *,
    positions: torch.Tensor | None = None,  # (T,) | (B, T); must be arange(T) without a cache
    cache: Any = None,
    segments: torch.Tensor | None = None,
    logits: bool = True,
    with_kl: bool | None = None,  # the indexer's KL (default: when indexer_loss_coef > 0)
    with_mtp: bool | None = None,  # the MTP losses (default: when n_mtp_layers > 0)
) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor]]:  # (B, T, V) | (B, T, D); cache; aux
    if tokens.dim() != 2:
        raise ValueError(f"deepseek_v4.apply: tokens must be (B, T), got shape {tuple(tokens.shape)}")
    fwd.check_layout(positions, segments)
    if cache is not None:
        h, cache = fwd.cached_forward(cfg, attn_cfgs, params, tokens, positions, cache)
        return fwd.finish(cfg, params, h, logits=logits), cache, {}
    with_kl = cfg.indexer_loss_coef > 0 if with_kl is None else with_kl
    positions = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
    h = par.embed(tokens, params["embed"])  # (B, T_local, D)
    h = h.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)
    learned, kls = [], []

    def block(i: int, p: Mapping[str, Any], h: torch.Tensor, _attend: Any) -> tuple[torch.Tensor, Any]:
        h, stats, kl = fwd.block(cfg, attn_cfgs[cfg.layer_types[i]], p, h, tokens, positions, with_kl=with_kl)
        return h, (stats, kl)

    from ftitan.train import remat  # the layer loop bypasses decoder.run_stage: cfg.remat applied here

    block = remat.remat_block(cfg.remat, block, range(cfg.n_layers))
    for i in range(cfg.n_layers):  # explicit order: dict order would put "10" before "2"
        h, (stats, kl) = block(i, params["layers"][str(i)], h, None)
        if i >= cfg.n_hash_layers:
            learned.append(stats)
        if kl is not None:
            kls.append(kl)
    mtp_losses: list[torch.Tensor] = []
    if cfg.n_mtp_layers and (with_mtp is None or with_mtp):
        mtp_losses, stats = fwd.mtp_losses(cfg, attn_cfgs, params, h, tokens)
        learned += stats
    aux = _aux(cfg, moe_cfg, learned, kls)
    if mtp_losses:
        mtp_loss = torch.stack(mtp_losses).mean()
        aux["mtp.loss"] = mtp_loss.detach()
        aux["loss"] = aux["loss"] + cfg.mtp_loss_weight * mtp_loss
    return fwd.finish(cfg, params, h, logits=logits), None, aux


def _aux(cfg: Config, moe_cfg: moe_.MoEConfig, learned: list[Any], kls: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    aux = expert.moe_aux(learned, moe_cfg)  # router statistics of the global batch, learned-routing blocks
    if kls:
        kl = torch.stack([k.mean() for k in kls]).mean()
        aux["indexer.kl"] = kl.detach()
        aux["loss"] = aux["loss"] + cfg.indexer_loss_coef * kl
    return aux


def update_router_bias(cfg: Config, params: Mapping[str, Any], metrics: Mapping[str, torch.Tensor]) -> Any:
    """Params with each learned-routing block's ``router_bias`` moved towards balance (``Model.update_buffers``);
    ``metrics["moe.tokens_per_expert"]`` row ``j`` is block ``n_hash_layers + j``, then the MTP blocks. Pure."""
    load = metrics.get("moe.tokens_per_expert")
    want = (cfg.n_layers - cfg.n_hash_layers + cfg.n_mtp_layers, cfg.n_experts)
    if load is None or tuple(load.shape) != want:
        raise ValueError(f"deepseek_v4.update_buffers: metrics need moe.tokens_per_expert of shape {want} (from "
                         f"model.apply_with_aux), got {None if load is None else tuple(load.shape)}")  # fmt: skip
    layers = dict(params["layers"])
    with torch.no_grad():
        for j, i in enumerate(range(cfg.n_hash_layers, cfg.n_layers)):
            blk = dict(layers[str(i)])
            moe = dict(blk["moe"])
            moe["router_bias"] = moe_.update_router_bias(moe["router_bias"], load[j], cfg.bias_update_rate)
            layers[str(i)] = {**blk, "moe": moe}
        mtp = {}
        for k in range(cfg.n_mtp_layers):  # rows after the main blocks'
            module = dict(params["mtp"][str(k)])
            blk = dict(module["block"])
            moe = dict(blk["moe"])
            row = load[cfg.n_layers - cfg.n_hash_layers + k]
            moe["router_bias"] = moe_.update_router_bias(moe["router_bias"], row, cfg.bias_update_rate)
            mtp[str(k)] = {**module, "block": {**blk, "moe": moe}}
    return {**params, "layers": layers, **({"mtp": mtp} if mtp else {})}


def model(cfg: Config) -> Model:
    """The DeepSeek-V4 ``Model`` for ``cfg``. ``init`` keeps the balancing biases and hash tables in float32
    whatever ``dtype`` (bias steps of 1e-3 vanish in bfloat16; expert ids stay exact)."""
    specs = param_specs(cfg)

    def init(key: torch.Tensor, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> tree.Tree:  # fmt: skip
        params = nn.init(specs, key, dtype=dtype, device=device)
        blocks = [params["layers"][str(i)] for i in range(cfg.n_layers)]
        blocks += [params["mtp"][str(k)]["block"] for k in range(cfg.n_mtp_layers)]
        for blk in blocks:
            moe = blk["moe"]
            for name in ("router_bias", "hash_table"):
                if name in moe:
                    moe[name] = moe[name].to(torch.float32)
        return params

    attn_cfgs = {kind: cfg.attention(kind) for kind in sa.KINDS}
    apply_with_aux = functools.partial(_apply_with_aux, cfg, attn_cfgs, cfg.moe)

    def apply(params: tree.Tree, tokens: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        out, cache, _ = apply_with_aux(params, tokens, with_kl=False, with_mtp=False, **kwargs)
        return out, cache

    return Model(
        config=cfg,
        init=init,
        apply=apply,
        head=lambda params: params["head"],
        param_axes=nn.axes(specs),
        flops_per_token=functools.partial(flops_per_token, cfg),
        apply_with_aux=apply_with_aux,
        frozen=frozen(cfg),
        update_buffers=functools.partial(update_router_bias, cfg),
    )


from ftitan.models import deepseek_v4_hf  # noqa: E402,F401  (registers the HF family; needs the names above)
