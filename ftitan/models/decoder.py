"""Pieces shared by the pre-norm GQA decoder families (Llama 3, Qwen3, Qwen3-MoE).

Each family module keeps its own config, params tree and HF table; what is
the same in all of them lives here once: attention block specs and apply
(with optional QK-norm), RoPE angles, the output head, residual init
scaling, attention FLOPs, and the non-layer HF names.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ftitan import nn, random
from ftitan.kernels.rope import apply_rope_qk
from ftitan.models import fused, hf
from ftitan.models.base import StageOut
from ftitan.nn import invariant
from ftitan.nn.attention import Attend, AttentionImpl
from ftitan.parallel import activations as par
from ftitan.parallel.layout import current

__all__ = [
    "AttentionConfig",
    "HF_ATTENTION",
    "HF_MLP",
    "HF_QK_NORM",
    "Scan",
    "attention",
    "attention_flops",
    "attention_params",
    "check_positive_int",
    "dense_forward",
    "dense_stage",
    "head_params",
    "logits_of",
    "hf_common_to_hf",
    "hf_ignored",
    "hf_outer_weights",
    "layer_attention",
    "mlp",
    "norm",
    "output_head",
    "positions_for",
    "recur",
    "residual_std",
    "rope",
    "run_stage",
    "stage_positions",
]


class AttentionConfig(Protocol):
    """What the shared pieces read from a config (``llama``, ``qwen3``, ``qwen3_moe`` Configs)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def attn_impl(self) -> AttentionImpl: ...
    @property
    def init_std(self) -> float: ...


def check_positive_int(cfg: Any, family: str, name: str) -> None:
    """Raise naming ``{family}.Config.{name}`` unless that field is a positive int (bools refused)."""
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{family}.Config.{name}={value!r}: must be a positive int")


def check_float8(cfg: Any, family: str) -> None:
    """``nn.float8.check_config`` for a GQA decoder with a SwiGLU MLP (llama, qwen3, qwen3_moe): its widths
    are ``dim``, ``ffn_dim`` and the q / kv projections'."""
    nn.float8.check_config(cfg, family, {"dim": cfg.dim, "ffn_dim": cfg.ffn_dim, "q": cfg.n_heads * cfg.head_dim,
                                         "kv": cfg.n_kv_heads * cfg.head_dim})  # fmt: skip


def init_and_axes(cfg: Any, specs: Any) -> tuple[Callable[..., Any], Any]:
    """A family's ``Model.init`` and ``param_axes`` from its param specs: ``nn.init(specs)``, or with the
    config's ``fuse_projections`` that init's leaves stacked (``ftitan.models.fused``: the same values)."""
    init, axes = functools.partial(nn.init, specs), nn.axes(specs)
    if getattr(cfg, "fuse_projections", False):
        return fused.fused_init(init), fused.fuse_axes(axes)
    return init, axes


def fused_weights(cfg: Any, maps: list[hf.WeightMap], specs: Any) -> list[hf.WeightMap]:
    """A family's HF name table (``maps``, one per unfused leaf) for its params: with the config's
    ``fuse_projections`` each stacked leaf maps to its parts' names (``fused.fuse_weight_maps``)."""
    if not getattr(cfg, "fuse_projections", False):
        return maps
    return fused.fuse_weight_maps(maps, nn.init(specs, random.key(0), device="meta"))


def check_fuse_projections(cfg: Any, family: str) -> None:
    """``fuse_projections`` is a bool (``--model.fuse-projections``)."""
    if not isinstance(cfg.fuse_projections, bool):
        raise ValueError(f"{family}.Config.fuse_projections={cfg.fuse_projections!r}: must be True or False")


def residual_std(cfg: AttentionConfig) -> float:
    """Init std of the residual-branch outputs (wo, w2): ``init_std / sqrt(2L)``, GPT-2 style depth scaling."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


def attention_params(cfg: AttentionConfig, *, qk_norm: bool) -> dict[str, nn.Param]:
    """Specs of one GQA attention block ``{wq, wk, wv, wo}``, plus ``{q_norm, k_norm}`` with ``qk_norm``."""
    d, q_dim, kv_dim, std = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.init_std
    return {
        "wq": nn.linear_param(d, q_dim, axes=("heads", "embed"), std=std),
        "wk": nn.linear_param(d, kv_dim, axes=("kv_heads", "embed"), std=std),
        "wv": nn.linear_param(d, kv_dim, axes=("kv_heads", "embed"), std=std),
        "wo": nn.linear_param(q_dim, d, axes=("embed", "heads"), std=residual_std(cfg)),
        **({"q_norm": nn.norm_param(cfg.head_dim), "k_norm": nn.norm_param(cfg.head_dim)} if qk_norm else {}),
    }


def head_params(cfg: AttentionConfig) -> dict[str, nn.Param]:
    """``{"head": (V, D)}``, or ``{}`` when the head is tied to the embedding."""
    if cfg.tie_embeddings:
        return {}
    return {"head": nn.linear_param(cfg.dim, cfg.vocab_size, axes=("vocab", "embed"), std=cfg.init_std)}


def attention_flops(cfg: AttentionConfig, seq_len: int) -> tuple[int, int]:
    """``(matmul weights per layer, 6 * L * T * H * Dh)``: the attention terms of ``flops_per_token``."""
    d, dh = cfg.dim, cfg.head_dim
    weights = 2 * d * cfg.n_heads * dh + 2 * d * cfg.n_kv_heads * dh
    return weights, 6 * cfg.n_layers * seq_len * cfg.n_heads * dh


def attention(
    cfg: AttentionConfig,
    p: Mapping[str, torch.Tensor],
    x: torch.Tensor,  # (B, T, D) normed
    cos: torch.Tensor,  # (T, Dh) | (B, T, Dh)
    sin: torch.Tensor,
    *,
    attend: Attend = par.attention,
) -> torch.Tensor:  # (B, T, D)
    """GQA attention: (QK-norm: ``rms_norm`` over each head of q and k, when ``p`` has
    ``q_norm``/``k_norm``), then RoPE, then causal attention through ``attend`` (a KV cache's, see
    :func:`run_stage`; default the context-parallel seam, plain ``nn.attention`` without a layout)."""
    x = par.column_input(x)  # tensor parallel: the block's input, whole on every tp rank
    b, t, _ = x.shape
    # -1 heads: under tensor parallelism each rank holds n_heads / tp of them
    inv, kern, f8 = invariant.enabled(cfg), cfg.kernels, getattr(cfg, "float8", "")
    if "wqkv" in p:  # one matmul for q, k, v (ftitan.models.fused: inference, or fuse_projections; no tp)
        _refuse_fused_under_tp("wqkv")
        sizes = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim)
        q, k, v = nn.linear(x, p["wqkv"], invariant=inv, kernels=kern, float8=f8).split(sizes, dim=-1)
    else:
        q, k, v = (nn.linear(x, p[name], invariant=inv, kernels=kern, float8=f8) for name in ("wq", "wk", "wv"))
    q, k, v = (y.reshape(b, t, -1, cfg.head_dim) for y in (q, k, v))
    if "q_norm" in p:  # Qwen3
        q = nn.rms_norm(q, par.tp_shared(p["q_norm"], "heads"), cfg.norm_eps, invariant=inv, kernels=cfg.kernels)
        k = nn.rms_norm(k, par.tp_shared(p["k_norm"], "kv_heads"), cfg.norm_eps, invariant=inv, kernels=cfg.kernels)
    if cfg.kernels != "torch":  # q and k in one launch (its reference elsewhere: nn.apply_rope of each)
        q, k = apply_rope_qk(q, k, cos, sin)
    else:
        q, k = nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin)
    o = attend(q, k, v, impl=cfg.attn_impl, causal=True, scale=cfg.head_dim**-0.5, kernels=cfg.kernels)
    return par.row_output(nn.linear(o.reshape(b, t, -1), p["wo"], invariant=inv, kernels=kern, float8=f8))


def norm(cfg: Any, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``rms_norm`` of the residual stream (under sequence parallelism each tp rank holds its own tokens,
    so the scale's gradient is summed over tp)."""
    return nn.rms_norm(h, par.tp_shared(w, "norm_seq"), cfg.norm_eps, invariant=invariant.enabled(cfg),
                       kernels=cfg.kernels)  # fmt: skip


def mlp(x: torch.Tensor, p: Mapping[str, torch.Tensor], *, invariant: bool = False,
        kernels: str = "torch", float8: str = "") -> torch.Tensor:  # fmt: skip
    """SwiGLU MLP of ``x`` (B, T_local, D) normed, column-parallel ``w1``/``w3`` and row-parallel ``w2``
    under tensor parallelism; ``invariant``: batch-invariant matmuls (``nn.invariant``); ``kernels``: the
    model's ``kernels`` (``nn.swiglu``); ``float8``: the model's (``ftitan.nn.float8``)."""
    if "w13" in p:
        _refuse_fused_under_tp("w13")
    return par.row_output(nn.swiglu(par.column_input(x), **p, invariant=invariant, kernels=kernels, float8=float8))


def _refuse_fused_under_tp(leaf: str) -> None:
    """Stacked projections (``ftitan.models.fused``) stay whole on every tp rank, while the heads and MLP
    columns they feed are split: refuse them under tensor parallelism, naming the fix."""
    layout = current()
    if layout is not None and layout.sizes["tp"] > 1:
        raise ValueError(f"{leaf}: fused projections do not run under tensor parallelism (tp={layout.sizes['tp']}); "
                         "train with fuse_projections=False there (--model.fuse-projections False)")


def positions_for(tokens: torch.Tensor, positions: torch.Tensor | None, *, family: str,
                  segments: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Checks ``tokens`` is (B, T); ``positions`` as given, default ``arange(T)``, or with ``segments``
    (packed documents) positions restarting at each document: (T,) | (B, T)."""
    if tokens.dim() != 2:
        raise ValueError(f"{family}.apply: tokens must be (B, T), got shape {tuple(tokens.shape)}")
    if segments is not None and segments.shape != tokens.shape:
        raise ValueError(f"{family}.apply: segments {tuple(segments.shape)} must have the tokens' shape "
                         f"{tuple(tokens.shape)}")  # fmt: skip
    if positions is not None:
        return positions
    if segments is not None:
        layout = current()
        if layout is not None and layout.sizes["cp"] > 1:  # a rank holds head-tail chunks: restarts are not local
            raise ValueError(f"{family}.apply: segments under context parallelism need explicit positions "
                             "(each document's positions, split with the tokens)")  # fmt: skip
        return nn.document_positions(segments)
    # under context parallelism a rank's tokens are head-tail chunks of the sequence
    return par.local_positions(tokens.shape[1], device=tokens.device)


def rope(
    cfg: AttentionConfig, positions: torch.Tensor, *, scaling: nn.RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: (T, Dh) | (B, T, Dh)
    """RoPE angles at ``positions`` (T,) | (B, T) (e.g. :func:`stage_positions`)."""
    inv_freq = nn.rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling, device=positions.device)
    return nn.rope_cos_sin(positions, inv_freq, invariant=invariant.enabled(cfg))


def output_head(cfg: AttentionConfig, params: Mapping[str, Any]) -> torch.Tensor:  # (V, D)
    """Weight of the output projection: the embedding table when tied (under tensor parallelism, this
    rank's vocab slice: the loss is vocab-parallel, :func:`logits_of` gathers)."""
    return params["embed"] if cfg.tie_embeddings else params["head"]


def logits_of(h: torch.Tensor, head: torch.Tensor, *, invariant: bool = False,
              kernels: str = "torch") -> torch.Tensor:  # fmt: skip
    """``h @ head.T`` (B, T, D), (V | V / tp, D) -> (B, T, V) with every vocab entry (the head gathered when
    tensor parallelism splits it); ``invariant``: a batch-invariant matmul (``nn.invariant``); ``kernels``: the
    model's (``nn.linear``)."""
    return nn.linear(h, par.gather_vocab(head), invariant=invariant, kernels=kernels)


def hf_outer_weights(cfg: AttentionConfig) -> list[hf.WeightMap]:
    """Embedding, final norm and (untied) head: the non-layer HF names of the Llama-style families."""
    maps = [
        hf.WeightMap(path="embed", names=("model.embed_tokens.weight",)),
        hf.WeightMap(path="norm", names=("model.norm.weight",)),
    ]
    if not cfg.tie_embeddings:
        maps.append(hf.WeightMap(path="head", names=("lm_head.weight",)))
    return maps


def _hidden_positions(h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:  # (T,) | (B, T)
    """Positions of a later pipeline stage's input ``h``: as given, default those of its tokens.

    ``h`` is the residual stream, split along the sequence over ``tp`` under
    sequence parallelism, so its rank holds ``h.shape[1] * tp`` of the tokens.
    """
    if h.dim() != 3 or not h.is_floating_point():
        raise ValueError(
            f"stage: a later stage's input must be hidden states (B, T, D), got {tuple(h.shape)} {h.dtype}"
        )
    if positions is not None:
        return positions
    layout = current()
    t = h.shape[1] * (layout.tp if layout is not None and layout.sequence_parallel else 1)
    return par.local_positions(t, device=h.device)


def stage_positions(
    x: torch.Tensor,  # (B, T) int tokens if first, else (B, T, D) hidden from the previous stage
    positions: torch.Tensor | None,
    *,
    first: bool,
    family: str,
    segments: torch.Tensor | None = None,  # (B, T) int document ids (packed rows)
) -> torch.Tensor:  # (T,) | (B, T) int
    """Positions of a pipeline stage's input: those of the tokens on the first stage, of the hidden
    states (whose sequence may be split over tp) on a later one; ``positions`` when given, else
    restarting at each document of ``segments``."""
    if first:
        return positions_for(x, positions, family=family, segments=segments)
    if positions is None and segments is not None:
        return nn.document_positions(segments)
    return _hidden_positions(x, positions)


# (layer index, its params, residual stream (B, T, D), its attention op) -> (residual stream, router stats or None)
Block = Callable[[int, Mapping[str, Any], torch.Tensor, Attend], tuple[torch.Tensor, Any]]


class _LayerCache:
    """Layer ``layer``'s view of a cache: called, it attends (``cache.attend``); :meth:`recur` runs a
    recurrent layer's scan from the state the cache holds (``cache.recur``). Keeps the cache each call
    returns, for the getter of :func:`layer_attention`."""

    def __init__(self, cache: Any, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernels: str = "torch",
                 **kwargs: Any) -> torch.Tensor:  # fmt: skip
        # a cache attends over its slots under a mask, never nn.attention's "gemm" path (kernels' only reader)
        o, self.cache = self.cache.attend(self.layer, q, k, v, **kwargs)
        return o

    def recur(self, scan: Scan, inputs: Any) -> Any:
        if not hasattr(self.cache, "recur"):
            raise ValueError(f"layer {self.layer} is recurrent (linear attention), and the cache "
                             f"{type(self.cache).__name__} keeps attention keys/values only; generate through "
                             "ftitan.infer (its KVCache holds recurrent state too)")  # fmt: skip
        out, self.cache = self.cache.recur(self.layer, scan, inputs)
        return out


# a recurrent layer's step over new tokens: (inputs, state or None (start from zeros), valid (B, T) bool or None
# (every token real)) -> (output, the state after the last real token); see base.AttentionCache.recur
Scan = Callable[[Any, Any, "torch.Tensor | None"], tuple[Any, Any]]


def recur(attend: Attend, scan: Scan, inputs: Any) -> Any:
    """A recurrent layer's output: ``scan`` through the layer's cache (:func:`layer_attention`: continues from
    the state the cache holds, which keeps the new one), or from a zero state without a cache."""
    if isinstance(attend, _LayerCache):
        return attend.recur(scan, inputs)
    out, _ = scan(inputs, None, None)
    return out


def layer_attention(cache: Any, layer: int, segments: torch.Tensor | None = None) -> tuple[Attend, Callable[[], Any]]:
    """Layer ``layer``'s attention op over ``cache`` (``base.AttentionCache``), and a getter of the
    cache after that layer wrote its keys/values (or its recurrent state, :func:`recur`); without a
    cache, causal attention over the block's own tokens (``parallel.activations.attention``), within
    each document of ``segments``."""
    if cache is None:
        if segments is None:
            return par.attention, lambda: None
        return functools.partial(par.attention, segments=segments), lambda: None
    if segments is not None:
        raise ValueError("apply: segments (packed documents) with a KV cache; decode one document per row")
    view = _LayerCache(cache, layer)
    return view, lambda: view.cache


def run_stage(
    cfg: Any,  # a config with norm_eps
    params: Mapping[str, Any],  # this stage's subtree: layers.{i} of ``layers``, embed if first, norm if last
    x: torch.Tensor,  # (B, T) int tokens if first, else (B, T, D) hidden from the previous stage
    block: Block,
    *,
    layers: range,
    first: bool,
    last: bool,
    cache: Any = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids: attention stays within a document
    final_norm: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,  # default: norm
    layer_kind: Callable[[int], Any] | None = None,  # for a block that reads its index: see below
) -> StageOut:  # h (B, T, D), {layer: router stats}, cache
    """Embed (``first``), ``block`` over ``layers`` in order, final norm (``last``): the layer loop every
    family's ``stage`` (and so its ``apply``) runs. The last stage's output is whole on every tp rank
    (ready for the head), the others' are in the residual-stream layout (split along the sequence under
    sequence parallelism). With a ``cache`` (``base.AttentionCache``) each layer attends through it, and
    the cache every layer wrote to is returned. Without one (training) ``block`` runs under ``cfg.remat``
    (``ftitan.train.remat``) and, inside ``ftitan.train.regional.compiling``, compiled once for all layers.

    A block that reads its index ``i`` (a per-layer window or RoPE base) would compile once per layer
    there; ``layer_kind(i)`` names what the block reads of ``i`` (layers of one kind run the same
    computation), and the compiled region is then called with the first index of each kind: one compile
    per kind."""
    from ftitan.train import regional, remat  # block transforms (ftitan.train imports the models)

    h = par.embed(x, params["embed"]) if first else x
    stats = {}
    kinds = None  # {kind: the first layer of that kind}, under regional compile
    if cache is None:  # training: remat (cfg.remat) and regional compile (regional.compiling) of the block
        block = remat.remat_block(getattr(cfg, "remat", "none"), block, layers)
        backend = regional.current_backend()
        block = block if backend is None else functools.partial(regional.block_call, backend, block)
        kinds = {} if backend is not None and layer_kind is not None else None
    for i in layers:  # explicit order: dict/optree order would put "10" before "2"
        attend, written = layer_attention(cache, i, segments)
        j = i if kinds is None else kinds.setdefault(layer_kind(i), i)
        h, s = block(j, params["layers"][str(i)], h, attend)
        cache = written()
        if s is not None:
            stats[i] = s
    h = par.column_input((final_norm or norm)(cfg, h, params["norm"])) if last else h
    return StageOut(h, stats, cache)


def dense_stage(
    cfg: Any,  # an AttentionConfig with ffn_dim
    params: Mapping[str, Any],  # this stage's subtree: layers.{i} of ``layers``, embed if first, norm if last
    x: torch.Tensor,  # (B, T) int tokens if first, else (B, T, D) hidden from the previous stage
    *,
    layers: range,
    first: bool,
    last: bool,
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int; default arange(T)
    cache: Any = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids (packed rows)
    family: str,
    scaling: nn.RopeScaling | None = None,
) -> StageOut:  # h (B, T, D): residual stream, or final-normed hidden if last; stats {}; cache
    """One pipeline stage of the pre-norm decoder (:func:`run_stage`): ``h += attn(rms_norm(h))``,
    ``h += swiglu(rms_norm(h))``. Stages over consecutive ranges of ``range(n_layers)`` compose to
    ``apply(..., logits=False)`` exactly."""
    cos, sin = rope(cfg, stage_positions(x, positions, first=first, family=family, segments=segments), scaling=scaling)

    def block(_i: int, p: Mapping[str, Any], h: torch.Tensor, attend: Attend) -> tuple[torch.Tensor, None]:
        h = h + attention(cfg, p["attn"], norm(cfg, h, p["attn_norm"]), cos, sin, attend=attend)
        x = norm(cfg, h, p["mlp_norm"])
        return h + mlp(x, p["mlp"], invariant=invariant.enabled(cfg), kernels=cfg.kernels,
                       float8=getattr(cfg, "float8", "")), None

    return run_stage(cfg, params, x, block, layers=layers, first=first, last=last, cache=cache, segments=segments)


def dense_forward(
    cfg: Any,  # an AttentionConfig with ffn_dim
    params: Mapping[str, Any],
    tokens: torch.Tensor,  # (B, T) int
    *,
    positions: torch.Tensor | None,  # (T,) | (B, T) int; default arange(T)
    cache: Any = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids (packed rows)
    logits: bool,
    family: str,
    scaling: nn.RopeScaling | None = None,
) -> tuple[torch.Tensor, Any]:  # (B, T, V) logits | (B, T, D) final-normed hidden; cache
    """The pre-norm decoder: ``h += attn(rms_norm(h))``, ``h += swiglu(rms_norm(h))``, final norm, head
    (one :func:`dense_stage` over all layers); attention through ``cache`` when given."""
    every = range(cfg.n_layers)
    h, _, cache = dense_stage(cfg, params, tokens, layers=every, first=True, last=True, positions=positions,
                              cache=cache, segments=segments, family=family, scaling=scaling)  # fmt: skip
    head = output_head(cfg, params)
    return (logits_of(h, head, invariant=invariant.enabled(cfg), kernels=cfg.kernels) if logits else h), cache


# per-layer HF names of the Llama-style decoders (Llama, Qwen3, Qwen3-MoE's attention half)
HF_ATTENTION = {
    "layers.{i}.attn_norm": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attn.wq": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attn.wk": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attn.wv": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attn.wo": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
}
HF_QK_NORM = {
    "layers.{i}.attn.q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attn.k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
HF_MLP = {
    "layers.{i}.mlp.w1": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.w2": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.mlp.w3": "model.layers.{i}.mlp.up_proj.weight",
}


def hf_ignored(cfg: AttentionConfig) -> tuple[str, ...]:
    """Checkpoint names skipped on import: old exports' rotary buffers, and the head of tied
    checkpoints (Llama 3.2 1B/3B, Qwen3-0.6B/1.7B/4B still store ``lm_head.weight``; HF ignores it too)."""
    return ("**.rotary_emb.inv_freq", *(("lm_head.weight",) if cfg.tie_embeddings else ()))


def hf_common_to_hf(cfg: AttentionConfig) -> dict[str, Any]:
    """HF config fields of the attention/embedding side (default RoPE; a family overrides ``rope_parameters``)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_bias": False,
        "attention_dropout": 0.0,
    }
