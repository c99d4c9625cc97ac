"""Muse Glimmer's HF name table and config conversion (``MuseGlimmerForConditionalGeneration``).

The HF checkpoint is the multimodal model: the text decoder lives under ``model.language_model.``, the
head is ``lm_head.weight``. As for ftitan's other multimodal families the table holds the ``*ForCausalLM``
names (``model.layers.{i}...``): ``hf.from_hf`` / ``load_hf`` read a multimodal checkpoint's text
decoder through ``hf.text_decoder`` (the vision tower, adapter and projection are left out). transformers
has no Muse Glimmer causal-LM class, so export writes the multimodal names (``hf.Family.export_prefix``:
``model.X`` -> ``model.language_model.X``): what ``hf.save_hf`` writes (the text weights and a
``muse_glimmer`` config whose ``text_config`` is this config, ``vision_config`` left to transformers'
default) loads with ``MuseGlimmerForConditionalGeneration.from_pretrained(directory)``, the vision tower
initialized afresh (transformers warns of its missing weights), and back with ``hf.load_hf``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ftitan.models import hf
from ftitan.models.muse_glimmer import FULL, SLIDING, Config, default_layer_rope_theta, model

__all__ = ["config_from_hf", "config_to_hf", "hf_weights"]

PREFIX = "model."  # the *ForCausalLM names; multimodal checkpoints' model.language_model. is read as this
_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.wg": "self_attn.gate_proj.weight",
    "attn.wo": "self_attn.o_proj.weight",
    "attn_post_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "mlp.w1": "mlp.gate_proj.weight",
    "mlp.w2": "mlp.down_proj.weight",
    "mlp.w3": "mlp.up_proj.weight",
    "mlp_post_norm": "post_feedforward_layernorm.weight",
}
# old exports' rotary buffers; a multimodal checkpoint's other towers are dropped by hf.text_decoder already
IGNORED = ("**.rotary_emb.inv_freq",)


def hf_weights(cfg: Config) -> list[hf.WeightMap]:
    """ftitan path <-> HF ``MuseGlimmerForConditionalGeneration`` checkpoint names (text decoder and head)."""
    table = {f"layers.{{i}}.{path}": f"{PREFIX}layers.{{i}}.{name}" for path, name in _LAYER.items()}
    return [
        hf.WeightMap(path="embed", names=(f"{PREFIX}embed_tokens.weight",)),
        hf.WeightMap(path="norm", names=(f"{PREFIX}norm.weight",)),
        hf.WeightMap(path="head", names=("lm_head.weight",)),
        *hf.per_layer(cfg.n_layers, table),
    ]


def text_config_to_hf(cfg: Config) -> dict[str, Any]:
    """``MuseGlimmerTextConfig`` fields, every layer's type and RoPE base spelled out."""
    windows, thetas = cfg.windows, cfg.thetas
    return {
        "model_type": "muse_glimmer_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_activation": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "post_norm_eps": cfg.post_norm_eps,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": cfg.window,
        "layer_types": [FULL if w is None else SLIDING for w in windows],
        "layer_rope_theta": [float(t) for t in thetas],
        "final_logit_softcapping": cfg.logit_softcap,
        "qk_scale_factor": cfg.qk_scale,
        "output_multiplier": cfg.output_multiplier,
    }


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """``MuseGlimmerConfig`` fields: the text decoder as ``text_config``."""
    return {
        "architectures": ["MuseGlimmerForConditionalGeneration"],
        "model_type": "muse_glimmer",
        "text_config": text_config_to_hf(cfg),
    }


def _refuse(key: str, got: Any, want: Any) -> None:
    raise ValueError(f"muse_glimmer: HF config {key}={got!r} is not supported by ftitan's muse_glimmer "
                     f"(needs {want!r})")  # fmt: skip


def _rope_theta(d: Mapping[str, Any]) -> float:
    rp = dict(d.get("rope_parameters") or {})
    if (kind := rp.get("rope_type", rp.get("type", "default"))) != "default":
        _refuse("rope_parameters.rope_type", kind, "default")
    return float(rp.get("rope_theta", d.get("rope_theta", 10_000.0)))


def _layer_rope_theta(d: Mapping[str, Any], theta: float, n_layers: int) -> tuple[float, ...]:
    """The per-layer bases as transformers 5.19 runs them: every non-zero entry at the global base.

    Its ``MuseGlimmerTextModel`` builds one rotary embedding from ``rope_parameters`` and reads
    ``layer_rope_theta`` only as NoPE (0) or not; a config whose non-zero entries differ from the
    global base would compute something other than what it says, so it is refused."""
    given = d.get("layer_rope_theta")
    if given is None:
        return default_layer_rope_theta(n_layers, theta)
    if len(given) != n_layers:
        raise ValueError(f"muse_glimmer: HF layer_rope_theta has {len(given)} entries for {n_layers} layers")
    if others := sorted({float(t) for t in given if t and not math.isclose(float(t), theta)}):
        raise ValueError(
            f"muse_glimmer: HF layer_rope_theta has bases {others} other than rope_parameters.rope_theta={theta}; "
            "transformers applies the global base on every non-NoPE layer, so the checkpoint's intent is ambiguous"
        )
    return tuple(float(t) and theta for t in given)


def config_from_hf(d: Mapping[str, Any]) -> Config:
    """A ``Config`` from an HF ``MuseGlimmerConfig`` dict (its ``text_config``) or a bare text config dict;
    refuses what ftitan's Muse Glimmer does not have."""
    d = d.get("text_config") or d
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    if absent := [k for k in required if k not in d]:
        raise ValueError(f"muse_glimmer: HF text config lacks {absent}")
    for key, want in (("attention_bias", False), ("hidden_activation", "silu"), ("tie_word_embeddings", False)):
        if (got := d.get(key, want)) != want:
            _refuse(key, got, want)
    n_layers, theta = d["num_hidden_layers"], _rope_theta(d)
    layer_types = d.get("layer_types")
    window = d.get("sliding_window", 2048)
    if window is None and layer_types is not None and SLIDING in layer_types:
        _refuse("sliding_window", None, "an int with sliding_attention layers")
    if d.get("final_logit_softcapping", 20.0) is None:
        _refuse("final_logit_softcapping", None, "a float")
    return Config(
        vocab_size=d["vocab_size"],
        dim=d["hidden_size"],
        n_layers=n_layers,
        n_heads=d["num_attention_heads"],
        n_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        ffn_dim=d["intermediate_size"],
        window=window or 2048,  # unused without sliding layers
        layer_types=layer_types,
        rope_theta=theta,
        layer_rope_theta=_layer_rope_theta(d, theta, n_layers),
        qk_scale=float(d.get("qk_scale_factor", 3.87)),
        output_multiplier=float(d.get("output_multiplier", 0.19611613513818404)),
        logit_softcap=float(d.get("final_logit_softcapping", 20.0)),
        norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        post_norm_eps=float(d.get("post_norm_eps", 1e-8)),
        max_seq_len=d.get("max_position_embeddings", 131_072),
        init_std=float(d.get("initializer_range", 0.02)),
    )


hf.register_family(
    hf.Family(
        name="muse_glimmer",
        config_type=Config,
        model_type="muse_glimmer",
        model=model,
        weights=hf_weights,
        config_to_hf=config_to_hf,
        config_from_hf=config_from_hf,
        ignored=lambda _cfg: IGNORED,
        export_prefix=hf.MULTIMODAL_TEXT,  # the only HF class is the multimodal one
    )
)
