"""HF checkpoints of ``qwen3_next.Config`` models: ``Qwen3NextForCausalLM`` (``qwen3_next``),
``Qwen3_5ForCausalLM`` (``qwen3_5_text``), ``Qwen3_5MoeForCausalLM`` (``qwen3_5_moe_text``), and the text
decoder of the published multimodal checkpoints ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration`` (``qwen3_5`` / ``qwen3_5_moe``: config under ``text_config``,
weights under ``model.language_model.``, read by ``hf.text_decoder``; the vision tower and the MTP head
are skipped).

Two permutations: the linear attention's conv (and Qwen3.5's ``in_proj_qkv``) stores its channels as
``[q of every key head, k of every key head, v of every value head]``, ftitan groups them per key head
(``[q_h, k_h, v of its value heads]``) so that a contiguous split over tensor parallelism keeps whole
groups. Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` are already grouped that way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ftitan.models import decoder, hf, qwen3
from ftitan.models.qwen3_next import Config, model

__all__ = ["config_from_hf", "config_to_hf", "hf_weights"]

def _grouped_rows(cfg: Config) -> list[int]:
    """The HF row of each ftitan row: HF holds ``[q of every key head; k of every key head; v of every value
    head]``, ftitan per key head ``[q_h; k_h; v of its value heads]``."""
    hk, dk = cfg.linear_k_heads, cfg.linear_k_dim
    rv = cfg.linear_v_heads // hk * cfg.linear_v_dim
    rows = []
    for h in range(hk):
        rows += [h * dk + j for j in range(dk)]
        rows += [hk * dk + h * dk + j for j in range(dk)]
        rows += [2 * hk * dk + h * rv + j for j in range(rv)]
    return rows


def _gdn_maps(cfg: Config, i: int, pre: str) -> list[hf.WeightMap]:
    la, path = f"{pre}layers.{i}.linear_attn", f"layers.{i}.gdn"
    rows = _grouped_rows(cfg)
    maps = [
        hf.permuted(f"{path}.conv", f"{la}.conv1d.weight", rows, hf_row=(1, cfg.conv_kernel)),
        *(hf.WeightMap(path=f"{path}.{leaf}", names=(f"{la}.{name}",)) for leaf, name in (
            ("A_log", "A_log"), ("dt_bias", "dt_bias"), ("norm", "norm.weight"), ("wo", "out_proj.weight"))),
    ]  # fmt: skip
    if cfg.variant == "qwen3_next":
        return maps + [hf.WeightMap(path=f"{path}.wqkvz", names=(f"{la}.in_proj_qkvz.weight",)),
                       hf.WeightMap(path=f"{path}.wba", names=(f"{la}.in_proj_ba.weight",))]  # fmt: skip
    return maps + [
        hf.permuted(f"{path}.wqkv", f"{la}.in_proj_qkv.weight", rows),
        *(hf.WeightMap(path=f"{path}.{leaf}", names=(f"{la}.in_proj_{name}.weight",)) for leaf, name in (
            ("wz", "z"), ("wb", "b"), ("wa", "a"))),
    ]  # fmt: skip


def _ffn_maps(cfg: Config, i: int, pre: str) -> list[hf.WeightMap]:
    mlp, path = f"{pre}layers.{i}.mlp", f"layers.{i}"
    projs = (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))
    if i not in cfg.moe_layers:
        return [hf.WeightMap(path=f"{path}.mlp.{leaf}", names=(f"{mlp}.{proj}.weight",)) for leaf, proj in projs]
    d, fe = cfg.dim, cfg.expert_dim
    maps = [hf.WeightMap(path=f"{path}.moe.router", names=(f"{mlp}.gate.weight",))]
    for leaf, proj in projs:
        shape = (d, fe) if leaf == "w2" else (fe, d)
        names = tuple(f"{mlp}.experts.{e}.{proj}.weight" for e in range(cfg.n_experts))
        maps.append(hf.stacked(f"{path}.moe.experts.{leaf}", names, shape))
    if cfg.shared_expert_dim:
        maps += [hf.WeightMap(path=f"{path}.moe.shared.{leaf}", names=(f"{mlp}.shared_expert.{proj}.weight",))
                 for leaf, proj in projs]  # fmt: skip
        maps.append(hf.WeightMap(path=f"{path}.moe.shared_gate", names=(f"{mlp}.shared_expert_gate.weight",)))
    return maps


def hf_weights(cfg: Config) -> list[hf.WeightMap]:
    """ftitan path <-> HF ``*ForCausalLM`` checkpoint names."""
    prefix = "model."
    maps = [hf.WeightMap(path="embed", names=(f"{prefix}embed_tokens.weight",)),
            hf.WeightMap(path="norm", names=(f"{prefix}norm.weight",))]  # fmt: skip
    if not cfg.tie_embeddings:
        maps.append(hf.WeightMap(path="head", names=("lm_head.weight",)))
    for i in range(cfg.n_layers):
        lay = f"{prefix}layers.{i}"
        maps += [hf.WeightMap(path=f"layers.{i}.attn_norm", names=(f"{lay}.input_layernorm.weight",)),
                 hf.WeightMap(path=f"layers.{i}.mlp_norm", names=(f"{lay}.post_attention_layernorm.weight",))]
        if i in cfg.attention_layers:
            maps += [hf.WeightMap(path=f"layers.{i}.attn.{leaf}", names=(f"{lay}.self_attn.{name}.weight",))
                     for leaf, name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"),
                                        ("q_norm", "q_norm"), ("k_norm", "k_norm"))]  # fmt: skip
        else:
            maps += _gdn_maps(cfg, i, prefix)
        maps += _ffn_maps(cfg, i, prefix)
    return maps


def _hf_type(cfg: Config) -> tuple[str, str]:
    """``(model_type, architecture)`` of the ``*ForCausalLM`` checkpoint ``cfg`` exports to."""
    if cfg.variant == "qwen3_next":
        return "qwen3_next", "Qwen3NextForCausalLM"
    if cfg.moe_layers:
        return "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"
    return "qwen3_5_text", "Qwen3_5ForCausalLM"


def _mrope_section(rope_dim: int) -> list[int]:
    """Qwen3.5's multimodal RoPE sections (text, height, width) over ``rope_dim / 2`` frequencies: [11, 11,
    10] for the published 64; text-only positions are equal in all three, so any split gives plain RoPE."""
    n = rope_dim // 2
    return [n - 2 * (n // 3), n // 3, n // 3]


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """The ``*ForCausalLM`` config dict (transformers 5 format, explicit ``layer_types``)."""
    model_type, arch = _hf_type(cfg)
    if model_type == "qwen3_5_moe_text" and cfg.dense_layers:
        raise ValueError(f"qwen3_next: Qwen3.5-MoE has an MoE in every layer; dense_layers={cfg.dense_layers} "
                         "cannot be exported (use variant='qwen3_next', which has mlp_only_layers)")  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta), "partial_rotary_factor": cfg.partial_rotary}
    if cfg.variant == "qwen3_5":
        rope |= {"mrope_section": _mrope_section(cfg.rope_dim), "mrope_interleaved": True}
    d = {
        "architectures": [arch], "model_type": model_type, **decoder.hf_common_to_hf(cfg),
        "rope_parameters": rope, "intermediate_size": cfg.ffn_dim,
        "layer_types": ["full_attention" if i in cfg.attention_layers else "linear_attention"
                        for i in range(cfg.n_layers)],
        "linear_conv_kernel_dim": cfg.conv_kernel, "linear_key_head_dim": cfg.linear_k_dim,
        "linear_value_head_dim": cfg.linear_v_dim, "linear_num_key_heads": cfg.linear_k_heads,
        "linear_num_value_heads": cfg.linear_v_heads,
    }  # fmt: skip
    if cfg.moe_layers:
        d |= {"moe_intermediate_size": cfg.expert_dim, "shared_expert_intermediate_size": cfg.shared_expert_dim,
              "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
              "router_aux_loss_coef": cfg.aux_loss_coef, "output_router_logits": False}  # fmt: skip
    if cfg.variant == "qwen3_next":
        d |= {"decoder_sparse_step": 1, "mlp_only_layers": list(cfg.dense_layers), "norm_topk_prob": cfg.norm_topk,
              "num_experts": cfg.n_experts}  # fmt: skip
    return d


def _attention_every(d: Mapping[str, Any], n_layers: int, family: str) -> int:
    """The ``full_attention_interval`` of HF ``layer_types`` (refusing patterns that are not one)."""
    types = d.get("layer_types")
    if types is None:
        return int(d.get("full_attention_interval", 4))
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if len(types) == n_layers and set(types) == {"linear_attention"}:
        return max(n_layers + 1, 4)  # no full attention (the published interval when that is still none)
    if len(types) != n_layers or not full or set(types) - {"full_attention", "linear_attention"}:
        raise ValueError(f"{family}: HF layer_types {types} is not a pattern of full_attention / linear_attention "
                         f"over {n_layers} layers")  # fmt: skip
    every = full[0] + 1
    if [(i + 1) % every == 0 for i in range(n_layers)] != [t == "full_attention" for t in types]:
        raise ValueError(f"{family}: HF layer_types put full attention at layers {full}; ftitan supports one "
                         "every k layers (the published pattern)")  # fmt: skip
    return every


def config_from_hf(d: Mapping[str, Any]) -> Config:
    """A ``Config`` from an HF config dict of any of the five model types (module docstring)."""
    model_type = d.get("model_type", "qwen3_next")
    if model_type in ("qwen3_5", "qwen3_5_moe"):  # multimodal: the text decoder's config
        d = {**d["text_config"], "tie_word_embeddings": d.get("tie_word_embeddings",
                                                              d["text_config"].get("tie_word_embeddings", False))}
    family = "qwen3_next"
    rope = d.get("rope_parameters") or {}
    common = qwen3.hf_common_from_hf({**d, "layer_types": None}, family)
    n_experts = int(d.get("num_experts") or 0)
    variant = "qwen3_next" if model_type == "qwen3_next" else "qwen3_5"
    if variant == "qwen3_5" and "moe" not in model_type:
        n_experts = 0
    if variant == "qwen3_next" and n_experts:
        step = d.get("decoder_sparse_step", 1)
        only = set(d.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(common["n_layers"]) if i in only or (i + 1) % step)
    else:
        dense = ()
    moe = dict(n_experts=n_experts, top_k=d.get("num_experts_per_tok", 1), expert_dim=d.get("moe_intermediate_size", 1),
               shared_expert_dim=d.get("shared_expert_intermediate_size", 0),
               norm_topk=bool(d.get("norm_topk_prob", True)),
               aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001))) if n_experts else {}  # fmt: skip
    return Config(
        **common, **moe, variant=variant, dense_layers=dense,
        ffn_dim=d.get("intermediate_size") or d.get("moe_intermediate_size"),
        linear_k_heads=d["linear_num_key_heads"], linear_v_heads=d["linear_num_value_heads"],
        linear_k_dim=d["linear_key_head_dim"], linear_v_dim=d["linear_value_head_dim"],
        conv_kernel=d.get("linear_conv_kernel_dim", 4), attention_every=_attention_every(d, common["n_layers"], family),
        partial_rotary=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
    )  # fmt: skip


def _ignored(cfg: Config) -> tuple[str, ...]:
    """The MTP head (not imported), rotary buffers, and the tied head some checkpoints store anyway."""
    return ("mtp.**", *decoder.hf_ignored(cfg))


def _family(model_type: str) -> hf.Family:
    return hf.Family(name="qwen3_next", config_type=Config, model_type=model_type, model=model, weights=hf_weights,
                     config_to_hf=config_to_hf, config_from_hf=config_from_hf, ignored=_ignored)  # fmt: skip


# import-only aliases first: the family registered last for the Config class is the one exports use
for _type in ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
    hf.register_family(_family(_type))
