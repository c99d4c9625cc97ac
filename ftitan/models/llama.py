"""Llama 3 (Meta 2024, "The Llama 3 Herd of Models") as pure functions.

Pre-norm decoder: ``h += attn(rms_norm(h))``, ``h += swiglu(rms_norm(h))``,
GQA attention with RoPE (HF rotate-half layout, Llama 3.1 frequency
scaling), untied or tied output head. Logits match
``transformers.LlamaForCausalLM`` to float32 rounding, and HF checkpoints
load by renaming only (see ``hf_weights``).

>>> import torch, ftitan as ft
>>> from ftitan.models import llama
>>> m = llama.model(llama.Config.debug())
>>> params = m.init(ft.random.key(0))
>>> logits, _ = m.apply(params, torch.zeros(2, 16, dtype=torch.long))
>>> logits.shape
torch.Size([2, 16, 2048])

Params tree::

    {"embed": (V, D),
     "layers": {"0": {"attn_norm": (D,),
                      "attn": {"wq": (H*Dh, D), "wk": (KV*Dh, D), "wv": (KV*Dh, D), "wo": (D, H*Dh)},
                      "mlp_norm": (D,),
                      "mlp": {"w1": (F, D), "w2": (D, F), "w3": (F, D)}},
                "1": ...},
     "norm": (D,),
     "head": (V, D)}            # absent when tie_embeddings
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
from ftitan.nn.attention import IMPLS, AttentionImpl
from ftitan.nn.rope import Llama3RopeScaling

__all__ = [
    "FLAVORS",
    "Config",
    "Llama3RopeScaling",
    "config_from_hf",
    "config_to_hf",
    "flops_per_token",
    "hf_weights",
    "model",
    "param_specs",
]


@attrs.frozen(kw_only=True)
class Config:
    """Llama 3 architecture. Published sizes: ``Config.llama3_1_8b()`` etc., see ``FLAVORS``."""

    vocab_size: int  # V: rows of the embedding / output head
    dim: int  # D: model (residual stream) width
    n_layers: int  # L: decoder blocks
    n_heads: int  # H: query heads; head_dim = dim // n_heads
    n_kv_heads: int  # KV: key/value heads (GQA); n_heads % n_kv_heads == 0
    ffn_dim: int  # F: SwiGLU hidden width (explicit, not derived from a multiplier)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 500_000.0  # RoPE base
    rope_scaling: Llama3RopeScaling | None = None  # Llama 3.1 long-context frequency scaling, or None
    max_seq_len: int = 8192  # longest sequence the model is meant for (HF max_position_embeddings)
    tie_embeddings: bool = False  # output head reuses the embedding table (Llama 3.2 1B/3B)
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
        check_kernels(self.kernels, "llama.Config.kernels")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"llama.Config.{name}={value!r}: must be a positive int")
        if self.dim % self.n_heads:
            raise ValueError(
                f"llama.Config: dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                f"head_dim = dim // n_heads must be exact"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"llama.Config: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; "
                f"each kv head must serve a whole group of query heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"llama.Config: head_dim={self.head_dim} (dim // n_heads) must be even for RoPE")
        if self.attn_impl not in IMPLS:
            raise ValueError(f"llama.Config.attn_impl={self.attn_impl!r}: expected one of {IMPLS}")
        for name in ("norm_eps", "rope_theta", "init_std"):
            if not 0 < getattr(self, name) < math.inf:  # inf passes `> 0`, then breaks init or the norms
                raise ValueError(f"llama.Config.{name}={getattr(self, name)!r}: must be a finite number > 0")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(
                f"llama.Config.rope_scaling={self.rope_scaling!r}: expected None or nn.Llama3RopeScaling"
            )
        decoder.check_float8(self, "llama")
        decoder.check_fuse_projections(self, "llama")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def debug(cls) -> Config:
        """Tiny model that trains on 2 CPU cores (head_dim 32, which vLLM also supports)."""
        return cls(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=768, max_seq_len=2048)

    # Published hyperparameters: Meta's params.json / HF config.json of each checkpoint.
    @classmethod
    def llama3_2_1b(cls) -> Config:
        """Llama 3.2 1B: 1,235,814,400 params, tied embeddings."""
        return cls(
            vocab_size=128_256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
            rope_scaling=Llama3RopeScaling(factor=32.0), max_seq_len=131_072, tie_embeddings=True,
        )  # fmt: skip

    @classmethod
    def llama3_2_3b(cls) -> Config:
        """Llama 3.2 3B: 3,212,749,824 params, tied embeddings."""
        return cls(
            vocab_size=128_256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
            rope_scaling=Llama3RopeScaling(factor=32.0), max_seq_len=131_072, tie_embeddings=True,
        )  # fmt: skip

    @classmethod
    def llama3_1_8b(cls) -> Config:
        """Llama 3.1 8B: 8,030,261,248 params."""
        return cls(
            vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14_336,
            rope_scaling=Llama3RopeScaling(factor=8.0), max_seq_len=131_072,
        )  # fmt: skip

    @classmethod
    def llama3_1_70b(cls) -> Config:
        """Llama 3.1 70B: 70,553,706,496 params."""
        return cls(
            vocab_size=128_256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28_672,
            rope_scaling=Llama3RopeScaling(factor=8.0), max_seq_len=131_072,
        )  # fmt: skip

    @classmethod
    def llama3_1_405b(cls) -> Config:
        """Llama 3.1 405B: 405,853,388,800 params."""
        return cls(
            vocab_size=128_256, dim=16_384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53_248,
            rope_scaling=Llama3RopeScaling(factor=8.0), max_seq_len=131_072,
        )  # fmt: skip


FLAVORS = {
    "debug": Config.debug,
    "llama3_2_1b": Config.llama3_2_1b,
    "llama3_2_3b": Config.llama3_2_3b,
    "llama3_1_8b": Config.llama3_1_8b,
    "llama3_1_70b": Config.llama3_1_70b,
    "llama3_1_405b": Config.llama3_1_405b,
}


def param_specs(cfg: Config) -> dict[str, Any]:
    """Tree of ``nn.Param`` specs (shape, logical axes, init) shaped like the params."""

    def layer() -> dict[str, Any]:
        return {
            "attn_norm": nn.norm_param(cfg.dim),
            "attn": decoder.attention_params(cfg, qk_norm=False),
            "mlp_norm": nn.norm_param(cfg.dim),
            # residual-branch outputs (wo, w2) get init_std / sqrt(2L) (GPT-2 style depth scaling)
            "mlp": nn.swiglu_params(cfg.dim, cfg.ffn_dim, std=cfg.init_std, out_std=decoder.residual_std(cfg)),
        }

    return {
        "embed": nn.embed_param(cfg.vocab_size, cfg.dim, std=cfg.init_std),
        "layers": {str(i): layer() for i in range(cfg.n_layers)},
        "norm": nn.norm_param(cfg.dim),
        **decoder.head_params(cfg),
    }


def flops_per_token(cfg: Config, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

    ``6 * N + 6 * L * T * H * Dh`` where N counts the weights used in
    matmuls: every attention and MLP projection and the output head (the
    embedding table when tied), not the embedding lookup or norms. A weight
    costs 2 FLOPs per token forward and 4 backward. Attention scores and
    values take 2 * 2 * T * Dh FLOPs per head and token forward, times 3 for
    forward + backward = 12 * L * T * H * Dh, halved for the causal mask
    (PaLM's formula counts the full 12).
    """
    attn, scores = decoder.attention_flops(cfg, seq_len)
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
    return decoder.dense_forward(cfg, params, tokens, positions=positions, cache=cache, segments=segments,
                                 logits=logits, family="llama", scaling=cfg.rope_scaling)  # fmt: skip


def model(cfg: Config) -> Model:
    """The Llama 3 ``Model`` for ``cfg``: pure ``init``/``apply`` closed over the config."""
    specs = param_specs(cfg)
    init, axes = decoder.init_and_axes(cfg, specs)  # (key, *, dtype, device) -> params

    return Model(
        config=cfg,
        init=init,
        apply=functools.partial(_apply, cfg),
        head=functools.partial(decoder.output_head, cfg),
        param_axes=axes,
        flops_per_token=functools.partial(flops_per_token, cfg),
        stage=functools.partial(decoder.dense_stage, cfg, family="llama", scaling=cfg.rope_scaling),
    )


# ---------------------------------------------------------------- HF checkpoints

def hf_weights(cfg: Config) -> list[hf.WeightMap]:
    """ftitan path <-> HF ``LlamaForCausalLM`` name, one rename per leaf."""
    layer = {**decoder.HF_ATTENTION, **decoder.HF_MLP}
    maps = [*decoder.hf_outer_weights(cfg), *hf.per_layer(cfg.n_layers, layer)]
    return decoder.fused_weights(cfg, maps, param_specs(cfg))


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """``LlamaConfig`` fields (transformers 5 ``rope_parameters`` format)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": float(cfg.rope_theta), **attrs.asdict(cfg.rope_scaling)}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder.hf_common_to_hf(cfg),
        "intermediate_size": cfg.ffn_dim,
        "rope_parameters": rope,
        "mlp_bias": False,
    }


def _rope_from_hf(d: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    # transformers 5 writes rope_parameters; 4.x (and Meta's HF exports) rope_theta + rope_scaling
    rp = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    theta = float(rp.get("rope_theta", d.get("rope_theta", 10_000.0)))
    params = rp if rp.get("rope_type", rp.get("type", "default")) != "default" else legacy
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"llama: HF rope type {kind!r} is not supported (only 'default' and 'llama3')")
    fields = [f.name for f in attrs.fields(Llama3RopeScaling)]
    return theta, Llama3RopeScaling(**{k: params[k] for k in fields if k in params})


def config_from_hf(d: Mapping[str, Any]) -> Config:
    """A ``Config`` from an HF ``LlamaConfig`` dict; refuses features this model does not have."""
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if absent := [k for k in required if k not in d]:
        raise ValueError(f"llama: HF config lacks {absent}")
    unsupported = {
        "attention_bias": (d.get("attention_bias", False), False),
        "mlp_bias": (d.get("mlp_bias", False), False),
        "hidden_act": (d.get("hidden_act", "silu"), "silu"),
        "head_dim": (d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                     d["hidden_size"] // d["num_attention_heads"]),
    }  # fmt: skip
    for key, (got, want) in unsupported.items():
        if got != want:
            raise ValueError(f"llama: HF config {key}={got!r} is not supported by ftitan's Llama (needs {want!r})")
    theta, scaling = _rope_from_hf(d)
    return Config(
        vocab_size=d["vocab_size"],
        dim=d["hidden_size"],
        n_layers=d["num_hidden_layers"],
        n_heads=d["num_attention_heads"],
        n_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        ffn_dim=d["intermediate_size"],
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=d.get("max_position_embeddings", 2048),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=float(d.get("initializer_range", 0.02)),
    )


hf.register_family(
    hf.Family(
        name="llama",
        config_type=Config,
        model_type="llama",
        model=model,
        weights=hf_weights,
        config_to_hf=config_to_hf,
        config_from_hf=config_from_hf,
        ignored=decoder.hf_ignored,
    )
)
