"""Multi-head Latent Attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2"), as DeepSeek-V3 and Kimi K2 use it.

Keys and values of all heads come from one small per-token latent, so a KV
cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token (576 for
DeepSeek-V3) instead of ``2 * H * Dh``:

- **queries**: ``wq x`` (``q_lora_rank=None``: DeepSeek-V2-Lite, Moonlight) or
  low-rank ``wq_b rms_norm(wq_a x)`` (DeepSeek-V3, Kimi K2), split per head
  into ``qk_nope_head_dim`` position-free dims and ``qk_rope_head_dim`` dims
  that get RoPE.
- **keys/values**: ``wkv_a x`` gives the latent ``c`` (``kv_lora_rank``) and
  one rope key ``k_rope`` (``qk_rope_head_dim``) *shared by all heads*
  (decoupled RoPE: position cannot be folded into the latent's up
  projection). ``wkv_b rms_norm(c)`` expands the latent to each head's
  ``k_nope`` and ``v`` (``v_head_dim``).
- each head attends with ``q = [q_nope, rope(q_rope)]``,
  ``k = [k_nope, rope(k_rope)]``, softmax scale ``(Dn + Dr) ** -0.5`` times
  ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN (Peng et al. 2023),
  which is how DeepSeek-V3 applies YaRN's magnitude correction.

RoPE layout: DeepSeek's checkpoints store the rope dims of ``wq``/``wq_b``
and ``wkv_a`` as interleaved pairs ``(x0, x1), (x2, x3), ...``
(``rope_interleave=True``, HF's default for ``deepseek_v3``). The pairs are
gathered into HF's rotate-half layout (``cat(x[0::2], x[1::2])``) and
rotated there, exactly as ``transformers``' ``apply_rotary_pos_emb_interleave``
does, so HF checkpoints load by renaming only. The gather permutes q and k
alike, so the scores are those of the interleaved rotation.

The two latent RMSNorms use ``latent_norm_eps`` (1e-6 in DeepSeek's and HF's
code whatever the model's ``rms_norm_eps``).

Params (``mla_params``)::

    {"wq": (H*(Dn+Dr), D)}                                    # q_lora_rank None
    | {"wq_a": (Rq, D), "q_norm": (Rq,), "wq_b": (H*(Dn+Dr), Rq)}
    + {"wkv_a": (Rkv+Dr, D), "kv_norm": (Rkv,), "wkv_b": (H*(Dn+Dv), Rkv), "wo": (D, H*Dv)}

Logical axes: ``"q_lora"`` / ``"kv_lora"`` name the latent widths (small;
meant to stay unsharded under tensor parallelism, as TorchTitan keeps
``wkv_a``), ``"heads"`` every per-head output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from ftitan.nn.attention import IMPLS, AttentionImpl, attention
from ftitan.nn.linear import linear, linear_param
from ftitan.nn.norm import norm_param, rms_norm
from ftitan.nn.param import Param, init
from ftitan.nn.rope import YarnRopeScaling, apply_rope, rope_attention_factor, rope_cos_sin, rope_inv_freq, yarn_mscale

__all__ = ["MLAConfig", "init_mla", "mla", "mla_params", "mla_rope"]


def _positive_int(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"MLAConfig.{attr.name}={value!r}: must be a positive int")


def _rank(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _positive_int(_inst, attr, value)


@attrs.frozen(kw_only=True)
class MLAConfig:
    """Shapes, RoPE and softmax scale of one MLA layer (see the module docstring)."""

    n_heads: int = attrs.field(validator=_positive_int)  # H: attention heads (queries, keys and values alike)
    q_lora_rank: int | None = attrs.field(validator=_rank)  # Rq: query latent width; None: one full wq
    kv_lora_rank: int = attrs.field(validator=_positive_int)  # Rkv: key/value latent width (cached per token)
    qk_nope_head_dim: int = attrs.field(validator=_positive_int)  # Dn: per-head q/k dims without position
    qk_rope_head_dim: int = attrs.field(validator=_positive_int)  # Dr: q/k dims with RoPE; the key's are shared
    v_head_dim: int = attrs.field(validator=_positive_int)  # Dv: per-head value width
    rope_theta: float = 10_000.0  # RoPE base
    rope_scaling: YarnRopeScaling | None = None  # YaRN context extension (also scales the softmax), or None
    rope_interleave: bool = True  # rope dims stored as interleaved pairs (DeepSeek checkpoints); False: rotate-half
    latent_norm_eps: float = 1e-6  # epsilon of the q/kv latent RMSNorms (fixed 1e-6 in DeepSeek's and HF's code)
    attn_impl: AttentionImpl = "sdpa"  # nn.attention: "sdpa", "math", "batch_invariant", "flex", "gemm", "auto"
    kernels: str = "torch"  # "triton": latent norms and RoPE by ftitan.kernels (Triton on CUDA, references elsewhere)
    float8: str = ""  # "tensorwise" / "rowwise": the projections in float8 (ftitan.nn.float8)

    def __attrs_post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim={self.qk_rope_head_dim}: must be even for RoPE")
        if self.attn_impl not in IMPLS:
            raise ValueError(f"MLAConfig.attn_impl={self.attn_impl!r}: expected one of {IMPLS}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnRopeScaling):
            raise ValueError(
                f"MLAConfig.rope_scaling={self.rope_scaling!r}: expected None or nn.rope.YarnRopeScaling"
            )
        for name in ("rope_theta", "latent_norm_eps"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"MLAConfig.{name}={getattr(self, name)!r}: must be a finite number > 0")

    @property
    def qk_head_dim(self) -> int:  # Dn + Dr
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``(Dn + Dr) ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
        scale = self.qk_head_dim**-0.5
        s = self.rope_scaling
        if s is not None and s.mscale_all_dim:
            scale = scale * yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return scale


def mla_params(dim: int, cfg: MLAConfig, *, std: float = 0.02, out_std: float | None = None) -> dict[str, Param]:
    """Spec tree of one MLA layer on a ``dim``-wide stream; ``out_std`` (default ``std``) is for ``wo``."""
    h, rkv, dr = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    specs: dict[str, Param] = {}
    if cfg.q_lora_rank is None:
        specs["wq"] = linear_param(dim, h * cfg.qk_head_dim, axes=("heads", "embed"), std=std)
    else:
        specs["wq_a"] = linear_param(dim, cfg.q_lora_rank, axes=("q_lora", "embed"), std=std)
        specs["q_norm"] = norm_param(cfg.q_lora_rank)
        specs["wq_b"] = linear_param(cfg.q_lora_rank, h * cfg.qk_head_dim, axes=("heads", "q_lora"), std=std)
    specs["wkv_a"] = linear_param(dim, rkv + dr, axes=("kv_lora", "embed"), std=std)
    specs["kv_norm"] = norm_param(rkv)
    specs["wkv_b"] = linear_param(rkv, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), axes=("heads", "kv_lora"), std=std)
    out_std = std if out_std is None else out_std
    specs["wo"] = linear_param(h * cfg.v_head_dim, dim, axes=("embed", "heads"), std=out_std)
    return specs


def init_mla(
    key: torch.Tensor,
    dim: int,
    cfg: MLAConfig,
    *,
    std: float = 0.02,
    out_std: float | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """One MLA layer's params, leaf ``name`` drawn from ``fold_in(key, name)``."""
    return init(mla_params(dim, cfg, std=std, out_std=out_std), key, dtype=dtype, device=device)


def mla_rope(
    positions: torch.Tensor,  # (T,) | (B, T) int
    cfg: MLAConfig,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: (T, Dr) | (B, T, Dr) float32
    """``cos``/``sin`` of the rope dims, YaRN-scaled and times YaRN's attention factor (as HF)."""
    inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, device=positions.device)
    cos, sin = rope_cos_sin(positions, inv_freq, invariant=cfg.attn_impl == "batch_invariant")
    factor = rope_attention_factor(cfg.rope_scaling)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, kernels: str = "torch") -> torch.Tensor:
    if interleave:  # pairs (x0, x1), (x2, x3), ... -> rotate-half layout (evens, odds)
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rope(x, cos, sin, kernels=kernels)


def mla(
    x: torch.Tensor,  # (B, T, D) normed
    p: Mapping[str, torch.Tensor],
    cos: torch.Tensor,  # (T, Dr) | (B, T, Dr) from mla_rope
    sin: torch.Tensor,
    cfg: MLAConfig,
    *,
    attend: Callable[..., torch.Tensor] = attention,
) -> torch.Tensor:  # (B, T, D)
    """Multi-head latent attention of ``x`` over itself, causal (see the module docstring).

    ``attend(q, k, v, *, impl, causal, scale)`` is the attention op (default
    ``nn.attention``; ``ftitan.parallel.activations.attention`` for context
    parallelism). Head counts come from the weights' shapes, so a rank
    holding ``H / tp`` heads of ``wq``/``wq_b``/``wkv_b``/``wo`` (tensor
    parallel) computes just those.
    """
    b, t, _ = x.shape
    dn, dr, dv, rkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    inv = cfg.attn_impl == "batch_invariant"  # every matmul and norm batch-invariant too (nn.invariant)
    kern, f8 = cfg.kernels, cfg.float8
    if cfg.q_lora_rank is None:
        q = linear(x, p["wq"], invariant=inv, kernels=kern, float8=f8)
    else:
        q_a = linear(x, p["wq_a"], invariant=inv, kernels=kern, float8=f8)
        q = linear(rms_norm(q_a, p["q_norm"], cfg.latent_norm_eps, invariant=inv, kernels=kern), p["wq_b"],
                   invariant=inv, kernels=kern, float8=f8)  # fmt: skip
    q_nope, q_rope = q.view(b, t, -1, dn + dr).split((dn, dr), dim=-1)  # (B, T, H, Dn), (B, T, H, Dr)
    h = q_nope.shape[2]
    latent, k_rope = linear(x, p["wkv_a"], invariant=inv, kernels=kern, float8=f8).split((rkv, dr), dim=-1)
    # latent (B, T, Rkv), k_rope (B, T, Dr)
    latent = rms_norm(latent, p["kv_norm"], cfg.latent_norm_eps, invariant=inv, kernels=kern)
    q_rope = _rope(q_rope, cos, sin, cfg.rope_interleave, cfg.kernels)
    k_rope = _rope(k_rope.unsqueeze(2), cos, sin, cfg.rope_interleave, cfg.kernels)  # (B, T, 1, Dr): one key for all heads
    # KV-cache seam: a cache would append (latent, k_rope) here, Rkv + Dr numbers per token
    kv = linear(latent, p["wkv_b"], invariant=inv, kernels=kern, float8=f8)
    k_nope, v = kv.view(b, t, h, dn + dv).split((dn, dv), dim=-1)
    q = torch.cat((q_nope, q_rope), dim=-1)  # (B, T, H, Dn + Dr)
    k = torch.cat((k_nope, k_rope.expand(b, t, h, dr)), dim=-1)
    o = attend(q, k, v, impl=cfg.attn_impl, causal=True, scale=cfg.softmax_scale)  # (B, T, H, Dv)
    return linear(o.reshape(b, t, h * dv), p["wo"], invariant=inv, kernels=kern, float8=f8)
