"""Qwen3 dense (Qwen3 Technical Report, Yang et al. 2025) as pure functions.

Llama's pre-norm decoder (``h += attn(rms_norm(h))``, ``h += swiglu(rms_norm(h))``,
GQA, RoPE in HF's rotate-half layout) with two changes:

- **QK-norm**: queries and keys are RMS-normalized over ``head_dim``, per
  head, before RoPE (one ``(Dh,)`` scale each for q and k, shared by the
  heads). It replaces Qwen2's QKV bias and keeps attention logits bounded.
- **explicit head_dim**: 128 for every published size, so ``H * Dh`` is not
  ``dim`` in general (0.6B: 16 heads x 128 = 2048 from a 1024-wide stream).

Small sizes (0.6B/1.7B/4B) tie the output head to the embedding; RoPE base
is 1e6. Logits match ``transformers.Qwen3ForCausalLM`` to float32 rounding,
and HF checkpoints load by renaming only (see ``hf_weights``).

>>> import torch, ftitan as ft
>>> from ftitan.models import qwen3
>>> m = qwen3.model(qwen3.Config.debug())
>>> params = m.init(ft.random.key(0))
>>> logits, _ = m.apply(params, torch.zeros(2, 16, dtype=torch.long))
>>> logits.shape
torch.Size([2, 16, 2048])

Params tree::

    {"embed": (V, D),
     "layers": {"0": {"attn_norm": (D,),
                      "attn": {"wq": (H*Dh, D), "wk": (KV*Dh, D), "wv": (KV*Dh, D), "wo": (D, H*Dh),
                               "q_norm": (Dh,), "k_norm": (Dh,)},
                      "mlp_norm": (D,),
                      "mlp": {"w1": (F, D), "w2": (D, F), "w3": (F, D)}},
                "1": ...},
     "norm": (D,),
     "head": (V, D)}            # absent when tie_embeddings

The attention block, RoPE, head and HF names come from ``ftitan.models.decoder``
(shared with Llama); the Qwen-specific HF config fields and checks here are
shared with ``qwen3_moe``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ftitan import nn
from ftitan.kernels.op import check_kernels
from ftitan.models import decoder, hf
from ftitan.models.base import Model
from ftitan.models.decoder import (
    HF_ATTENTION,
    HF_MLP,
    HF_QK_NORM,
    AttentionConfig,
    attention,
    attention_flops,
    attention_params,
    check_positive_int,
    dense_forward,
    head_params,
    hf_ignored,
    hf_outer_weights,
    output_head,
    residual_std,
    rope,
)
from ftitan.nn.attention import IMPLS, AttentionImpl

__all__ = [
    "FLAVORS",
    "Config",
    "config_from_hf",
    "config_to_hf",
    "flops_per_token",
    "hf_weights",
    "model",
    "param_specs",
]


@attrs.frozen(kw_only=True)
class Config:
    """Qwen3 dense architecture. Published sizes: ``Config.qwen3_8b()`` etc., see ``FLAVORS``."""

    vocab_size: int  # V: rows of the embedding / output head
    dim: int  # D: model (residual stream) width (HF hidden_size)
    n_layers: int  # L: decoder blocks
    n_heads: int  # H: query heads
    n_kv_heads: int  # KV: key/value heads (GQA); n_heads % n_kv_heads == 0
    head_dim: int  # Dh: width of one head, explicit (H * Dh need not equal dim)
    ffn_dim: int  # F: SwiGLU hidden width (HF intermediate_size)
    norm_eps: float = 1e-6  # epsilon of every RMSNorm, QK-norm included
    rope_theta: float = 1_000_000.0  # RoPE base
    max_seq_len: int = 40_960  # longest sequence the model is meant for (HF max_position_embeddings)
    tie_embeddings: bool = False  # output head reuses the embedding table (0.6B, 1.7B, 4B)
    # "sdpa", "math" (explicit fp32 softmax), "batch_invariant" (all ops, nn.invariant), "flex" (FlexAttention,
    # SDPA with the same mask where it cannot run), "gemm" (causal query blocks as GEMMs on the CPU, else sdpa),
    # "auto" (flex on CUDA under torch.compile, gemm on the CPU, else sdpa)
    attn_impl: AttentionImpl = "sdpa"
    kernels: str = "torch"  # "torch", "triton" or "helion" (ftitan.kernels on CUDA, their references elsewhere)
    float8: str = ""  # "tensorwise" / "rowwise": the blocks' projections in float8 (torchao's recipes, nn.float8)
    remat: str = "none"  # activation rematerialization of each block (ftitan.config.with_remat): "none", "full", ...
    # params hold [wq; wk; wv] as wqkv and [w1; w3] as w13: one wider GEMM each (ftitan.models.fused; no tp)
    fuse_projections: bool = False
    init_std: float = 0.02  # std of the (truncated) normal init; residual outputs wo/w2 get init_std/sqrt(2L)

    def __attrs_post_init__(self) -> None:
        check_config(self, "qwen3")
        check_positive_int(self, "qwen3", "ffn_dim")
        decoder.check_float8(self, "qwen3")
        decoder.check_fuse_projections(self, "qwen3")

    @classmethod
    def debug(cls) -> Config:
        """Tiny tied model that trains on 2 CPU cores (head_dim 32, which vLLM also supports)."""
        return cls(
            vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, ffn_dim=768,
            max_seq_len=2048, tie_embeddings=True,
        )  # fmt: skip

    # Published hyperparameters: config.json of each Qwen/Qwen3-* checkpoint on the HF hub
    # (all: vocab 151,936, head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6, 40,960 positions).
    @classmethod
    def qwen3_0_6b(cls) -> Config:
        """Qwen3-0.6B: 596,049,920 params, tied embeddings."""
        return cls(vocab_size=151_936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                   ffn_dim=3072, tie_embeddings=True)  # fmt: skip

    @classmethod
    def qwen3_1_7b(cls) -> Config:
        """Qwen3-1.7B: 1,720,574,976 params, tied embeddings."""
        return cls(vocab_size=151_936, dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                   ffn_dim=6144, tie_embeddings=True)  # fmt: skip

    @classmethod
    def qwen3_4b(cls) -> Config:
        """Qwen3-4B: 4,022,468,096 params, tied embeddings."""
        return cls(vocab_size=151_936, dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                   ffn_dim=9728, tie_embeddings=True)  # fmt: skip

    @classmethod
    def qwen3_8b(cls) -> Config:
        """Qwen3-8B: 8,190,735,360 params."""
        return cls(vocab_size=151_936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                   ffn_dim=12_288)  # fmt: skip

    @classmethod
    def qwen3_14b(cls) -> Config:
        """Qwen3-14B: 14,768,307,200 params."""
        return cls(vocab_size=151_936, dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, head_dim=128,
                   ffn_dim=17_408)  # fmt: skip

    @classmethod
    def qwen3_32b(cls) -> Config:
        """Qwen3-32B: 32,762,123,264 params."""
        return cls(vocab_size=151_936, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
                   ffn_dim=25_600)  # fmt: skip


FLAVORS = {
    "debug": Config.debug,
    "qwen3_0_6b": Config.qwen3_0_6b,
    "qwen3_1_7b": Config.qwen3_1_7b,
    "qwen3_4b": Config.qwen3_4b,
    "qwen3_8b": Config.qwen3_8b,
    "qwen3_14b": Config.qwen3_14b,
    "qwen3_32b": Config.qwen3_32b,
}


def check_config(cfg: AttentionConfig, family: str) -> None:
    """Validation shared with ``qwen3_moe.Config`` (``family`` names the culprit's class)."""
    check_kernels(cfg.kernels, f"{family}.Config.kernels")
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_seq_len"):
        check_positive_int(cfg, family, name)
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(
            f"{family}.Config: n_heads={cfg.n_heads} is not a multiple of n_kv_heads={cfg.n_kv_heads}; "
            f"each kv head must serve a whole group of query heads"
        )
    if cfg.head_dim % 2:
        raise ValueError(f"{family}.Config: head_dim={cfg.head_dim} must be even for RoPE")
    if cfg.attn_impl not in IMPLS:
        raise ValueError(f"{family}.Config.attn_impl={cfg.attn_impl!r}: expected one of {IMPLS}")
    for name in ("norm_eps", "rope_theta", "init_std"):
        if not 0 < getattr(cfg, name) < math.inf:  # inf passes `> 0`, then breaks init or the norms
            raise ValueError(f"{family}.Config.{name}={getattr(cfg, name)!r}: must be a finite number > 0")


def param_specs(cfg: Config) -> dict[str, Any]:
    """Tree of ``nn.Param`` specs (shape, logical axes, init) shaped like the params."""

    def layer() -> dict[str, Any]:
        return {
            "attn_norm": nn.norm_param(cfg.dim),
            "attn": attention_params(cfg, qk_norm=True),
            "mlp_norm": nn.norm_param(cfg.dim),
            "mlp": nn.swiglu_params(cfg.dim, cfg.ffn_dim, std=cfg.init_std, out_std=residual_std(cfg)),
        }

    return {
        "embed": nn.embed_param(cfg.vocab_size, cfg.dim, std=cfg.init_std),
        "layers": {str(i): layer() for i in range(cfg.n_layers)},
        "norm": nn.norm_param(cfg.dim),
        **head_params(cfg),
    }


def flops_per_token(cfg: Config, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

    ``6 * N + 6 * L * T * H * Dh`` as for Llama: N counts the weights used
    in matmuls (q/k/v/o and MLP projections and the output head, the
    embedding table when tied; not the embedding lookup or the norms, QK-norm
    included); a weight costs 2 FLOPs per token forward and 4 backward.
    Attention scores and values cost 12 * L * T * H * Dh for forward +
    backward, halved for the causal mask.
    """
    attn, scores = attention_flops(cfg, seq_len)
    matmul = cfg.n_layers * (attn + 3 * cfg.dim * cfg.ffn_dim) + cfg.vocab_size * cfg.dim
    return float(6 * matmul + scores)


def _apply(
    cfg: Config,
    params: Mapping[str, Any],
    tokens: torch.Tensor,  # (B, T) int
    *,
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int
    cache: Any = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows (None: one document a row)
    logits: bool = True,
) -> tuple[torch.Tensor, Any]:  # (B, T, V) logits | (B, T, D) hidden; cache
    return dense_forward(cfg, params, tokens, positions=positions, cache=cache, segments=segments, logits=logits,
                         family="qwen3")  # fmt: skip


def model(cfg: Config) -> Model:
    """The Qwen3 ``Model`` for ``cfg``: pure ``init``/``apply`` closed over the config."""
    specs = param_specs(cfg)
    init, axes = decoder.init_and_axes(cfg, specs)  # (key, *, dtype, device) -> params

    return Model(
        config=cfg,
        init=init,
        apply=functools.partial(_apply, cfg),
        head=functools.partial(output_head, cfg),
        param_axes=axes,
        flops_per_token=functools.partial(flops_per_token, cfg),
        stage=functools.partial(decoder.dense_stage, cfg, family="qwen3"),
    )


# ---------------------------------------------------------------- HF checkpoints

def hf_weights(cfg: Config) -> list[hf.WeightMap]:
    """ftitan path <-> HF ``Qwen3ForCausalLM`` name, one rename per leaf."""
    maps = [*hf_outer_weights(cfg), *hf.per_layer(cfg.n_layers, {**HF_ATTENTION, **HF_QK_NORM, **HF_MLP})]
    return decoder.fused_weights(cfg, maps, param_specs(cfg))


def hf_common_to_hf(cfg: AttentionConfig) -> dict[str, Any]:
    """HF config fields of the attention/embedding side, shared with ``qwen3_moe``."""
    return {**decoder.hf_common_to_hf(cfg), "use_sliding_window": False, "sliding_window": None}


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """``Qwen3Config`` fields (transformers 5 ``rope_parameters`` format)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **hf_common_to_hf(cfg),
        "intermediate_size": cfg.ffn_dim,
        "max_window_layers": cfg.n_layers,  # only read with sliding windows, which ftitan's Qwen3 does not use
        "layer_types": ["full_attention"] * cfg.n_layers,
    }


def _rope_theta_from_hf(d: Mapping[str, Any], family: str) -> float:
    # transformers 5 writes rope_parameters; 4.x (and the hub config.json files) rope_theta + rope_scaling
    rp = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    for params in (rp, legacy):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"{family}: HF rope type {kind!r} is not supported (only 'default'); Qwen3's YaRN "
                f"long-context extension is opt-in, drop rope_scaling from config.json to use the native context"
            )
    return float(rp.get("rope_theta", d.get("rope_theta", 10_000.0)))


def hf_common_from_hf(d: Mapping[str, Any], family: str) -> dict[str, Any]:
    """Config kwargs shared with ``qwen3_moe`` from an HF config dict; refuses what ftitan lacks."""
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    if absent := [k for k in required if k not in d]:
        raise ValueError(f"{family}: HF config lacks {absent}")
    n_layers = d["num_hidden_layers"]
    layer_types = d.get("layer_types") or ["full_attention"] * n_layers
    unsupported = {
        "attention_bias": (d.get("attention_bias", False), False),
        "hidden_act": (d.get("hidden_act", "silu"), "silu"),
        "use_sliding_window": (bool(d.get("use_sliding_window", False)), False),
        "layer_types": (sorted(set(layer_types)), ["full_attention"]),
    }
    for key, (got, want) in unsupported.items():
        if got != want:
            raise ValueError(
                f"{family}: HF config {key}={got!r} is not supported by ftitan's {family} (needs {want!r})"
            )
    return {
        "vocab_size": d["vocab_size"],
        "dim": d["hidden_size"],
        "n_layers": n_layers,
        "n_heads": d["num_attention_heads"],
        "n_kv_heads": d.get("num_key_value_heads") or d["num_attention_heads"],
        "head_dim": d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        "norm_eps": float(d.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta_from_hf(d, family),
        "max_seq_len": d.get("max_position_embeddings", 32_768),
        "tie_embeddings": bool(d.get("tie_word_embeddings", False)),
        "init_std": float(d.get("initializer_range", 0.02)),
    }


def config_from_hf(d: Mapping[str, Any]) -> Config:
    """A ``Config`` from an HF ``Qwen3Config`` dict; refuses features this model does not have."""
    if "intermediate_size" not in d:
        raise ValueError("qwen3: HF config lacks ['intermediate_size']")
    return Config(**hf_common_from_hf(d, "qwen3"), ffn_dim=d["intermediate_size"])


hf.register_family(
    hf.Family(
        name="qwen3",
        config_type=Config,
        model_type="qwen3",
        model=model,
        weights=hf_weights,
        config_to_hf=config_to_hf,
        config_from_hf=config_from_hf,
        ignored=hf_ignored,
    )
)
