"""DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report") as pure functions; Kimi K2 and Moonlight too.

Pre-norm decoder, ``h += mla(rms_norm(h))``, ``h += ffn(rms_norm(h))``:

- **attention**: Multi-head Latent Attention (DeepSeek-V2, DeepSeek-AI 2024),
  see ``ftitan.nn.mla``: low-rank queries and a compressed key/value latent
  with a decoupled, head-shared RoPE key; YaRN context extension (Peng et
  al. 2023) with DeepSeek's softmax mscale.
- **feed-forward**: the first ``n_dense_layers`` blocks use a dense SwiGLU
  (``ffn_dim``); the rest a mixture of experts (``ftitan.nn.moe``):
  ``n_experts`` routed SwiGLU experts of width ``moe_ffn_dim``, ``top_k``
  per token, sigmoid scores, group-limited selection (``n_groups`` /
  ``topk_groups``), weights renormalized and scaled by ``routed_scale``,
  plus ``n_shared_experts`` every token passes through.
- **auxiliary-loss-free balancing** (sec. 2.1.2 of the report): a per-expert
  ``router_bias`` added to the scores for selection only. It is state, not a
  weight: ``Model.frozen`` keeps optimizers off it and
  ``Model.update_buffers`` moves it by ``bias_update_rate * sign(mean_load -
  load)`` after each step, from the step's ``"moe.tokens_per_expert"``.

The same architecture with other sizes is Moonlight-16B-A3B (Liu et al.
2025, "Muon is Scalable for LLM Training"), Kimi K2 (Kimi Team 2025, "Kimi
K2: Open Agentic Intelligence") and Kimi K2.5's text decoder; HF ships all
of them as ``DeepseekV3ForCausalLM``. Logits match
``transformers.DeepseekV3ForCausalLM`` to float32 rounding; HF checkpoints
load by renaming, plus stacking the per-expert tensors (see ``hf_weights``).
Kimi K2.6 and K2.7 (-Code) keep K2.5's text decoder (TorchTitan's
``kimi_k2_7`` builds all three from one config).

Multi-token prediction (sec. 2.2 of the report): with ``n_mtp_layers > 0``
the params gain ``"mtp"`` (see ``ftitan.models.mtp``); ``apply_with_aux``
adds ``mtp_loss_weight`` times their mean cross-entropy to ``aux["loss"]``,
and ``ftitan.infer.speculative`` drafts tokens with them. HF checkpoints
keep them as layer ``n_layers`` (+ j), which ``transformers`` drops;
``mtp.load_hf`` imports them.

Parallel (``ftitan.parallel``): FSDP / DDP, tensor and sequence parallel
(MLA heads, expert and MLP widths, vocab over ``tp``; the small latent
projections replicated), context parallel, and expert parallel (routed
experts over ``ep``, ``ftitan.parallel.expert``). The balancing loss and
the router load (hence ``update_buffers``' bias step) are those of the
global batch, the same on every rank.

>>> import torch, ftitan as ft
>>> from ftitan.models import deepseek_v3
>>> m = deepseek_v3.model(deepseek_v3.Config.debug())
>>> params = m.init(ft.random.key(0))
>>> logits, _ = m.apply(params, torch.zeros(2, 16, dtype=torch.long))
>>> logits.shape
torch.Size([2, 16, 2048])

Params tree::

    {"embed": (V, D),
     "layers": {"0": {"attn_norm": (D,), "attn": {MLA params, see nn.mla}, "mlp_norm": (D,),
                      "mlp": {"w1": (F, D), "w2": (D, F), "w3": (F, D)}},          # i < n_dense_layers
                "3": {"attn_norm": (D,), "attn": {...}, "mlp_norm": (D,),
                      "moe": {"router": (E, D), "router_bias": (E,) float32,
                              "experts": {"w1": (E, Fe, D), "w2": (E, D, Fe), "w3": (E, Fe, D)},
                              "shared": {"w1": (S, D), "w2": (D, S), "w3": (S, D)}}},   # S = n_shared * Fe
                ...},
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
from ftitan.models import base, decoder, hf, mtp
from ftitan.models.base import Model, drop_aux
from ftitan.nn import mla as mla_
from ftitan.nn import moe as moe_
from ftitan.nn.attention import Attend, AttentionImpl
from ftitan.nn.rope import YarnRopeScaling
from ftitan.parallel import activations as par
from ftitan.parallel import expert

__all__ = [
    "FLAVORS",
    "FROZEN",
    "Config",
    "YarnRopeScaling",
    "config_from_hf",
    "config_to_hf",
    "flops_per_token",
    "hf_weights",
    "model",
    "mtp_module",
    "param_counts",
    "param_specs",
    "update_router_bias",
]

FROZEN = ("layers.*.moe.router_bias",)  # state updated by update_buffers, never by the optimizer


@attrs.frozen(kw_only=True)
class Config:
    """DeepSeek-V3 architecture. Published sizes: ``Config.deepseek_v3_671b()`` etc., see ``FLAVORS``.

    Flavor docstrings give ``param_counts``: total, and active per token
    without the embedding lookup (the convention of DeepSeek's "37B activated").
    """

    vocab_size: int  # V: rows of the embedding / output head
    dim: int  # D: model (residual stream) width (HF hidden_size)
    n_layers: int  # L: decoder blocks (MTP modules not included)
    n_heads: int  # H: attention heads
    q_lora_rank: int | None  # Rq: query latent width; None: one full (H*(Dn+Dr), D) wq (Moonlight, V2-Lite)
    kv_lora_rank: int  # Rkv: compressed key/value latent width
    qk_nope_head_dim: int = 128  # Dn: per-head q/k dims without position
    qk_rope_head_dim: int = 64  # Dr: q/k dims with RoPE (the key's are shared by all heads)
    v_head_dim: int = 128  # Dv: per-head value width
    ffn_dim: int  # F: SwiGLU width of the dense blocks (HF intermediate_size)
    n_dense_layers: int  # the first n blocks use the dense SwiGLU, the rest MoE (HF first_k_dense_replace)
    n_experts: int  # E: routed experts per MoE block (HF n_routed_experts)
    top_k: int  # routed experts per token (HF num_experts_per_tok)
    moe_ffn_dim: int  # Fe: SwiGLU width of one expert (HF moe_intermediate_size)
    n_shared_experts: int = 1  # experts every token passes through, fused into one SwiGLU of width n*Fe
    score_func: str = "sigmoid"  # "sigmoid" (V3, Kimi, Moonlight) or "softmax" (V2-Lite / TorchTitan 16B)
    norm_topk: bool = True  # renormalize the top_k weights to sum to 1 (HF norm_topk_prob)
    n_groups: int = 1  # expert groups for group-limited routing (HF n_group)
    topk_groups: int = 1  # groups a token may pick its experts from (HF topk_group)
    routed_scale: float = 1.0  # multiplies the routed experts' weights (HF routed_scaling_factor)
    bias_update_rate: float = 1e-3  # step of the balancing-bias update (the report's gamma)
    aux_loss_coef: float = 0.0  # weight of a batch-wise Switch balancing loss; 0: the bias alone balances
    norm_eps: float = 1e-6  # RMSNorm epsilon of the block and final norms (HF rms_norm_eps)
    latent_norm_eps: float = 1e-6  # epsilon of MLA's q/kv latent norms (hard-coded 1e-6 by DeepSeek and HF)
    rope_theta: float = 10_000.0  # RoPE base
    rope_scaling: YarnRopeScaling | None = None  # YaRN context extension, or None
    rope_interleave: bool = True  # rope dims stored as interleaved pairs, as in every DeepSeek/Kimi checkpoint
    max_seq_len: int = 4096  # longest sequence the model is meant for (HF max_position_embeddings)
    # "sdpa", "math" (explicit fp32 softmax), "batch_invariant" (all ops, nn.invariant), "flex" (FlexAttention,
    # SDPA with the same mask where it cannot run), "gemm" (causal query blocks as GEMMs on the CPU, else sdpa),
    # "auto" (flex on CUDA under torch.compile, gemm on the CPU, else sdpa)
    attn_impl: AttentionImpl = "sdpa"
    kernels: str = "torch"  # "torch", "triton" or "helion" (ftitan.kernels on CUDA, their references elsewhere)
    float8: str = ""  # "tensorwise" / "rowwise": the blocks' projections in float8 (torchao's recipes, nn.float8)
    float8_experts: bool = False  # the routed experts' grouped GEMMs in float8 (torchao's rowwise MoE recipe)
    remat: str = "none"  # activation rematerialization of each block (ftitan.config.with_remat): "none", "full", ...
    init_std: float = 0.02  # std of the (truncated) normal init; residual outputs wo/w2 get init_std/sqrt(2L)
    n_mtp_layers: int = 0  # D: multi-token-prediction modules (HF num_nextn_predict_layers; V3 ships 1)
    mtp_loss_weight: float = 0.3  # lambda: the MTP loss is lambda / D * sum_k CE_k (0.3, then 0.1 in the report)

    def __attrs_post_init__(self) -> None:
        check_kernels(self.kernels, "deepseek_v3.Config.kernels")
        ints = ("vocab_size", "dim", "n_layers", "n_heads", "kv_lora_rank", "ffn_dim", "n_experts", "top_k",
                "moe_ffn_dim", "max_seq_len")  # fmt: skip
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"deepseek_v3.Config.{name}={value!r}: must be a positive int")
        if not isinstance(self.n_dense_layers, int) or not 0 <= self.n_dense_layers < self.n_layers:
            raise ValueError(
                f"deepseek_v3.Config.n_dense_layers={self.n_dense_layers!r}: must be an int in [0, n_layers="
                f"{self.n_layers}); for a model without MoE blocks use ftitan.models.llama"
            )
        if not isinstance(self.n_mtp_layers, int) or isinstance(self.n_mtp_layers, bool) or self.n_mtp_layers < 0:
            raise ValueError(f"deepseek_v3.Config.n_mtp_layers={self.n_mtp_layers!r}: must be an int >= 0")
        if not 0 <= self.mtp_loss_weight < math.inf:
            raise ValueError(f"deepseek_v3.Config.mtp_loss_weight={self.mtp_loss_weight!r}: must be finite and >= 0")
        for name in ("norm_eps", "init_std"):
            if not 0 < getattr(self, name) < math.inf:  # inf passes `> 0`, then breaks init or the norms
                raise ValueError(f"deepseek_v3.Config.{name}={getattr(self, name)!r}: must be a finite number > 0")
        for build in (lambda: self.mla, lambda: self.moe):  # the layers validate their own fields
            try:
                build()
            except ValueError as e:
                raise ValueError(f"deepseek_v3.Config: {e}") from None
        widths = {"dim": self.dim, "ffn_dim": self.ffn_dim,
                  "q": self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim),
                  "kv_a": self.kv_lora_rank + self.qk_rope_head_dim,
                  "kv_b": self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), "o": self.n_heads * self.v_head_dim}
        if self.q_lora_rank is not None:
            widths["q_lora_rank"] = self.q_lora_rank
        if self.n_shared_experts:
            widths["shared"] = self.n_shared_experts * self.moe_ffn_dim  # the shared experts' fused SwiGLU
        nn.float8.check_config(self, "deepseek_v3", widths)  # fmt: skip
        nn.float8.check_experts(self, "deepseek_v3", {"dim": self.dim, "moe_ffn_dim": self.moe_ffn_dim})

    @property
    def mla(self) -> mla_.MLAConfig:
        return mla_.MLAConfig(
            n_heads=self.n_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            rope_interleave=self.rope_interleave, latent_norm_eps=self.latent_norm_eps, attn_impl=self.attn_impl,
            kernels=self.kernels, float8=self.float8,
        )  # fmt: skip

    @property
    def moe(self) -> moe_.MoEConfig:
        return moe_.MoEConfig(
            n_experts=self.n_experts, top_k=self.top_k, expert_dim=self.moe_ffn_dim,
            n_shared_experts=self.n_shared_experts, score_func=self.score_func, norm_topk=self.norm_topk,
            n_groups=self.n_groups, topk_groups=self.topk_groups, routed_scale=self.routed_scale, score_bias=True,
            aux_loss_coef=self.aux_loss_coef, bias_update_rate=self.bias_update_rate,
            batch_invariant=self.attn_impl == "batch_invariant", kernels=self.kernels, float8=self.float8,
            float8_experts=self.float8_experts,
        )  # fmt: skip

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @classmethod
    def debug(cls) -> Config:
        """Tiny model that trains on 2 CPU cores: 3 blocks (the first dense), 8 experts top-2 in 2 groups."""
        return cls(
            vocab_size=2048, dim=256, n_layers=3, n_heads=4, q_lora_rank=96, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, ffn_dim=512, n_dense_layers=1,
            n_experts=8, top_k=2, moe_ffn_dim=128, n_groups=2, topk_groups=1, routed_scale=2.5, max_seq_len=2048,
        )  # fmt: skip

    # Published hyperparameters: each checkpoint's HF config.json (sources at each flavor).
    @classmethod
    def deepseek_v3_671b(cls) -> Config:
        """DeepSeek-V3 / R1 (deepseek-ai/DeepSeek-V3 config.json): 671.0B params, 36.6B active per token."""
        return cls(
            vocab_size=129_280, dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, kv_lora_rank=512,
            ffn_dim=18_432, n_dense_layers=3, n_experts=256, top_k=8, moe_ffn_dim=2048, n_shared_experts=1,
            n_groups=8, topk_groups=4, routed_scale=2.5, max_seq_len=163_840,
            rope_scaling=YarnRopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                         beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        )  # fmt: skip

    @classmethod
    def deepseek_v3_16b(cls) -> Config:
        """TorchTitan's deepseek_v3 "16B" (DeepSeek-V2-Lite's shape and routing): 15.7B params, 2.45B active.

        Softmax scores, no renormalization, no groups; unlike V2-Lite it keeps
        the balancing bias (TorchTitan's default ``load_balance_coeff``) and
        trains without YaRN. HF's DeepseekV3 has sigmoid routing only, so this
        flavor does not export to HF.
        """
        return cls(
            vocab_size=102_400, dim=2048, n_layers=27, n_heads=16, q_lora_rank=None, kv_lora_rank=512,
            ffn_dim=10_944, n_dense_layers=1, n_experts=64, top_k=6, moe_ffn_dim=1408, n_shared_experts=2,
            score_func="softmax", norm_topk=False,
        )  # fmt: skip

    @classmethod
    def moonlight_16b_a3b(cls) -> Config:
        """Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B config.json): 15.96B params, 2.58B active."""
        return cls(
            vocab_size=163_840, dim=2048, n_layers=27, n_heads=16, q_lora_rank=None, kv_lora_rank=512,
            ffn_dim=11_264, n_dense_layers=1, n_experts=64, top_k=6, moe_ffn_dim=1408, n_shared_experts=2,
            routed_scale=2.446, norm_eps=1e-5, rope_theta=50_000.0, max_seq_len=8192,
        )  # fmt: skip

    @classmethod
    def kimi_k2(cls) -> Config:
        """Kimi K2 Base/Instruct (moonshotai/Kimi-K2-Instruct config.json): 1.026T params, 31.7B active."""
        return cls(
            vocab_size=163_840, dim=7168, n_layers=61, n_heads=64, q_lora_rank=1536, kv_lora_rank=512,
            ffn_dim=18_432, n_dense_layers=1, n_experts=384, top_k=8, moe_ffn_dim=2048, n_shared_experts=1,
            routed_scale=2.827, rope_theta=50_000.0, max_seq_len=131_072,
            rope_scaling=YarnRopeScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                                         beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        )  # fmt: skip

    @classmethod
    def kimi_k2_5(cls) -> Config:
        """Kimi K2.5's text decoder (text_config of moonshotai/Kimi-K2.5): K2's shape, 256K context.

        Differs from K2 in ``norm_eps=1e-5`` and YaRN ``factor=64, beta_fast=32``
        (262,144 positions), as quoted from the checkpoint's config by several
        inference ports; not checked against the hub file itself (offline).
        """
        return cls(
            vocab_size=163_840, dim=7168, n_layers=61, n_heads=64, q_lora_rank=1536, kv_lora_rank=512,
            ffn_dim=18_432, n_dense_layers=1, n_experts=384, top_k=8, moe_ffn_dim=2048, n_shared_experts=1,
            routed_scale=2.827, norm_eps=1e-5, rope_theta=50_000.0, max_seq_len=262_144,
            rope_scaling=YarnRopeScaling(factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                         beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        )  # fmt: skip

    @classmethod
    def kimi_k2_6(cls) -> Config:
        """Kimi K2.6's text decoder: K2.5's (1.026T params, 31.7B active), as TorchTitan's ``kimi_k2_7``
        model code builds K2.5, K2.6 and K2.7-Code from one config (``_kimi_k2_5``; transformers'
        ``Kimi_K25Config`` names moonshotai/Kimi-K2.6 as its checkpoint). The hub config.json itself
        was not reachable here (offline)."""
        return cls.kimi_k2_5()

    @classmethod
    def kimi_k2_7(cls) -> Config:
        """Kimi K2.7(-Code)'s text decoder: K2.5's, from the same TorchTitan ``kimi_k2_7`` config
        (the hub config.json was not reachable here)."""
        return cls.kimi_k2_5()


FLAVORS = {
    "debug": Config.debug,
    "deepseek_v3_16b": Config.deepseek_v3_16b,
    "deepseek_v3_671b": Config.deepseek_v3_671b,
    "moonlight_16b_a3b": Config.moonlight_16b_a3b,
    "kimi_k2": Config.kimi_k2,
    "kimi_k2_5": Config.kimi_k2_5,
    "kimi_k2_6": Config.kimi_k2_6,
    "kimi_k2_7": Config.kimi_k2_7,
}


def param_specs(cfg: Config) -> dict[str, Any]:
    """Tree of ``nn.Param`` specs (shape, logical axes, init) shaped like the params."""
    d, std = cfg.dim, cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)  # residual-branch outputs (GPT-2 style depth scaling)

    def layer(i: int) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "attn_norm": nn.norm_param(d),
            "attn": mla_.mla_params(d, cfg.mla, std=std, out_std=out_std),
            "mlp_norm": nn.norm_param(d),
        }
        if i < cfg.n_dense_layers:
            spec["mlp"] = nn.swiglu_params(d, cfg.ffn_dim, std=std, out_std=out_std)
        else:
            spec["moe"] = moe_.moe_params(d, cfg.moe, std=std, out_std=out_std)
        return spec

    specs = {
        "embed": nn.embed_param(cfg.vocab_size, d, std=std),
        "layers": {str(i): layer(i) for i in range(cfg.n_layers)},
        "norm": nn.norm_param(d),
        "head": nn.linear_param(d, cfg.vocab_size, axes=("vocab", "embed"), std=std),
    }
    if cfg.n_mtp_layers:  # MoE blocks, as layer n_layers of V3's checkpoint
        specs["mtp"] = mtp.mtp_specs(d, cfg.n_mtp_layers, lambda: layer(cfg.n_layers), std=std)
    return specs


def param_counts(cfg: Config) -> tuple[int, int]:
    """``(total, active)`` parameter counts, from the specs (nothing allocated).

    ``active`` leaves out the routed experts a token does not use
    (``E - top_k`` per MoE block) and keeps everything else, embedding table
    included. DeepSeek's and Moonshot's headline "activated" figures leave
    out the embedding lookup: ``active - vocab_size * dim``.
    """
    total = sum(math.prod(spec.shape) for spec in tree.leaves(param_specs(cfg)))
    moe_blocks = cfg.n_moe_layers + cfg.n_mtp_layers  # MTP modules (training only) hold a MoE block each
    unused = moe_blocks * (cfg.n_experts - cfg.top_k) * 3 * cfg.dim * cfg.moe_ffn_dim
    return total, total - unused


def flops_per_token(cfg: Config, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

    ``6 * N + 3 * L * T * H * (Dn + Dr + Dv)``. N counts the weights a
    token's matmuls use: MLA's projections (``wq`` or ``wq_a`` + ``wq_b``,
    ``wkv_a``, ``wkv_b``, ``wo``), the dense SwiGLUs, per MoE block the
    router and ``top_k + n_shared_experts`` experts, and the output head;
    not the embedding lookup, norms or routing bias. A weight costs 2 FLOPs
    per token forward and 4 backward. Attention scores take ``2 * T *
    (Dn + Dr)`` and values ``2 * T * Dv`` FLOPs per head and token forward,
    times 3 for forward + backward, halved for the causal mask. Each MTP
    module adds a block (attention and MoE), its ``eh_proj`` (2D x D) and
    another pass through the head.
    """
    d, h, m = cfg.dim, cfg.n_heads, cfg.mla
    q = d * h * m.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank * (d + h * m.qk_head_dim)
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    attn = q + kv + h * cfg.v_head_dim * d
    dense = 3 * d * cfg.ffn_dim
    moe = cfg.n_experts * d + (cfg.top_k + cfg.n_shared_experts) * 3 * d * cfg.moe_ffn_dim
    matmul = cfg.n_layers * attn + cfg.n_dense_layers * dense + cfg.n_moe_layers * moe + cfg.vocab_size * d
    matmul += cfg.n_mtp_layers * (attn + moe + 2 * d * d + cfg.vocab_size * d)
    scores = 3 * (cfg.n_layers + cfg.n_mtp_layers) * seq_len * h * (m.qk_head_dim + cfg.v_head_dim)
    return float(6 * matmul + scores)


def _stage(
    cfg: Config,
    mla_cfg: mla_.MLAConfig,  # cfg.mla and cfg.moe, built once outside (torch.compile cannot build attrs classes)
    moe_cfg: moe_.MoEConfig,
    params: Mapping[str, Any],  # this stage's subtree: layers.{i} of ``layers``, embed if first, norm if last
    x: torch.Tensor,  # (B, T) int tokens if first, else (B, T, D) hidden from the previous stage
    *,
    layers: range,
    first: bool,
    last: bool,
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int; default arange(T)
    cache: Any = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows (None: one document a row)
) -> base.StageOut:  # h (B, T, D), {layer: this rank's MoEStats}, cache
    """Embed (``first``), blocks ``layers``, final norm (``last``): the layer loop of ``apply_with_aux``
    and one pipeline stage (``base.StageFn``)."""
    if cfg.n_mtp_layers and not (first and last):
        raise NotImplementedError(
            f"deepseek_v3: pipeline stages (layers {layers.start}..{layers.stop - 1}) do not run the "
            f"n_mtp_layers={cfg.n_mtp_layers} MTP modules or their loss; train with n_mtp_layers=0 under pp"
        )
    cos, sin = mla_.mla_rope(decoder.stage_positions(x, positions, first=first, family="deepseek_v3",
                                                           segments=segments), mla_cfg)  # fmt: skip

    def block(i: int, p: Mapping[str, Any], h: torch.Tensor, attend: Attend) -> tuple[torch.Tensor, Any]:
        # dense or MoE from the params (a dict key dynamo guards once per kind), not the index: under regional
        # compile (ftitan.train.regional) a block that read `i` would compile once per layer
        return _block(cfg, mla_cfg, moe_cfg, p, h, cos, sin, attend=attend, dense="mlp" in p)

    return decoder.run_stage(cfg, params, x, block, layers=layers, first=first, last=last, cache=cache,
                             segments=segments)  # fmt: skip


def _block(
    cfg: Config,
    mla_cfg: mla_.MLAConfig,
    moe_cfg: moe_.MoEConfig,
    p: Mapping[str, Any],  # one block's params
    h: torch.Tensor,  # (B, T, D) residual stream
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    attend: Attend,
    dense: bool,
) -> tuple[torch.Tensor, Any]:  # (B, T, D), MoEStats or None
    """One block: ``h += mla(rms_norm(h))``, ``h += ffn(rms_norm(h))`` (dense SwiGLU or MoE). The
    parallel seams (decoder.norm/mlp, expert.moe, _attention) are the single-process ops without a layout."""
    h = h + _attention(decoder.norm(cfg, h, p["attn_norm"]), p["attn"], cos, sin, mla_cfg, attend=attend)
    x = decoder.norm(cfg, h, p["mlp_norm"])
    if dense:
        return h + decoder.mlp(x, p["mlp"], invariant=moe_cfg.batch_invariant, kernels=cfg.kernels,
                               float8=cfg.float8), None
    y, stats = expert.moe(x, p["moe"], moe_cfg)  # routed experts over ep, hidden widths over tp
    return h + y, stats


def _mtp_block(cfg: Config, mla_cfg: mla_.MLAConfig, moe_cfg: moe_.MoEConfig) -> mtp.Block:
    """The MTP modules' transformer block (a MoE block, as V3's layer n_layers), RoPE'd at ``positions``."""

    def block(p: Mapping[str, Any], h: torch.Tensor, positions: torch.Tensor, attend: Attend) -> tuple[
            torch.Tensor, Any]:  # fmt: skip
        cos, sin = mla_.mla_rope(positions, mla_cfg)
        return _block(cfg, mla_cfg, moe_cfg, p, h, cos, sin, attend=attend, dense=False)

    return block


def mtp_module(cfg: Config, k: int = 0) -> Any:
    """MTP module ``k`` as a function ``(params, h_prev, next_tokens, *, positions, cache=None, segments=None)
    -> (h, normed, cache, stats)`` (``ftitan.models.mtp.module_apply``): what speculative decoding drafts with."""
    return functools.partial(mtp.module_apply, k=k, block=_mtp_block(cfg, cfg.mla, cfg.moe), norm_eps=cfg.norm_eps,
                             kernels=cfg.kernels)  # fmt: skip


def _apply_with_aux(
    cfg: Config,
    mla_cfg: mla_.MLAConfig,
    moe_cfg: moe_.MoEConfig,
    params: Mapping[str, Any],
    tokens: torch.Tensor,  # (B, T) int
    *,
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int
    cache: Any = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows (None: one document a row)
    logits: bool = True,
    mtp_loss: bool = True,  # run the MTP modules for their loss (without a cache); plain ``apply`` does not
) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor]]:  # (B, T, V) | (B, T, D); cache; aux
    h, stats, cache = _stage(cfg, mla_cfg, moe_cfg, params, tokens, layers=range(cfg.n_layers), first=True,
                             last=True, positions=positions, cache=cache, segments=segments)  # fmt: skip
    inv = moe_cfg.batch_invariant
    out = decoder.logits_of(h, _head(params), invariant=inv, kernels=cfg.kernels) if logits else h
    losses: list[torch.Tensor] = []
    all_stats = list(stats.values())
    if mtp_loss and cfg.n_mtp_layers and cache is None and "mtp" in params:  # training: the MTP loss
        positions = decoder.positions_for(tokens, positions, family="deepseek_v3", segments=segments)
        block = _mtp_block(cfg, mla_cfg, moe_cfg)
        losses, mtp_stats = mtp.mtp_losses(params, h, tokens, block, norm_eps=cfg.norm_eps, kernels=cfg.kernels,
                                           positions=positions, segments=segments)  # fmt: skip
        all_stats += mtp_stats
    aux = expert.moe_aux(all_stats, moe_cfg)  # router statistics of the global batch (MTP blocks' rows last)
    if losses:
        mean = torch.stack(losses).mean()
        aux["loss"] = aux["loss"] + cfg.mtp_loss_weight * mean
        aux["mtp.ce_loss"] = mean.detach()
    return out, cache, aux


# MLA's latent projections and norms: replicated over tp (logical "q_lora"/"kv_lora"/"norm"), but their
# cotangents come from the tp-split heads of wq_b / wkv_b (partial sums), so their gradients are summed
_LATENT = ("wq_a", "q_norm", "wkv_a", "kv_norm")


def _attention(
    x: torch.Tensor,  # (B, T_local, D) normed residual stream
    p: Mapping[str, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg: mla_.MLAConfig,
    *,
    attend: Attend = par.attention,
) -> torch.Tensor:  # (B, T_local, D)
    """MLA under the current layout: column-parallel in (heads over tp), row-parallel out (``wo``),
    context-parallel attention (or a KV cache's ``attend``); exactly ``nn.mla.mla`` without a layout."""
    x = par.column_input(x)
    p = {k: par.tp_shared(p[k], "heads") if k in _LATENT else p[k] for k in p}
    return par.row_output(mla_.mla(x, p, cos, sin, cfg, attend=attend))


def _head(params: Mapping[str, Any]) -> torch.Tensor:  # (V, D)
    """The output head (this rank's vocab slice under tensor parallelism: the loss is vocab-parallel)."""
    return params["head"]


def update_router_bias(cfg: Config, params: Mapping[str, Any], metrics: Mapping[str, torch.Tensor]) -> Any:
    """Params with each MoE block's ``router_bias`` moved towards balance (``Model.update_buffers``).

    ``metrics["moe.tokens_per_expert"]`` is ``(L_moe, E)``, row ``j`` for block
    ``n_dense_layers + j``, then (when the step ran the MTP loss) one row per
    MTP module's block, ``mtp.{k}.block.moe.router_bias``. Pure: the input
    tree is not modified; every other leaf is shared with it.
    """
    if "moe.tokens_per_expert" not in metrics:
        raise KeyError(
            "deepseek_v3.update_buffers: metrics lack 'moe.tokens_per_expert'; pass the train step's metrics "
            "(the loss must come from model.apply_with_aux, e.g. ftitan.train.next_token_loss)"
        )
    load = metrics["moe.tokens_per_expert"]
    rows = (cfg.n_moe_layers, cfg.n_moe_layers + cfg.n_mtp_layers)
    if load.dim() != 2 or load.shape[0] not in rows or load.shape[1] != cfg.n_experts:
        raise ValueError(
            f"deepseek_v3.update_buffers: moe.tokens_per_expert has shape {tuple(load.shape)}, config expects "
            f"(n_moe_layers [+ n_mtp_layers], n_experts) = ({' or '.join(map(str, sorted(set(rows))))}, "
            f"{cfg.n_experts})"
        )
    layers = dict(params["layers"])
    with torch.no_grad():
        for j, i in enumerate(range(cfg.n_dense_layers, cfg.n_layers)):
            if str(i) not in layers:  # a pipeline stage holds only its own layers; the load covers all
                continue
            block = dict(layers[str(i)])
            moe = dict(block["moe"])
            moe["router_bias"] = moe_.update_router_bias(moe["router_bias"], load[j], cfg.bias_update_rate)
            block["moe"] = moe
            layers[str(i)] = block
    if load.shape[0] > cfg.n_moe_layers and "mtp" in params:
        return {**params, "layers": layers, "mtp": mtp.update_router_bias(params["mtp"], load[cfg.n_moe_layers:],
                                                                           cfg.bias_update_rate)}  # fmt: skip
    return {**params, "layers": layers}


def model(cfg: Config) -> Model:
    """The DeepSeek-V3 ``Model`` for ``cfg``: pure ``init``/``apply`` closed over the config.

    ``init`` keeps ``router_bias`` in float32 whatever ``dtype`` (as HF's
    ``e_score_correction_bias``): the balancing steps of 1e-3 would vanish
    in bfloat16.
    """
    specs = param_specs(cfg)

    def init(
        key: torch.Tensor, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> tree.Tree:
        params = nn.init(specs, key, dtype=dtype, device=device)
        for i in range(cfg.n_dense_layers, cfg.n_layers):
            moe = params["layers"][str(i)]["moe"]
            moe["router_bias"] = moe["router_bias"].to(torch.float32)
        for k in range(cfg.n_mtp_layers):
            moe = params["mtp"][str(k)]["block"]["moe"]
            moe["router_bias"] = moe["router_bias"].to(torch.float32)
        return params

    apply_with_aux = functools.partial(_apply_with_aux, cfg, cfg.mla, cfg.moe)
    return Model(
        config=cfg,
        init=init,
        apply=drop_aux(functools.partial(apply_with_aux, mtp_loss=False)),  # logits / hidden: no MTP work
        head=_head,
        param_axes=nn.axes(specs),
        flops_per_token=functools.partial(flops_per_token, cfg),
        apply_with_aux=apply_with_aux,
        stage=functools.partial(_stage, cfg, cfg.mla, cfg.moe),
        frozen=FROZEN + ((mtp.FROZEN,) if cfg.n_mtp_layers else ()),
        update_buffers=functools.partial(update_router_bias, cfg),
    )


# ---------------------------------------------------------------- HF checkpoints

_HF_ATTN = {  # ftitan MLA leaf -> HF DeepseekV3Attention module
    "wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj",
}  # fmt: skip
_HF_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def hf_weights(cfg: Config) -> list[hf.WeightMap]:
    """ftitan path <-> HF ``DeepseekV3ForCausalLM`` checkpoint names.

    Renames, except the stacked expert weights: ``moe.experts.w1`` (E, Fe, D)
    is the E tensors ``mlp.experts.{e}.gate_proj.weight`` of hub checkpoints
    (what ``save_pretrained`` writes, vLLM and SGLang read, and
    ``from_pretrained`` fuses into its in-memory ``gate_up_proj``).
    """
    maps = [
        hf.WeightMap(path="embed", names=("model.embed_tokens.weight",)),
        hf.WeightMap(path="norm", names=("model.norm.weight",)),
        hf.WeightMap(path="head", names=("lm_head.weight",)),
    ]
    attn_leaves = mla_.mla_params(cfg.dim, cfg.mla)
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}"
        maps += [
            hf.WeightMap(path=f"layers.{i}.attn_norm", names=(f"{pre}.input_layernorm.weight",)),
            hf.WeightMap(path=f"layers.{i}.mlp_norm", names=(f"{pre}.post_attention_layernorm.weight",)),
        ]
        maps += [hf.WeightMap(path=f"layers.{i}.attn.{k}", names=(f"{pre}.self_attn.{_HF_ATTN[k]}.weight",))
                 for k in attn_leaves]  # fmt: skip
        if i < cfg.n_dense_layers:
            maps += [hf.WeightMap(path=f"layers.{i}.mlp.{k}", names=(f"{pre}.mlp.{n}.weight",))
                     for k, n in _HF_SWIGLU.items()]  # fmt: skip
            continue
        maps += [
            hf.WeightMap(path=f"layers.{i}.moe.router", names=(f"{pre}.mlp.gate.weight",)),
            hf.WeightMap(path=f"layers.{i}.moe.router_bias", names=(f"{pre}.mlp.gate.e_score_correction_bias",)),
        ]
        for k, n in _HF_SWIGLU.items():
            path = f"layers.{i}.moe.experts.{k}"
            names = tuple(f"{pre}.mlp.experts.{e}.{n}.weight" for e in range(cfg.n_experts))
            shape = (cfg.dim, cfg.moe_ffn_dim) if k == "w2" else (cfg.moe_ffn_dim, cfg.dim)
            maps.append(hf.stacked(path, names, shape))
            if cfg.n_shared_experts:
                name = f"{pre}.mlp.shared_experts.{n}.weight"
                maps.append(hf.WeightMap(path=f"layers.{i}.moe.shared.{k}", names=(name,)))
    if cfg.n_mtp_layers:  # layer n_layers + k: the block under the same names, plus the MTP module's own
        mtp_cfg = attrs.evolve(cfg, n_layers=cfg.n_layers + cfg.n_mtp_layers, n_mtp_layers=0)
        main = {m.path for m in maps}
        block = [m for m in hf_weights(mtp_cfg) if m.path.startswith("layers.") and m.path not in main]
        maps = mtp.hf_weights(maps, block, n_layers=cfg.n_layers)
    return maps


def _hf_empty(cfg: Config) -> dict[str, tuple[int, ...]]:
    """With ``n_shared_experts=0`` HF still builds each MoE block's shared-expert SwiGLU, of width 0."""
    if cfg.n_shared_experts:
        return {}
    shapes = {"gate_proj": (0, cfg.dim), "up_proj": (0, cfg.dim), "down_proj": (cfg.dim, 0)}
    blocks = range(cfg.n_dense_layers, cfg.n_layers + cfg.n_mtp_layers)  # MTP modules: layers L + k
    return {f"model.layers.{i}.mlp.shared_experts.{n}.weight": shape for i in blocks for n, shape in shapes.items()}


def _hf_ignored(cfg: Config) -> tuple[str, ...]:
    # rotary buffers of old exports; without n_mtp_layers, the multi-token-prediction module that V3/R1
    # ship as layer L (mtp.load_hf imports it)
    return ("**.rotary_emb.inv_freq", *(() if cfg.n_mtp_layers else (f"model.layers.{cfg.n_layers}.**",)))


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """``DeepseekV3Config`` fields (transformers 5 ``rope_parameters`` format)."""
    refuse = {
        "score_func": (cfg.score_func, "sigmoid"),  # HF's DeepseekV3TopkRouter is sigmoid-only
        "latent_norm_eps": (cfg.latent_norm_eps, 1e-6),  # hard-coded in HF's DeepseekV3Attention
    }
    for key, (got, want) in refuse.items():
        if got != want:
            raise ValueError(
                f"deepseek_v3.config_to_hf: {key}={got!r} has no DeepseekV3ForCausalLM equivalent (HF fixes "
                f"{want!r}); set {key}={want!r} to export"
            )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling is not None:
        fields = {k: v for k, v in attrs.asdict(cfg.rope_scaling).items() if v is not None}
        if fields.get("truncate", True):
            fields.pop("truncate", None)  # HF's default; older readers reject the key
        rope = {"rope_type": "yarn", "rope_theta": float(cfg.rope_theta), **fields}
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,  # MLA: HF repeats nothing, kv heads == heads
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "first_k_dense_replace": cfg.n_dense_layers,
        "n_routed_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "n_shared_experts": cfg.n_shared_experts,
        "n_group": cfg.n_groups,
        "topk_group": cfg.topk_groups,
        "norm_topk_prob": cfg.norm_topk,
        "routed_scaling_factor": float(cfg.routed_scale),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        "rope_interleave": cfg.rope_interleave,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": cfg.n_mtp_layers,
    }


def _rope_from_hf(d: Mapping[str, Any]) -> tuple[float, YarnRopeScaling | None]:
    # transformers 5 writes rope_parameters; hub checkpoints (4.x remote code) rope_theta + rope_scaling
    rp = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    theta = float(rp.get("rope_theta", d.get("rope_theta", 10_000.0)))
    params = rp if rp.get("rope_type", rp.get("type", "default")) != "default" else legacy
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"deepseek_v3: HF rope type {kind!r} is not supported (only 'default' and 'yarn')")
    floats = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")
    kw: dict[str, Any] = {k: float(params[k]) for k in floats if params.get(k) is not None}
    kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    if "truncate" in params:
        kw["truncate"] = bool(params["truncate"])
    return theta, YarnRopeScaling(**kw)


def config_from_hf(d: Mapping[str, Any]) -> Config:
    """A ``Config`` from an HF ``DeepseekV3Config`` dict (or Kimi's ``kimi_k2``); refuses what this model lacks.

    The main model only, as ``DeepseekV3ForCausalLM`` reads it: ``num_nextn_predict_layers`` does not say
    whether a checkpoint holds MTP weights (transformers writes 1 by default and saves none), so
    ``n_mtp_layers`` stays 0; ``ftitan.models.mtp.load_hf`` counts the modules in the weights.
    """
    required = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "kv_lora_rank", "n_routed_experts", "num_experts_per_tok")  # fmt: skip
    if absent := [k for k in required if k not in d]:
        raise ValueError(f"deepseek_v3: HF config lacks {absent}")
    if d.get("quantization_config"):
        raise ValueError(
            f"deepseek_v3: the checkpoint is quantized ({d['quantization_config'].get('quant_method')!r}); "
            f"ftitan loads bf16/fp32 weights only: dequantize it first (e.g. DeepSeek's fp8_cast_bf16.py)"
        )
    heads = d["num_attention_heads"]
    if (kv := d.get("num_key_value_heads") or heads) != heads:
        raise ValueError(
            f"deepseek_v3: HF config num_key_value_heads={kv} != num_attention_heads={heads}; MLA gives every head "
            f"its own keys and values (transformers' DeepseekV3Config defaults num_key_value_heads to 128 when it "
            f"is not given, and its own forward then fails): set num_key_value_heads={heads}"
        )
    unsupported = {
        "attention_bias": (d.get("attention_bias", False), False),
        "hidden_act": (d.get("hidden_act", "silu"), "silu"),
        "tie_word_embeddings": (d.get("tie_word_embeddings", False), False),
        "scoring_func": (d.get("scoring_func", "sigmoid"), "sigmoid"),
        "moe_layer_freq": (d.get("moe_layer_freq", 1), 1),
    }
    for key, (got, want) in unsupported.items():
        if got != want:
            raise ValueError(
                f"deepseek_v3: HF config {key}={got!r} is not supported by ftitan's DeepSeek-V3 (needs {want!r})"
            )
    theta, scaling = _rope_from_hf(d)
    return Config(
        vocab_size=d["vocab_size"],
        dim=d["hidden_size"],
        n_layers=d["num_hidden_layers"],
        n_heads=heads,
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=d.get("qk_rope_head_dim", 64),
        v_head_dim=d.get("v_head_dim") or 128,
        ffn_dim=d["intermediate_size"],
        n_dense_layers=d.get("first_k_dense_replace") or 0,
        n_experts=d["n_routed_experts"],
        top_k=d["num_experts_per_tok"],
        moe_ffn_dim=d["moe_intermediate_size"],
        n_shared_experts=d.get("n_shared_experts") or 0,
        norm_topk=bool(d.get("norm_topk_prob", True)),
        n_groups=d.get("n_group") or 1,
        topk_groups=d.get("topk_group") or 1,
        routed_scale=float(d.get("routed_scaling_factor", 1.0)),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=bool(d.get("rope_interleave", True)),
        max_seq_len=d.get("max_position_embeddings", 4096),
        init_std=float(d.get("initializer_range", 0.02)),
    )


# Kimi K2's hub config says model_type "kimi_k2" for the same DeepseekV3ForCausalLM; registered first, so
# that export (looked up by config class) writes "deepseek_v3", which transformers knows natively
for _model_type in ("kimi_k2", "deepseek_v3"):
    hf.register_family(
        hf.Family(
            name="deepseek_v3",
            config_type=Config,
            model_type=_model_type,
            model=model,
            weights=hf_weights,
            config_to_hf=config_to_hf,
            config_from_hf=config_from_hf,
            ignored=_hf_ignored,
            empty=_hf_empty,
        )
    )
