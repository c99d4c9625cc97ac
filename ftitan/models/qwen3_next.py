"""Qwen3-Next and Qwen3.5 (Qwen team 2025-2026): hybrid decoders of Gated DeltaNet linear attention and
gated full attention, as pure functions.

Three of every four layers (``attention_every``) mix tokens with Gated DeltaNet (``ftitan.nn.gdn``:
projections to q, k, v per key head, a causal depthwise conv + SiLU over them, the gated delta rule
with a learned per-head decay ``g = -exp(A_log) softplus(a + dt_bias)`` and write strength
``beta = sigmoid(b)``, a gated RMSNorm per head, an output projection); every fourth is full
attention with a sigmoid output gate (``q_proj`` gives each head's query and gate), zero-centered
QK-norm and RoPE on the first ``partial_rotary`` of each head. Every norm of the residual stream is
zero-centered (scale ``1 + w``, ``w`` initialized to 0). The feed-forward is a SwiGLU, or (``n_experts
> 0``) a softmax top-k MoE plus a shared expert scaled by ``sigmoid(x @ shared_gate)``, with the Switch
balancing loss (``aux_loss_coef``).

``variant`` picks the checkpoint layout (``ftitan.models.qwen3_next_hf``): ``"qwen3_next"``
(``Qwen3NextForCausalLM``: q/k/v/z and b/a projections fused per key head) or ``"qwen3_5"``
(``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``: separate projections); flavors of Qwen3.5 are in
``ftitan.models.qwen3_5``. Logits match transformers to float32 rounding.

Generation: attention layers use the KV cache, Gated DeltaNet layers keep a recurrent state in the same
cache (``cache.recur``: the conv's last ``K - 1`` inputs and the delta-rule state per layer,
``ftitan.infer.init_cache`` sizes both); prefill runs the chunked rule, decode the recurrent one.
Parallel: FSDP / DDP, tensor parallel (attention heads, key-head groups of the linear attention, MLP
and expert widths over ``tp``), expert parallel; packed documents (``segments``: the conv and the state
restart at each document). Not supported (a clear error): context parallelism for the linear-attention
layers.

Params tree (a linear-attention layer of the ``qwen3_5`` layout; ``qwen3_next`` has ``wqkvz``
(Hk*(W + r*Dv), D) and ``wba`` (Hk*2r, D) instead of ``wqkv``, ``wz``, ``wb``, ``wa``; ``W = 2 Dk + r Dv``,
``r = Hv / Hk``; rows grouped per key head: ``[q_h, k_h, v of its r value heads (, z of them)]``)::

    {"embed": (V, D),
     "layers": {"0": {"attn_norm": (D,),
                      "gdn": {"wqkv": (Hk*W, D), "wz": (Hv*Dv, D), "wb": (Hv, D), "wa": (Hv, D),
                              "conv": (Hk*W, K), "A_log": (Hv,), "dt_bias": (Hv,), "norm": (Dv,),
                              "wo": (D, Hv*Dv)},
                      "mlp_norm": (D,),
                      "mlp": {"w1": (F, D), "w2": (D, F), "w3": (F, D)}},
                "3": {"attn_norm": (D,),
                      "attn": {"wq": (H*2*Dh, D), "wk": (KV*Dh, D), "wv": (KV*Dh, D), "wo": (D, H*Dh),
                               "q_norm": (Dh,), "k_norm": (Dh,)},
                      "mlp_norm": (D,),
                      "moe": {"router": (E, D), "experts": {"w1": (E, Fe, D), ...},   # an MoE layer
                              "shared": {"w1": (S, D), "w2": (D, S), "w3": (S, D)}, "shared_gate": (1, D)}},
                ...},
     "norm": (D,),
     "head": (V, D)}            # absent when tie_embeddings
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import torch

from ftitan import nn, tree
from ftitan.models import base, decoder, qwen3
from ftitan.models.base import Model
from ftitan.nn import gdn, invariant
from ftitan.nn.attention import Attend, AttentionImpl
from ftitan.nn.moe import MoEConfig
from ftitan.nn.param import Param, block_shape, zeros_init
from ftitan.parallel import activations as par
from ftitan.parallel import expert
from ftitan.parallel.layout import current

__all__ = ["FLAVORS", "Config", "active_params", "flops_per_token", "model", "param_specs"]

Variant = Literal["qwen3_next", "qwen3_5"]


def _layers(value: Sequence[int]) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"qwen3_next.Config.dense_layers={value!r}: expected a sequence of int layer indices")
    return tuple(sorted(value))


@attrs.frozen(kw_only=True)
class Config:
    """A Qwen3-Next / Qwen3.5 hybrid decoder. Published sizes: ``FLAVORS`` here and in ``qwen3_5``."""

    vocab_size: int  # V
    dim: int  # D: residual stream width (HF hidden_size)
    n_layers: int  # L
    n_heads: int  # H: query heads of the full-attention layers
    n_kv_heads: int  # KV: their key/value heads
    head_dim: int  # Dh: width of a full-attention head
    ffn_dim: int  # F: SwiGLU width of the dense feed-forwards (HF intermediate_size)
    linear_k_heads: int  # Hk: key heads of the linear attention (HF linear_num_key_heads)
    linear_v_heads: int  # Hv: its value heads, a multiple of Hk (HF linear_num_value_heads)
    linear_k_dim: int  # Dk: width of a linear-attention key head (HF linear_key_head_dim)
    linear_v_dim: int  # Dv: width of a value head (HF linear_value_head_dim)
    conv_kernel: int = 4  # K: taps of the causal depthwise conv (HF linear_conv_kernel_dim)
    attention_every: int = 4  # layer i is full attention when (i + 1) % attention_every == 0, else linear
    partial_rotary: float = 0.25  # share of each attention head's dims that RoPE rotates (the first ones)
    n_experts: int = 0  # E: routed experts per MoE layer; 0: every feed-forward is a dense SwiGLU
    top_k: int = 1  # experts per token
    expert_dim: int = 1  # Fe: SwiGLU width of one expert (HF moe_intermediate_size)
    shared_expert_dim: int = 0  # S: width of the sigmoid-gated shared expert; 0: none
    dense_layers: tuple[int, ...] = attrs.field(default=(), converter=_layers)  # MoE models' dense layers
    norm_topk: bool = True  # renormalize the top-k routing weights (HF norm_topk_prob)
    aux_loss_coef: float = 0.001  # weight of the Switch balancing loss (HF router_aux_loss_coef)
    variant: Variant = "qwen3_next"  # checkpoint layout: "qwen3_next" (fused projections) or "qwen3_5"
    norm_eps: float = 1e-6  # every RMSNorm (residual, QK-norm, gated head norm)
    rope_theta: float = 10_000_000.0  # RoPE base
    max_seq_len: int = 262_144  # HF max_position_embeddings
    tie_embeddings: bool = False  # output head reuses the embedding table
    attn_impl: AttentionImpl = "sdpa"  # nn.attention's, but batch_invariant: the full-attention layers'
    kernels: str = "torch"  # "torch", "triton" or "helion" (ftitan.kernels on CUDA, their references elsewhere)
    remat: str = "none"  # activation rematerialization of each block (ftitan.config.with_remat): "none", "full", ...
    chunk: int = 64  # tokens per chunk of the chunked delta rule (training, prefill)
    init_std: float = 0.02  # std of the normal init; residual outputs get init_std / sqrt(2L)

    def __attrs_post_init__(self) -> None:
        qwen3.check_config(self, "qwen3_next")
        for name in ("ffn_dim", "linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim", "conv_kernel",
                     "attention_every", "top_k", "expert_dim", "chunk"):  # fmt: skip
            decoder.check_positive_int(self, "qwen3_next", name)
        if self.linear_v_heads % self.linear_k_heads:
            raise ValueError(f"qwen3_next.Config: linear_v_heads={self.linear_v_heads} must be a multiple of "
                             f"linear_k_heads={self.linear_k_heads} (each key head serves a group of value heads)")
        if self.rope_dim < 2 or self.rope_dim % 2 or not 0 < self.partial_rotary <= 1:
            raise ValueError(f"qwen3_next.Config.partial_rotary={self.partial_rotary}: must give an even number "
                             f">= 2 of rotated dims of head_dim={self.head_dim} (got {self.rope_dim})")
        if invariant.enabled(self):
            raise ValueError("qwen3_next.Config.attn_impl='batch_invariant': the batch-invariant mode is not "
                             "implemented for the Gated DeltaNet layers; use 'sdpa' or 'math'")  # fmt: skip
        if self.variant not in ("qwen3_next", "qwen3_5"):
            raise ValueError(f"qwen3_next.Config.variant={self.variant!r}: expected 'qwen3_next' or 'qwen3_5'")
        if self.n_experts < 0 or self.shared_expert_dim < 0 or not self.aux_loss_coef >= 0:
            raise ValueError("qwen3_next.Config: n_experts, shared_expert_dim and aux_loss_coef must be >= 0")
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"qwen3_next.Config: top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if bad := [i for i in self.dense_layers if not 0 <= i < self.n_layers]:
            raise ValueError(f"qwen3_next.Config.dense_layers: {bad} outside [0, {self.n_layers})")

    @property
    def rope_dim(self) -> int:
        """Rotated dims of a full-attention head (HF ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.partial_rotary)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers (the rest are linear attention)."""
        return tuple(i for i in range(self.n_layers) if (i + 1) % self.attention_every == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers with an MoE feed-forward (none when ``n_experts`` is 0)."""
        return tuple(i for i in range(self.n_layers) if self.n_experts and i not in self.dense_layers)

    @property
    def moe(self) -> MoEConfig:
        """The routed experts' config (the gated shared expert is applied by the family)."""
        return MoEConfig(
            n_experts=max(self.n_experts, self.top_k), top_k=self.top_k, expert_dim=self.expert_dim,
            score_func="softmax", norm_topk=self.norm_topk, aux_loss_coef=self.aux_loss_coef, kernels=self.kernels,
        )  # fmt: skip

    @property
    def group_width(self) -> int:
        """``W = 2 Dk + r Dv``: conv channels per key head (its q, k and the v of its ``r`` value heads)."""
        return 2 * self.linear_k_dim + self.linear_v_heads // self.linear_k_heads * self.linear_v_dim

    @classmethod
    def debug(cls) -> Config:
        """Tiny Qwen3-Next (8 experts top 2 + shared expert, 4 layers: 3 linear + 1 full attention)."""
        return cls(
            vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
            linear_k_heads=2, linear_v_heads=4, linear_k_dim=32, linear_v_dim=32, n_experts=8, top_k=2,
            expert_dim=128, shared_expert_dim=128, max_seq_len=4096,
        )  # fmt: skip

    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json on the HF hub (-Thinking: the same architecture)
    @classmethod
    def qwen3_next_80b_a3b(cls) -> Config:
        """Qwen3-Next-80B-A3B: 48 layers (36 Gated DeltaNet + 12 gated attention), 512 experts top 10 + shared."""
        return cls(
            vocab_size=151_936, dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256, ffn_dim=5120,
            linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128, n_experts=512, top_k=10,
            expert_dim=512, shared_expert_dim=512,
        )  # fmt: skip


FLAVORS = {"debug": Config.debug, "qwen3_next_80b_a3b": Config.qwen3_next_80b_a3b}


# ---------------------------------------------------------------- params


def _zero_centered(dim: int) -> Param:
    """A ``(dim,)`` norm scale stored as ``w`` of ``1 + w`` (initialized to 0, as HF's zero-centered norms)."""
    return Param(shape=(dim,), axes=nn.NORM_AXES, init=zeros_init)


def _a_log_init(key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: Any, *, block: Any = None
                ) -> torch.Tensor:  # fmt: skip
    """``log(A)`` with the heads' decay rates ``A`` spread evenly over [1, 16] (Mamba-2's range)."""
    size = block_shape(shape, block)
    if str(device) == "meta":
        return torch.empty(size, dtype=dtype, device="meta")
    full = torch.linspace(1.0, 16.0, shape[0]).log()
    lo = block[0][0] if block else 0
    return full[lo : lo + size[0]].to(dtype=dtype, device=device)


def _gdn_params(cfg: Config) -> dict[str, Param]:
    d, hk, hv, dv, std = cfg.dim, cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_v_dim, cfg.init_std
    r, w = hv // hk, cfg.group_width
    if cfg.variant == "qwen3_next":
        proj = {"wqkvz": nn.linear_param(d, hk * (w + r * dv), axes=("kv_heads", "embed"), std=std),
                "wba": nn.linear_param(d, hk * 2 * r, axes=("kv_heads", "embed"), std=std)}  # fmt: skip
    else:
        proj = {"wqkv": nn.linear_param(d, hk * w, axes=("kv_heads", "embed"), std=std),
                "wz": nn.linear_param(d, hv * dv, axes=("heads", "embed"), std=std),
                "wb": nn.linear_param(d, hv, axes=("heads", "embed"), std=std),
                "wa": nn.linear_param(d, hv, axes=("heads", "embed"), std=std)}  # fmt: skip
    return {
        **proj,
        "conv": Param(shape=(hk * w, cfg.conv_kernel), axes=("kv_heads", None),
                      init=nn.normal_init((3 * cfg.conv_kernel) ** -0.5)),  # fmt: skip  (Conv1d's variance)
        "A_log": Param(shape=(hv,), axes=("heads",), init=_a_log_init),
        "dt_bias": Param(shape=(hv,), axes=("heads",), init=nn.ones_init),
        "norm": nn.norm_param(dv),
        "wo": nn.linear_param(hv * dv, d, axes=("embed", "heads"), std=decoder.residual_std(cfg)),
    }


def _attention_params(cfg: Config) -> dict[str, Param]:
    d, h, kv, dh, std = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.init_std
    return {
        "wq": nn.linear_param(d, h * 2 * dh, axes=("heads", "embed"), std=std),  # per head: query, then gate
        "wk": nn.linear_param(d, kv * dh, axes=("kv_heads", "embed"), std=std),
        "wv": nn.linear_param(d, kv * dh, axes=("kv_heads", "embed"), std=std),
        "wo": nn.linear_param(h * dh, d, axes=("embed", "heads"), std=decoder.residual_std(cfg)),
        "q_norm": _zero_centered(dh),
        "k_norm": _zero_centered(dh),
    }


def param_specs(cfg: Config) -> dict[str, Any]:
    """Tree of ``nn.Param`` specs (shape, logical axes, init) shaped like the params."""
    std, out_std = cfg.init_std, decoder.residual_std(cfg)

    def layer(i: int) -> dict[str, Any]:
        mixer = {"attn": _attention_params(cfg)} if i in cfg.attention_layers else {"gdn": _gdn_params(cfg)}
        if i in cfg.moe_layers:
            moe = nn.moe_params(cfg.dim, cfg.moe, std=std, out_std=out_std)
            if cfg.shared_expert_dim:
                moe["shared"] = nn.swiglu_params(cfg.dim, cfg.shared_expert_dim, std=std, out_std=out_std)
                moe["shared_gate"] = nn.linear_param(cfg.dim, 1, axes=(None, "embed"), std=std)
            ffn = {"moe": moe}
        else:
            ffn = {"mlp": nn.swiglu_params(cfg.dim, cfg.ffn_dim, std=std, out_std=out_std)}
        return {"attn_norm": _zero_centered(cfg.dim), **mixer, "mlp_norm": _zero_centered(cfg.dim), **ffn}

    return {
        "embed": nn.embed_param(cfg.vocab_size, cfg.dim, std=std),
        "layers": {str(i): layer(i) for i in range(cfg.n_layers)},
        "norm": _zero_centered(cfg.dim),
        **decoder.head_params(cfg),
    }


def active_params(cfg: Config) -> int:
    """Parameters one token uses: all but the ``E - top_k`` unchosen experts of every MoE layer (embedding
    and head included, as Qwen's headline counts)."""
    total = sum(math.prod(spec.shape) for spec in tree.leaves(param_specs(cfg)))
    return total - len(cfg.moe_layers) * (cfg.n_experts - cfg.top_k) * 3 * cfg.dim * cfg.expert_dim


def flops_per_token(cfg: Config, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N_active matmul weights`` + the token mixers' own terms.

    Full attention adds ``6 * T * H * Dh`` per layer (causal half of 12). A Gated DeltaNet layer's
    chunked rule costs per token and value head about ``2 * C * (Dk + Dv)`` forward inside its chunk
    (scores and writes, ``C`` = ``chunk``) plus ``4 * Dk * Dv`` for the state's read and write: times 3
    for forward + backward. The conv, norms, gates and routing are not counted.
    """
    attn_layers = len(cfg.attention_layers)
    linear_layers = cfg.n_layers - attn_layers
    paths, specs, _ = tree.flatten_with_paths(param_specs(cfg))
    matmul = sum(math.prod(spec.shape) for path, spec in zip(paths, specs, strict=True)
                 if len(spec.shape) >= 2 and path != "embed" and not path.endswith(".conv"))  # fmt: skip
    if cfg.tie_embeddings:
        matmul += cfg.vocab_size * cfg.dim
    inactive = len(cfg.moe_layers) * (cfg.n_experts - cfg.top_k) * 3 * cfg.dim * cfg.expert_dim
    hv, dk, dv = cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    mixers = attn_layers * 6 * seq_len * cfg.n_heads * cfg.head_dim
    mixers += linear_layers * 3 * hv * (2 * min(cfg.chunk, seq_len) * (dk + dv) + 4 * dk * dv)
    return float(6 * (matmul - inactive) + mixers)


# ---------------------------------------------------------------- forward


def _norm(cfg: Config, h: torch.Tensor, w: torch.Tensor, logical: str = "norm_seq") -> torch.Tensor:
    """Zero-centered RMSNorm: ``(1 + w) * rms_norm(h)`` (``w`` shared over the tp axes of ``logical``), scaled in
    float32 and then cast, as HF (in bf16, ``1 + w`` would round a small ``w`` away)."""
    x = h.to(torch.promote_types(h.dtype, torch.float32))
    if cfg.kernels != "torch":  # the same function: an rms_norm of float32 x with scale 1 + w
        return nn.rms_norm(x, 1 + par.tp_shared(w, logical).to(x.dtype), cfg.norm_eps, kernels=cfg.kernels).to(h.dtype)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    return (normed * (1 + par.tp_shared(w, logical).to(x.dtype))).to(h.dtype)


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, kernels: str = "torch") -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head (B, T, H, Dh), the rest passed through."""
    r = cos.shape[-1]
    return torch.cat([nn.apply_rope(x[..., :r], cos, sin, kernels=kernels), x[..., r:]], dim=-1)


def _attention(cfg: Config, p: Mapping[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attend: Attend) -> torch.Tensor:  # fmt: skip
    """Gated full attention: zero-centered QK-norm, partial RoPE, causal GQA, output times ``sigmoid(gate)``."""
    x = par.column_input(x)
    b, t, _ = x.shape
    if "wqkv" in p:  # one matmul for q (with its gate), k, v (ftitan.infer.fuse_projections; one process)
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        sizes = (2 * cfg.n_heads * cfg.head_dim, kv_dim, kv_dim)
        qg, k, v = nn.linear(x, p["wqkv"], kernels=cfg.kernels).split(sizes, dim=-1)
    else:
        qg, k, v = (nn.linear(x, p[n], kernels=cfg.kernels) for n in ("wq", "wk", "wv"))
    q, gate = qg.reshape(b, t, -1, 2 * cfg.head_dim).chunk(2, dim=-1)
    k, v = (y.reshape(b, t, -1, cfg.head_dim) for y in (k, v))
    q, k = _norm(cfg, q, p["q_norm"], "heads"), _norm(cfg, k, p["k_norm"], "kv_heads")
    q, k = _partial_rope(q, cos, sin, kernels=cfg.kernels), _partial_rope(k, cos, sin, kernels=cfg.kernels)
    o = attend(q, k, v, impl=cfg.attn_impl, causal=True, scale=cfg.head_dim**-0.5)
    o = o * torch.sigmoid(gate)  # the output gate of each head
    return par.row_output(nn.linear(o.reshape(b, t, -1), p["wo"], kernels=cfg.kernels))


def _projections(cfg: Config, p: Mapping[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(mixed (B, T, hk*W) conv input grouped per key head, z (B, T, hv, Dv), b, a (B, T, hv))`` for this
    rank's ``hk`` key heads and ``hv`` value heads."""
    bsz, t, _ = x.shape
    r, dv, w = cfg.linear_v_heads // cfg.linear_k_heads, cfg.linear_v_dim, cfg.group_width

    def proj(name: str) -> torch.Tensor:
        return nn.linear(x, p[name], kernels=cfg.kernels)

    if "wqkvz" in p:  # Qwen3-Next: per key head [q, k, v, z] and [b, a]
        y = proj("wqkvz").reshape(bsz, t, -1, w + r * dv)
        mixed, z = y[..., :w].reshape(bsz, t, -1), y[..., w:].reshape(bsz, t, -1, dv)
        b, a = proj("wba").reshape(bsz, t, -1, 2 * r).split(r, dim=-1)
        return mixed, z, b.reshape(bsz, t, -1), a.reshape(bsz, t, -1)
    z = proj("wz").reshape(bsz, t, -1, dv)
    return proj("wqkv"), z, proj("wb"), proj("wa")


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """``F.softplus`` (threshold 20) from exp/log1p: aot_autograd traced ``softplus_backward`` of a transposed
    cotangent with other strides than it ran with (a later view failed)."""
    return torch.where(x > 20, x, x.clamp(max=20).exp().log1p())


def _gdn_scan(cfg: Config, conv: torch.Tensor) -> decoder.Scan:
    """The stateful part of a Gated DeltaNet layer (``cache.recur``'s scan): conv over ``mixed``, then the
    gated delta rule; state ``{"conv": (B, K - 1, hk*W), "ssm": (B, hv, Dk, Dv) float32}``."""
    dk, dv = cfg.linear_k_dim, cfg.linear_v_dim

    def scan(inputs: tuple[Any, ...], state: Any, valid: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        mixed, g, beta, segments = inputs  # (B, T, C), (B, T, hv), (B, T, hv), (B, T) int | None
        stop = None
        if valid is not None:  # padding: no conv input, no decay, no write
            mixed, g, beta = mixed * valid[..., None], g * valid[..., None], beta * valid[..., None]
            stop = (valid * torch.arange(1, valid.shape[1] + 1, device=valid.device)).amax(dim=1)
        y, conv_state = gdn.causal_conv(mixed, conv, None if state is None else state["conv"], stop=stop,
                                        segments=segments)  # fmt: skip
        bsz, t, _ = y.shape
        y = y.reshape(bsz, t, -1, cfg.group_width)
        q, k, v = y[..., :dk], y[..., dk : 2 * dk], y[..., 2 * dk :].reshape(bsz, t, -1, dv)
        o, ssm = gdn.delta_rule(q, k, v, g, beta, None if state is None else state["ssm"], chunk=cfg.chunk,
                                segments=segments, kernels=cfg.kernels)  # fmt: skip
        return o, {"conv": conv_state, "ssm": ssm}

    return scan


def _gated_deltanet(cfg: Config, p: Mapping[str, torch.Tensor], x: torch.Tensor, attend: Attend,
                    segments: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """A Gated DeltaNet layer (module docstring) of ``x`` (B, T, D) normed; state through ``attend``'s cache;
    ``segments`` (B, T) (packed documents): conv and state restart at each document."""
    layout = current()
    if layout is not None and layout.sizes["cp"] > 1:
        raise ValueError("qwen3_next: Gated DeltaNet layers are recurrent over the whole sequence; context "
                         "parallelism (cp > 1) would split it; use cp=1")  # fmt: skip
    x = par.column_input(x)
    bsz, t, _ = x.shape
    mixed, z, b, a = _projections(cfg, p, x)
    beta = torch.sigmoid(b)
    f = torch.promote_types(a.dtype, torch.float32)  # float32 decays (float64 kept)
    g = -p["A_log"].to(f).exp() * _softplus(a.to(f) + p["dt_bias"])
    o = decoder.recur(attend, _gdn_scan(cfg, p["conv"]), (mixed, g, beta, segments))
    o = gdn.gated_rms_norm(o, z, par.tp_shared(p["norm"], "heads"), cfg.norm_eps)
    return par.row_output(nn.linear(o.reshape(bsz, t, -1), p["wo"], kernels=cfg.kernels))


def _feed_forward(cfg: Config, moe_cfg: MoEConfig, p: Mapping[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """SwiGLU, or routed experts + ``sigmoid(x @ shared_gate) * shared(x)`` (x: (B, T, D) normed)."""
    if "mlp" in p:
        return decoder.mlp(x, p["mlp"], kernels=cfg.kernels), None
    y, stats = expert.moe(x, p["moe"], moe_cfg)
    if "shared" in p["moe"]:
        gate = torch.sigmoid(nn.linear(x, par.tp_shared(p["moe"]["shared_gate"], "norm_seq")))
        y = y + gate * decoder.mlp(x, p["moe"]["shared"], kernels=cfg.kernels)
    return y, stats


def _stage(
    cfg: Config,
    moe_cfg: MoEConfig,  # cfg.moe, built once outside: dynamo cannot trace a frozen attrs __init__
    params: Mapping[str, Any],  # this stage's subtree
    x: torch.Tensor,  # (B, T) int tokens if first, else (B, T, D) hidden from the previous stage
    *,
    layers: range,
    first: bool,
    last: bool,
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int; default arange(T)
    cache: Any = None,
    segments: torch.Tensor | None = None,
) -> base.StageOut:  # h (B, T, D), {layer: MoEStats}, cache
    """Embed (``first``), blocks ``layers``, final norm (``last``): ``apply``'s layer loop and a pipeline stage."""
    pos = decoder.stage_positions(x, positions, first=first, family="qwen3_next", segments=segments)
    inv_freq = nn.rope_inv_freq(cfg.rope_dim, cfg.rope_theta, None, device=pos.device)
    cos, sin = nn.rope_cos_sin(pos, inv_freq)

    def block(i: int, p: Mapping[str, Any], h: torch.Tensor, attend: Attend) -> tuple[torch.Tensor, Any]:
        x = _norm(cfg, h, p["attn_norm"])
        h = h + (_attention(cfg, p["attn"], x, cos, sin, attend) if "attn" in p
                 else _gated_deltanet(cfg, p["gdn"], x, attend, segments))  # fmt: skip
        y, stats = _feed_forward(cfg, moe_cfg, p, _norm(cfg, h, p["mlp_norm"]))
        return h + y, stats

    return decoder.run_stage(cfg, params, x, block, layers=layers, first=first, last=last, cache=cache,
                             segments=segments, final_norm=_norm)  # fmt: skip


def _apply_with_aux(
    cfg: Config,
    moe_cfg: MoEConfig,
    params: Mapping[str, Any],
    tokens: torch.Tensor,  # (B, T) int
    *,
    positions: torch.Tensor | None = None,
    cache: Any = None,
    segments: torch.Tensor | None = None,
    logits: bool = True,
) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor]]:  # (B, T, V) | (B, T, D); cache; aux
    h, stats, cache = _stage(cfg, moe_cfg, params, tokens, layers=range(cfg.n_layers), first=True, last=True,
                             positions=positions, cache=cache, segments=segments)  # fmt: skip
    out = decoder.logits_of(h, decoder.output_head(cfg, params), kernels=cfg.kernels) if logits else h
    aux = expert.moe_aux(list(stats.values()), moe_cfg) if stats else {}
    return out, cache, aux


def model(cfg: Config) -> Model:
    """The ``Model`` for ``cfg`` (``apply_with_aux`` returns the router aux dict of MoE configs)."""
    specs = param_specs(cfg)
    apply_with_aux = functools.partial(_apply_with_aux, cfg, cfg.moe)
    return Model(
        config=cfg,
        init=functools.partial(nn.init, specs),
        apply=base.drop_aux(apply_with_aux),
        head=functools.partial(decoder.output_head, cfg),
        param_axes=nn.axes(specs),
        flops_per_token=functools.partial(flops_per_token, cfg),
        apply_with_aux=apply_with_aux if cfg.moe_layers else None,
        stage=functools.partial(_stage, cfg, cfg.moe),
    )


from ftitan.models import qwen3_next_hf  # noqa: E402, F401  (registers the HF checkpoint families)
