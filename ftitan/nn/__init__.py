"""Pure layers: each is a spec (shape + logical axes + init) and an apply function.

Logical axis names used by the layers: ``"vocab"``, ``"embed"`` (model dim),
``"heads"`` (query heads x head_dim), ``"kv_heads"`` (kv heads x head_dim),
``"mlp"`` (feed-forward hidden), ``"norm"`` (norm scales), ``"experts"``
(the expert dim of stacked MoE weights), ``"q_lora"`` / ``"kv_lora"`` (MLA's
low-rank latents; kept unsharded).

A model collects layer specs into a tree shaped like its params, then
``init(specs, key)`` draws every leaf from ``fold_in(key, path)`` and
``axes(specs)`` gives the logical axes. ``init_*`` helpers draw a single
layer's params from a key directly.
"""

from ftitan.nn.attention import (
    AttentionImpl,
    attention,
    causal_mask,
    document_mask,
    document_positions,
    gemm_applies,
)
from ftitan.nn.embedding import EMBED_AXES, embed, embed_param, init_embed
from ftitan.nn.linear import bias_param, init_linear, linear, linear_param
from ftitan.nn import flex, float8, invariant, mla, moe
from ftitan.nn.mla import MLAConfig, mla_params
from ftitan.nn.mlp import init_swiglu, swiglu, swiglu_params
from ftitan.nn.moe import MoEConfig, MoEStats, moe_params
from ftitan.nn.norm import NORM_AXES, init_norm, norm_param, rms_norm
from ftitan.nn.param import (
    Initializer,
    Param,
    axes,
    init,
    normal_init,
    ones_init,
    shapes,
    truncated_normal_init,
    zeros_init,
)
from ftitan.nn.rope import (
    Llama3RopeScaling,
    RopeScaling,
    YarnRopeScaling,
    apply_rope,
    rope_attention_factor,
    rope_cos_sin,
    rope_frequencies,
    rope_inv_freq,
    yarn_mscale,
)

__all__ = [
    "EMBED_AXES",
    "NORM_AXES",
    "AttentionImpl",
    "Initializer",
    "Llama3RopeScaling",
    "MLAConfig",
    "MoEConfig",
    "MoEStats",
    "Param",
    "RopeScaling",
    "YarnRopeScaling",
    "apply_rope",
    "attention",
    "axes",
    "bias_param",
    "causal_mask",
    "document_mask",
    "document_positions",
    "embed",
    "embed_param",
    "flex",
    "float8",
    "gemm_applies",
    "init",
    "init_embed",
    "init_linear",
    "init_norm",
    "init_swiglu",
    "invariant",
    "linear",
    "linear_param",
    "mla",
    "mla_params",
    "moe",
    "moe_params",
    "norm_param",
    "normal_init",
    "ones_init",
    "rms_norm",
    "rope_attention_factor",
    "rope_cos_sin",
    "rope_frequencies",
    "rope_inv_freq",
    "shapes",
    "swiglu",
    "swiglu_params",
    "truncated_normal_init",
    "yarn_mscale",
    "zeros_init",
]
