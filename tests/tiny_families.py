"""Tiny configs of every registered model family, one table for every test that walks ``hf.families()``
(the transform matrix, bf16 precision, streaming loads, the fake-rank layouts): a family with new size
fields adds them to ``SHRINK`` once."""

from __future__ import annotations

from typing import Any

import attrs

from ftitan.models import hf

# tiny values for whichever of these fields a family's Config has
SHRINK: dict[str, Any] = {
    "vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "ffn_dim": 48,
    "n_experts": 4, "top_k": 2, "expert_dim": 16, "moe_ffn_dim": 16, "n_groups": 2, "topk_groups": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "max_seq_len": 64,
    # Qwen3-Next / Qwen3.5: one Gated DeltaNet and one attention layer in two
    "linear_k_heads": 2, "linear_v_heads": 4, "linear_k_dim": 8, "linear_v_dim": 8, "shared_expert_dim": 16,
    "attention_every": 2,
    # DeepSeek-V4
    "rope_dim": 4, "index_head_dim": 8, "index_heads": 2, "o_lora_rank": 8,
}  # fmt: skip


def family(name: str) -> hf.Family:
    """The registered family called ``name``."""
    return next(f for f in hf.families() if f.name == name)


def tiny_config(fam: hf.Family | str, **overrides: Any) -> Any:
    """``fam``'s debug config shrunk by ``SHRINK`` (and ``overrides``, e.g. ``n_layers=3``); per-layer kinds
    (DeepSeek-V4's ``layer_types``) cut to the layers kept."""
    fam = family(fam) if isinstance(fam, str) else fam
    cfg = fam.config_type.debug()
    fields = {f.name for f in attrs.fields(type(cfg))}
    values = {**SHRINK, **overrides}
    shrink = {k: v for k, v in values.items() if k in fields}
    if isinstance(getattr(cfg, "layer_types", None), tuple) and "layer_types" not in overrides:
        shrink["layer_types"] = cfg.layer_types[: values["n_layers"]]
    return attrs.evolve(cfg, **shrink)
