"""Muse Glimmer's text decoder (``transformers`` ``MuseGlimmerTextModel`` + head) as pure functions.

A pre- and post-normed GQA decoder with, per the reference implementation:

- centered RMSNorm on the blocks (scale ``1 + w``, ``w`` initialized to 0; Gemma's form),
  a weight-less RMSNorm on the embedding ("normed embedding"), a plain scaled RMSNorm at the end;
- post-norms: each block's attention and MLP outputs are normed (eps ``post_norm_eps``)
  before they join the residual stream (Gemma 2, Team et al. 2024);
- scaleless QK-norm (RMSNorm without a weight over each head of q and k), the queries
  then scaled by ``qk_scale`` on top of ``1/sqrt(head_dim)``;
- a sigmoid output gate: ``o * sigmoid(x @ wg.T)`` per head channel before ``wo``
  (gated attention, Qiu et al. 2025);
- per-layer RoPE base (``layer_rope_theta``; ``0`` is a NoPE layer) and layers alternating
  between sliding-window (``window`` most recent keys) and global attention (``layer_types``);
  by default every 4th layer counted back from the last is global and NoPE, the rest sliding;
- logits ``cap * tanh(output_multiplier * (h @ head.T) / cap)`` (Gemma 2's soft-cap).

``head(params)`` is ``output_multiplier * params["head"]``: the linear part of the logits, so
the chunked training loss, ``ftitan.infer``'s steps and vLLM apply the multiplier. The tanh
soft-cap is ``Model.logit_softcap``: ``apply(..., logits=True)`` applies it (:func:`cap_logits`), and
so does every path that applies ``head`` itself (the training loss, the KV-cache steps, DPO/RL
log-probs, the pipeline's last stage). Vision towers are out of scope: an HF checkpoint of the multimodal
``MuseGlimmerForConditionalGeneration`` imports its text weights, the vision ones are ignored.

Parallel (``ftitan.parallel``): FSDP / DDP, tensor and sequence parallel (heads, gate, MLP
width, vocab over ``tp``), context parallel (windows on true positions), pipeline stages.

Params tree::

    {"embed": (V, D),
     "layers": {"0": {"attn_norm": (D,), "attn": {"wq": (H*Dh, D), "wk": (KV*Dh, D), "wv": (KV*Dh, D),
                                                  "wg": (H*Dh, D), "wo": (D, H*Dh)},
                      "attn_post_norm": (D,), "mlp_norm": (D,),
                      "mlp": {"w1": (F, D), "w2": (D, F), "w3": (F, D)}, "mlp_post_norm": (D,)},
                "1": ...},
     "norm": (D,),
     "head": (V, D)}

>>> import torch, ftitan as ft
>>> from ftitan.models import muse_glimmer
>>> m = muse_glimmer.model(muse_glimmer.Config.debug())
>>> logits, _ = m.apply(m.init(ft.random.key(0)), torch.zeros(2, 16, dtype=torch.long))
>>> logits.shape
torch.Size([2, 16, 2048])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from ftitan import nn
from ftitan.models import base, decoder, qwen3
from ftitan.models.base import Model
from ftitan.nn import invariant
from ftitan.nn.attention import Attend, AttentionImpl
from ftitan.parallel import activations as par

__all__ = ["FLAVORS", "FULL", "SLIDING", "Config", "cap_logits", "flops_per_token", "model", "param_specs"]

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types


def _optional_tuple(value: Sequence[Any] | None) -> tuple[Any, ...] | None:
    if isinstance(value, (str, bytes)):
        raise ValueError(f"muse_glimmer.Config: expected a sequence, got {value!r}")
    return None if value is None else tuple(value)


def default_layer_types(n_layers: int) -> tuple[str, ...]:
    """Global attention on every 4th layer counted back from the last, sliding elsewhere (HF's default)."""
    return tuple(FULL if (n_layers - 1 - i) % 4 == 0 else SLIDING for i in range(n_layers))


def default_layer_rope_theta(n_layers: int, theta: float) -> tuple[float, ...]:
    """NoPE (0) on every 4th layer counted back from the last, ``theta`` elsewhere (HF's default)."""
    return tuple(0.0 if (n_layers - 1 - i) % 4 == 0 else float(theta) for i in range(n_layers))


@attrs.frozen(kw_only=True)
class Config:
    """Muse Glimmer text decoder. Published size: ``Config.muse_glimmer_30b()``, see ``FLAVORS``."""

    vocab_size: int  # V: rows of the embedding / output head
    dim: int  # D: residual stream width (HF hidden_size)
    n_layers: int  # L: decoder blocks
    n_heads: int  # H: query heads
    n_kv_heads: int  # KV: key/value heads (GQA); n_heads % n_kv_heads == 0
    head_dim: int  # Dh: width of one head (H * Dh need not equal dim)
    ffn_dim: int  # F: SwiGLU hidden width (HF intermediate_size)
    window: int = 2048  # keys a sliding layer's query sees, itself included (HF sliding_window)
    # per layer "sliding_attention" | "full_attention"; None: every 4th from the last global (default_layer_types)
    layer_types: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    rope_theta: float = 10_000.0  # RoPE base of the layers layer_rope_theta leaves at the default
    # per-layer RoPE base, 0 = NoPE; None: every 4th from the last NoPE, rope_theta elsewhere
    layer_rope_theta: tuple[float, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    qk_scale: float = 3.87  # multiplies the QK-normed queries, on top of 1/sqrt(head_dim) (HF qk_scale_factor)
    output_multiplier: float = 0.19611613513818404  # logits scale before the soft-cap, 1/sqrt(D/256) at 30B
    logit_softcap: float = 20.0  # logits = cap * tanh(logits / cap) (HF final_logit_softcapping)
    norm_eps: float = 1e-5  # eps of the pre-norms, the embedding norm, the QK-norm and the final norm
    post_norm_eps: float = 1e-8  # eps of the post-attention and post-MLP norms
    max_seq_len: int = 131_072  # longest sequence the model is meant for (HF max_position_embeddings)
    # "sdpa", "math" (explicit fp32 softmax), "batch_invariant" (all ops, nn.invariant), "flex" (FlexAttention,
    # SDPA with the same mask where it cannot run), "gemm" (causal query blocks as GEMMs on the CPU, else sdpa),
    # "auto" (flex on CUDA under torch.compile, gemm on the CPU, else sdpa)
    attn_impl: AttentionImpl = "sdpa"
    kernels: str = "torch"  # "torch", "triton" or "helion" (ftitan.kernels on CUDA, their references elsewhere)
    remat: str = "none"  # activation rematerialization of each block (ftitan.config.with_remat): "none", "full", ...
    init_std: float = 0.02  # std of the normal init; residual outputs wo/w2 get init_std/sqrt(2L)

    def __attrs_post_init__(self) -> None:
        qwen3.check_config(self, "muse_glimmer")
        for name in ("ffn_dim", "window"):
            decoder.check_positive_int(self, "muse_glimmer", name)
        for name in ("qk_scale", "output_multiplier", "logit_softcap", "post_norm_eps"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"muse_glimmer.Config.{name}={getattr(self, name)!r}: must be a finite number > 0")
        for name in ("layer_types", "layer_rope_theta"):
            value = getattr(self, name)
            if value is not None and len(value) != self.n_layers:
                raise ValueError(f"muse_glimmer.Config.{name}: {len(value)} entries for n_layers={self.n_layers}")
        if self.layer_types is not None and (bad := sorted(set(self.layer_types) - {SLIDING, FULL})):
            raise ValueError(f"muse_glimmer.Config.layer_types: unknown {bad}; use {SLIDING!r} or {FULL!r}")
        if self.layer_rope_theta is not None and not all(0 <= t < math.inf for t in self.layer_rope_theta):
            raise ValueError(f"muse_glimmer.Config.layer_rope_theta={self.layer_rope_theta}: need finite values >= 0")
        # the defaults spelled out are stored as None: one config per model, whichever way it was written
        if self.layer_types == default_layer_types(self.n_layers):
            object.__setattr__(self, "layer_types", None)
        if self.layer_rope_theta == default_layer_rope_theta(self.n_layers, self.rope_theta):
            object.__setattr__(self, "layer_rope_theta", None)

    @property
    def tie_embeddings(self) -> bool:
        """Always False: the head is its own matrix (``decoder`` helpers read this)."""
        return False

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window: ``window`` on sliding layers, ``None`` on global ones."""
        types = self.layer_types or default_layer_types(self.n_layers)
        return tuple(self.window if kind == SLIDING else None for kind in types)

    @property
    def thetas(self) -> tuple[float, ...]:
        """Each layer's RoPE base, ``0.0`` for NoPE layers."""
        return self.layer_rope_theta or default_layer_rope_theta(self.n_layers, self.rope_theta)

    @classmethod
    def debug(cls) -> Config:
        """Tiny model that trains on 2 CPU cores: 4 layers (3 sliding with a 64-token window, 1 global NoPE);
        the output multiplier is the 30B's rule ``1 / sqrt(D / 256)``, 1 at D = 256."""
        return cls(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, ffn_dim=768,
                   window=64, max_seq_len=2048, output_multiplier=1.0)  # fmt: skip

    # the reference configuration: transformers 5.19's MuseGlimmerTextConfig defaults
    # (checkpoint meta-models/Muse-Glimmer-30B; the text decoder of the 29.8B multimodal model)
    @classmethod
    def muse_glimmer_30b(cls) -> Config:
        """Muse Glimmer 30B's text decoder: 27,854,780,928 params (the vision tower adds 1.92B)."""
        return cls(vocab_size=202_048, dim=6656, n_layers=52, n_heads=32, n_kv_heads=2, head_dim=128,
                   ffn_dim=19_968)  # fmt: skip


FLAVORS = {"debug": Config.debug, "muse_glimmer_30b": Config.muse_glimmer_30b}


def _centered_norm_param(dim: int) -> nn.Param:
    """A centered RMSNorm's ``(dim,)`` weight: the scale is ``1 + w``, so it starts at 0."""
    return nn.Param(shape=(dim,), axes=nn.NORM_AXES, init=nn.zeros_init)


def param_specs(cfg: Config) -> dict[str, Any]:
    """Tree of ``nn.Param`` specs (shape, logical axes, init) shaped like the params."""
    std, out_std = cfg.init_std, decoder.residual_std(cfg)

    def layer() -> dict[str, Any]:
        attn = decoder.attention_params(cfg, qk_norm=False)
        attn["wg"] = nn.linear_param(cfg.dim, cfg.n_heads * cfg.head_dim, axes=("heads", "embed"), std=std)
        return {
            "attn_norm": _centered_norm_param(cfg.dim), "attn": attn, "attn_post_norm": _centered_norm_param(cfg.dim),
            "mlp_norm": _centered_norm_param(cfg.dim), "mlp": nn.swiglu_params(cfg.dim, cfg.ffn_dim, std=std,
                                                                                out_std=out_std),
            "mlp_post_norm": _centered_norm_param(cfg.dim),
        }  # fmt: skip

    return {
        "embed": nn.embed_param(cfg.vocab_size, cfg.dim, std=std),
        "layers": {str(i): layer() for i in range(cfg.n_layers)},
        "norm": nn.norm_param(cfg.dim),
        **decoder.head_params(cfg),
    }


def flops_per_token(cfg: Config, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

    ``6 * N + 12 * H * Dh * sum over layers of the mean keys a query sees``. N counts the matmul
    weights (q, k, v, gate, o, the SwiGLU, the head; not the embedding lookup or the norms). A
    global layer's query sees ``T / 2`` keys on average (the causal half, as ``qwen3``), a sliding
    layer's ``T / 2`` up to ``T = window``, then ``window * (1 - window / (2 T))``.
    """
    d, hd = cfg.dim, cfg.n_heads * cfg.head_dim
    per_layer = 3 * d * hd + 2 * d * cfg.n_kv_heads * cfg.head_dim + 3 * d * cfg.ffn_dim
    t = seq_len
    keys = sum(t / 2 if w is None or t <= w else w * (1 - w / (2 * t)) for w in cfg.windows)
    return float(6 * (cfg.n_layers * per_layer + cfg.vocab_size * d) + 12 * hd * keys)


def cap_logits(cfg: Config, logits: torch.Tensor) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` of the head's logits (``h @ head(params).T``, the multiplier applied)."""
    return base.soft_cap(logits, cfg.logit_softcap)


def output_head(cfg: Config, params: Mapping[str, Any]) -> torch.Tensor:  # (V, D) | (V / tp, D)
    """The linear part of the logits: ``output_multiplier * head`` (this rank's vocab slice under tp)."""
    return params["head"] * cfg.output_multiplier


def _centered_norm(h: torch.Tensor, w: torch.Tensor, eps: float, *, inv: bool, kernels: str = "torch") -> torch.Tensor:
    """RMSNorm with scale ``1 + w`` of the residual stream (its own tokens on each rank under sequence
    parallelism, so the weight's gradient is summed over tp). Scaled in float32 and then cast, as HF: in
    bfloat16, ``1 + w`` would round a small ``w`` away."""
    f = torch.promote_types(h.dtype, torch.float32)  # float64 kept (finite-difference checks)
    scale = 1 + par.tp_shared(w, "norm_seq").to(f)
    return nn.rms_norm(h.to(f), scale, eps, invariant=inv, kernels=kernels).to(h.dtype)


def _unit_norm(x: torch.Tensor, eps: float, *, inv: bool) -> torch.Tensor:
    """RMSNorm without a weight (the embedding's, the QK-norm)."""
    return nn.rms_norm(x, torch.ones((), dtype=x.dtype, device=x.device), eps, invariant=inv)


def _attention(
    cfg: Config,
    p: Mapping[str, torch.Tensor],
    x: torch.Tensor,  # (B, T, D) pre-normed
    rope: tuple[torch.Tensor, torch.Tensor] | None,  # cos, sin (T, Dh) | (B, T, Dh); None: NoPE
    window: int | None,
    attend: Attend,
) -> torch.Tensor:  # (B, T, D) in the residual-stream layout
    """Scaleless QK-norm, RoPE (unless NoPE), causal attention (sliding when ``window``), sigmoid gate, ``wo``."""
    x = par.column_input(x)  # tensor parallel: the block's input, whole on every tp rank
    b, t, _ = x.shape
    inv = invariant.enabled(cfg)
    if "wqkv" in p:  # one matmul for q, k, v (ftitan.infer.fuse_projections; one process, no tp)
        sizes = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim)
        qkv = nn.linear(x, p["wqkv"], invariant=inv, kernels=cfg.kernels).split(sizes, dim=-1)
    else:
        qkv = tuple(nn.linear(x, p[name], invariant=inv, kernels=cfg.kernels) for name in ("wq", "wk", "wv"))
    q, k, v = (y.reshape(b, t, -1, cfg.head_dim) for y in qkv)
    q, k = _unit_norm(q, cfg.norm_eps, inv=inv), _unit_norm(k, cfg.norm_eps, inv=inv)
    if rope is not None:
        q, k = nn.apply_rope(q, *rope, kernels=cfg.kernels), nn.apply_rope(k, *rope, kernels=cfg.kernels)
    extra = {} if window is None else {"window": window}  # global layers call any cache as other families do
    o = attend(q, k, v, impl=cfg.attn_impl, causal=True, scale=cfg.qk_scale * cfg.head_dim**-0.5, **extra)
    gate = torch.sigmoid(nn.linear(x, p["wg"], invariant=inv, kernels=cfg.kernels))  # (B, T, H_local * Dh)
    return par.row_output(nn.linear(o.reshape(b, t, -1) * gate, p["wo"], invariant=inv, kernels=cfg.kernels))


def _ropes(cfg: Config, positions: torch.Tensor, layers: range) -> dict[float, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin at ``positions`` for each RoPE base the ``layers`` use (NoPE layers need none)."""
    thetas = sorted({cfg.thetas[i] for i in layers if cfg.thetas[i]})
    inv = invariant.enabled(cfg)
    return {
        theta: nn.rope_cos_sin(positions, nn.rope_inv_freq(cfg.head_dim, theta, None, device=positions.device),
                               invariant=inv)
        for theta in thetas
    }  # fmt: skip


def _stage(
    cfg: Config,
    params: Mapping[str, Any],  # this stage's subtree: layers.{i} of ``layers``, embed if first, norm if last
    x: torch.Tensor,  # (B, T) int tokens if first, else (B, T, D) hidden from the previous stage
    *,
    layers: range,
    first: bool,
    last: bool,
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int; default arange(T)
    cache: Any = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows
) -> base.StageOut:  # h (B, T, D): residual stream, or final-normed hidden if last; stats {}; cache
    """Normed embedding (``first``), blocks ``layers``, final norm (``last``): ``apply``'s layer loop
    and one pipeline stage (``base.StageFn``)."""
    pos = decoder.stage_positions(x, positions, first=first, family="muse_glimmer", segments=segments)
    ropes = _ropes(cfg, pos, layers)
    inv = invariant.enabled(cfg)

    def block(i: int, p: Mapping[str, Any], h: torch.Tensor, attend: Attend) -> tuple[torch.Tensor, None]:
        rope = ropes.get(cfg.thetas[i])
        kern = cfg.kernels
        a = _attention(cfg, p["attn"], _centered_norm(h, p["attn_norm"], cfg.norm_eps, inv=inv, kernels=kern), rope,
                       cfg.windows[i], attend)  # fmt: skip
        h = h + _centered_norm(a, p["attn_post_norm"], cfg.post_norm_eps, inv=inv, kernels=kern)
        m = decoder.mlp(_centered_norm(h, p["mlp_norm"], cfg.norm_eps, inv=inv, kernels=kern), p["mlp"], invariant=inv,
                        kernels=kern)  # fmt: skip
        return h + _centered_norm(m, p["mlp_post_norm"], cfg.post_norm_eps, inv=inv, kernels=kern), None

    if first:  # the normed embedding enters as a later stage's input would
        x = _unit_norm(par.embed(x, params["embed"]), cfg.norm_eps, inv=inv)
    # the block reads its index only for the layer's RoPE base and window: one regional compile per pair
    return decoder.run_stage(cfg, params, x, block, layers=layers, first=False, last=last, cache=cache,
                             segments=segments, layer_kind=lambda i: (cfg.thetas[i], cfg.windows[i]))  # fmt: skip


def _apply(
    cfg: Config,
    params: Mapping[str, Any],
    tokens: torch.Tensor,  # (B, T) int
    *,
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int
    cache: Any = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows
    logits: bool = True,
) -> tuple[torch.Tensor, Any]:  # (B, T, V) soft-capped logits | (B, T, D) final-normed hidden; cache
    h, _, cache = _stage(cfg, params, tokens, layers=range(cfg.n_layers), first=True, last=True,
                         positions=positions, cache=cache, segments=segments)  # fmt: skip
    if not logits:
        return h, cache
    z = decoder.logits_of(h, output_head(cfg, params), invariant=invariant.enabled(cfg), kernels=cfg.kernels)
    return cap_logits(cfg, z), cache


def model(cfg: Config) -> Model:
    """The Muse Glimmer text ``Model`` for ``cfg``."""
    specs = param_specs(cfg)
    return Model(
        config=cfg,
        init=functools.partial(nn.init, specs),  # (key, *, dtype, device) -> params
        apply=functools.partial(_apply, cfg),
        head=functools.partial(output_head, cfg),
        param_axes=nn.axes(specs),
        flops_per_token=functools.partial(flops_per_token, cfg),
        stage=functools.partial(_stage, cfg),
        logit_softcap=cfg.logit_softcap,
    )


from ftitan.models import muse_glimmer_hf  # noqa: E402,F401  (registers the HF family)
