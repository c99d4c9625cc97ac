"""Qwen3.5 (Qwen team 2026): the published dense and MoE text decoders, as ``qwen3_next.Config`` flavors.

The architecture is Qwen3-Next's (``ftitan.models.qwen3_next``: Gated DeltaNet in three of every four
layers, gated full attention with partial RoPE in the fourth, zero-centered norms) with separate
``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` projections (``variant="qwen3_5"``), a
248,320-token vocabulary, and either a dense SwiGLU in every layer or an MoE in every layer (softmax
top-k, renormalized, plus a sigmoid-gated shared expert). The multimodal RoPE of the published
checkpoints is plain RoPE for text (its three position streams are equal). Checkpoints:
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, and the text decoder of the hub's
``Qwen3_5(Moe)ForConditionalGeneration`` files (``ftitan.models.qwen3_next_hf``).

>>> import ftitan as ft
>>> from ftitan.models import qwen3_5, qwen3_next
>>> model = qwen3_next.model(qwen3_5.debug())
"""

from __future__ import annotations

import attrs

from ftitan.models.qwen3_next import Config

__all__ = ["FLAVORS", "debug", "debug_moe"]

# Published hyperparameters: the text_config of each Qwen/Qwen3.5-* config.json on the HF hub (shared by all:
# vocab 248,320, head_dim 256, RoPE base 1e7 on 25% of each head, linear key heads 16 of width 128, value
# heads of width 128, conv 4, full attention every 4th layer, max positions 262,144).
_COMMON = dict(vocab_size=248_320, head_dim=256, linear_k_heads=16, linear_k_dim=128, linear_v_dim=128,
               rope_theta=10_000_000.0, max_seq_len=262_144, variant="qwen3_5")  # fmt: skip


def _dense(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, v_heads: int, tie: bool) -> Config:
    return Config(**_COMMON, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim,
                  linear_v_heads=v_heads, tie_embeddings=tie)  # fmt: skip


def _moe(dim: int, n_layers: int, n_heads: int, v_heads: int, n_experts: int, top_k: int, expert_dim: int) -> Config:
    return Config(**_COMMON, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=2, ffn_dim=expert_dim,
                  linear_v_heads=v_heads, n_experts=n_experts, top_k=top_k, expert_dim=expert_dim,
                  shared_expert_dim=expert_dim)  # fmt: skip


def qwen3_5_0_8b() -> Config:
    return _dense(1024, 24, 8, 2, 3584, 16, tie=True)


def qwen3_5_2b() -> Config:
    return _dense(2048, 24, 8, 2, 6144, 16, tie=True)


def qwen3_5_4b() -> Config:
    return _dense(2560, 32, 16, 4, 9216, 32, tie=True)


def qwen3_5_9b() -> Config:
    return _dense(4096, 32, 16, 4, 12_288, 32, tie=False)


def qwen3_5_27b() -> Config:
    return _dense(5120, 64, 24, 4, 17_408, 48, tie=False)


def qwen3_5_35b_a3b() -> Config:
    return _moe(2048, 40, 16, 32, n_experts=256, top_k=8, expert_dim=512)


def qwen3_5_122b_a10b() -> Config:
    return _moe(3072, 48, 32, 64, n_experts=256, top_k=8, expert_dim=1024)


def qwen3_5_397b_a17b() -> Config:
    return _moe(4096, 60, 32, 64, n_experts=512, top_k=10, expert_dim=1024)


def debug() -> Config:
    """Tiny dense Qwen3.5 (4 layers: 3 Gated DeltaNet + 1 gated attention) that trains on 2 CPU cores."""
    return Config(vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                  linear_k_heads=2, linear_v_heads=4, linear_k_dim=32, linear_v_dim=32, max_seq_len=4096,
                  variant="qwen3_5", tie_embeddings=True)  # fmt: skip


def debug_moe() -> Config:
    """Tiny Qwen3.5-MoE: :func:`debug` with 8 experts top 2 and a gated shared expert in every layer."""
    return attrs.evolve(debug(), n_experts=8, top_k=2, expert_dim=128, shared_expert_dim=128, ffn_dim=128,
                        tie_embeddings=False)  # fmt: skip


FLAVORS = {
    "debug": debug, "debug_moe": debug_moe, "qwen3_5_0_8b": qwen3_5_0_8b, "qwen3_5_2b": qwen3_5_2b,
    "qwen3_5_4b": qwen3_5_4b, "qwen3_5_9b": qwen3_5_9b, "qwen3_5_27b": qwen3_5_27b,
    "qwen3_5_35b_a3b": qwen3_5_35b_a3b, "qwen3_5_122b_a10b": qwen3_5_122b_a10b,
    "qwen3_5_397b_a17b": qwen3_5_397b_a17b,
}  # fmt: skip
