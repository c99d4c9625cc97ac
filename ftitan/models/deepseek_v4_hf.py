"""DeepSeek-V4 <-> Hugging Face ``DeepseekV4ForCausalLM``: config fields and the checkpoint name table.

Names are those ``save_pretrained`` writes and ``from_pretrained`` reads
(transformers 5.19 renames DeepSeek's original names on load and back on
save): ``model.layers.{i}.attn.wq_a.weight``, ``...ffn.experts.{e}.w1.weight``,
``...hc_attn_fn``, ``head.weight``. ``hash_table`` leaves (float32 here)
are the int64 ``ffn.gate.tid2eid`` tensors; ``router_bias`` is
``ffn.gate.bias``. The ``"module"`` layout (a live model's fused
``gate_up_proj``) is not supported for this family; the published hub
files are FP8/FP4-quantized and must be dequantized first (refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ftitan.models import deepseek_v4 as v4
from ftitan.models import hf
from ftitan.nn.rope import YarnRopeScaling

__all__ = ["config_from_hf", "config_to_hf", "hf_weights"]

_KIND_TO_HF = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
               "hca": "heavily_compressed_attention"}  # fmt: skip
_KIND_FROM_HF = {v: k for k, v in _KIND_TO_HF.items()}
_ATTN = {"wq_a": "wq_a.weight", "q_norm": "q_norm.weight", "wq_b": "wq_b.weight", "wkv": "wkv.weight",
         "kv_norm": "norm.weight", "wo_a": "wo_a.weight", "wo_b": "wo_b.weight", "sinks": "attn_sink"}  # fmt: skip
_COMPRESSOR = {"wkv": "wkv.weight", "wgate": "wgate.weight", "ape": "ape", "norm": "norm.weight"}
_HC = {"fn": "fn", "base": "base", "scale": "scale"}


def _rename(path: str, name: str) -> hf.WeightMap:
    return hf.WeightMap(path=path, names=(name,))


def _hash_table(path: str, name: str) -> hf.WeightMap:
    # ids rounded as hash_moe.route reads them (a float entry nudged below its id keeps it)
    return hf.WeightMap(path=path, names=(name,), to_hf=lambda x: (x.round().to(torch.int64),),
                        from_hf=lambda ts: ts[0].to(torch.float32))  # fmt: skip


def _layer(cfg: v4.Config, i: int) -> list[hf.WeightMap]:
    return _block(cfg, f"layers.{i}", f"model.layers.{i}", cfg.layer_types[i], hashed=i < cfg.n_hash_layers)


def _block(cfg: v4.Config, at: str, pre: str, kind: str, *, hashed: bool) -> list[hf.WeightMap]:
    maps = [_rename(f"{at}.attn_norm", f"{pre}.attn_norm.weight"), _rename(f"{at}.mlp_norm", f"{pre}.ffn_norm.weight")]
    maps += [_rename(f"{at}.attn_hc.{k}", f"{pre}.hc_attn_{n}") for k, n in _HC.items()]
    maps += [_rename(f"{at}.mlp_hc.{k}", f"{pre}.hc_ffn_{n}") for k, n in _HC.items()]
    maps += [_rename(f"{at}.attn.{k}", f"{pre}.attn.{n}") for k, n in _ATTN.items()]
    if kind != "sliding":
        maps += [_rename(f"{at}.attn.compressor.{k}", f"{pre}.attn.compressor.{n}") for k, n in _COMPRESSOR.items()]
    if kind == "csa":
        maps += [_rename(f"{at}.attn.indexer.compressor.{k}", f"{pre}.attn.indexer.compressor.{n}")
                 for k, n in _COMPRESSOR.items()]  # fmt: skip
        maps += [_rename(f"{at}.attn.indexer.wq_b", f"{pre}.attn.indexer.wq_b.weight"),
                 _rename(f"{at}.attn.indexer.weights_proj", f"{pre}.attn.indexer.weights_proj.weight")]  # fmt: skip
    maps.append(_rename(f"{at}.moe.router", f"{pre}.ffn.gate.weight"))
    if hashed:
        maps.append(_hash_table(f"{at}.moe.hash_table", f"{pre}.ffn.gate.tid2eid"))
    else:
        maps.append(_rename(f"{at}.moe.router_bias", f"{pre}.ffn.gate.bias"))
    d, f = cfg.dim, cfg.expert_dim
    for w, shape in (("w1", (f, d)), ("w2", (d, f)), ("w3", (f, d))):
        names = tuple(f"{pre}.ffn.experts.{e}.{w}.weight" for e in range(cfg.n_experts))
        maps.append(hf.stacked(f"{at}.moe.experts.{w}", names, shape))
        maps.append(_rename(f"{at}.moe.shared.{w}", f"{pre}.ffn.shared_experts.{w}.weight"))
    return maps


def hf_weights(cfg: v4.Config) -> list[hf.WeightMap]:
    """ftitan path <-> the checkpoint names ``DeepseekV4ForCausalLM.save_pretrained`` writes."""
    maps = [
        _rename("embed", "model.embed_tokens.weight"),
        _rename("norm", "model.norm.weight"),
        _rename("head", "head.weight"),
        *[_rename(f"hc_head.{k}", f"model.hc_head.hc_{k}") for k in _HC],
    ]
    for i in range(cfg.n_layers):
        maps += _layer(cfg, i)
    for k in range(cfg.n_mtp_layers):
        maps += _mtp(cfg, k)
    return maps


def _mtp(cfg: v4.Config, k: int) -> list[hf.WeightMap]:
    """MTP module ``k`` under the hub's names (``mtp.{k}.*``; transformers ignores them on load)."""
    pre, at = f"mtp.{k}", f"mtp.{k}"
    maps = [_rename(f"{at}.{n}", f"{pre}.{n}.weight") for n in ("enorm", "hnorm", "e_proj", "h_proj", "norm")]
    maps += [_rename(f"{at}.hc_head.{n}", f"{pre}.hc_head_{n}") for n in _HC]
    for m in _block(cfg, f"{at}.block", pre, "sliding", hashed=False):
        maps.append(attrs.evolve(m, names=tuple(n.replace(".attn.norm.", ".attn.kv_norm.") for n in m.names)))
    return maps


def _rope(theta: float, factor: float, scaling: YarnRopeScaling | None) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta), "partial_rotary_factor": factor}
    if scaling is not None:
        fields = {k: v for k, v in attrs.asdict(scaling).items() if v is not None}
        if fields.get("truncate", True):
            fields.pop("truncate", None)
        rope = {**rope, **fields, "rope_type": "yarn", "attention_factor": 1.0}
    return rope


def config_to_hf(cfg: v4.Config) -> dict[str, Any]:
    """``DeepseekV4Config`` fields (transformers 5.19)."""
    factor = cfg.rope_dim / cfg.head_dim
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "moe_intermediate_size": cfg.expert_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "partial_rotary_factor": factor,
        "num_experts_per_tok": cfg.top_k,
        "n_routed_experts": cfg.n_experts,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": float(cfg.routed_scale),
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": float(cfg.rope_theta),
        "layer_types": [_KIND_TO_HF[k] for k in cfg.layer_types],
        "compress_rates": {"compressed_sparse_attention": cfg.csa_rate, "heavily_compressed_attention": cfg.hca_rate},
        "compress_rope_theta": float(cfg.compress_rope_theta),
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "mlp_layer_types": ["hash_moe" if i < cfg.n_hash_layers else "moe" for i in range(cfg.n_layers)],
        "swiglu_limit": float(cfg.swiglu_limit),
        "sliding_window": cfg.window,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "index_n_heads": cfg.index_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "num_nextn_predict_layers": cfg.n_mtp_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        "rope_parameters": {"main": _rope(cfg.rope_theta, factor, None),
                            "compress": _rope(cfg.compress_rope_theta, factor, cfg.rope_scaling)},  # fmt: skip
    }


def _scaling_from_hf(compress: Mapping[str, Any]) -> YarnRopeScaling | None:
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"deepseek_v4: HF compress rope type {kind!r} is not supported (only 'default' and 'yarn')")
    if float(compress.get("attention_factor", 1.0)) != 1.0:
        raise ValueError("deepseek_v4: HF compress rope attention_factor != 1 is not supported (V4 uses 1.0)")
    floats = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    kw: dict[str, Any] = {k: float(compress[k]) for k in floats if compress.get(k) is not None}
    kw["original_max_position_embeddings"] = int(compress["original_max_position_embeddings"])
    if "truncate" in compress:
        kw["truncate"] = bool(compress["truncate"])
    return YarnRopeScaling(**kw, attention_factor=1.0)


def _layer_types(d: Mapping[str, Any], n: int) -> tuple[str, ...]:
    types = d.get("layer_types")
    if types is None and d.get("compress_ratios") is not None:  # legacy per-layer ints
        types = [{0: "sliding_attention", 4: "compressed_sparse_attention",
                  128: "heavily_compressed_attention"}[r] for r in d["compress_ratios"]]  # fmt: skip
    if types is None:
        return tuple(["hca"] * min(n, 2) + ["csa" if i % 2 else "hca" for i in range(max(n - 2, 0))])
    if bad := [t for t in types if t not in _KIND_FROM_HF]:
        raise ValueError(f"deepseek_v4: HF layer_types {bad} unknown; expected {sorted(_KIND_FROM_HF)}")
    return tuple(_KIND_FROM_HF[t] for t in types[:n])


def _n_hash(d: Mapping[str, Any], n: int) -> int:
    mlp = d.get("mlp_layer_types")
    if mlp is None:
        return min(n, int(d.get("num_hash_layers", 3)))
    k = sum(1 for t in mlp if t == "hash_moe")
    if list(mlp[:n]) != ["hash_moe"] * k + ["moe"] * (n - k):
        raise ValueError(f"deepseek_v4: HF mlp_layer_types {mlp!r}: only leading hash_moe layers are supported")
    return k


def config_from_hf(d: Mapping[str, Any]) -> v4.Config:
    """A ``Config`` from an HF ``DeepseekV4Config`` dict (its defaults filled in); refuses what ftitan lacks.
    ``n_mtp_layers`` is 0 whatever ``num_nextn_predict_layers`` says: transformers' checkpoints have no MTP
    weights, and the hub's are quantized."""
    if d.get("quantization_config"):
        raise ValueError("deepseek_v4: the checkpoint is quantized (FP8/FP4); ftitan loads bf16/fp32 weights only: "
                         "dequantize it first")  # fmt: skip
    unsupported = {"scoring_func": "sqrtsoftplus", "hidden_act": "silu", "tie_word_embeddings": False,
                   "num_key_value_heads": 1, "attention_bias": False, "mlp_bias": False}  # fmt: skip
    for key, want in unsupported.items():
        if d.get(key, want) != want:
            raise ValueError(f"deepseek_v4: HF config {key}={d[key]!r} is not supported (needs {want!r})")
    n, head_dim = d.get("num_hidden_layers", 43), d.get("head_dim", 512)
    rope = d.get("rope_parameters") or {}
    compress = rope.get("compress") if isinstance(rope.get("compress"), dict) else rope
    factor = (compress or {}).get("partial_rotary_factor", d.get("partial_rotary_factor") or 64 / 512)
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(d.get("compress_rates") or {})}
    return v4.Config(
        vocab_size=d.get("vocab_size", 129_280), dim=d.get("hidden_size", 4096), n_layers=n,
        n_heads=d.get("num_attention_heads", 64), head_dim=head_dim, rope_dim=int(head_dim * factor),
        q_lora_rank=d.get("q_lora_rank", 1024), o_groups=d.get("o_groups", 8), o_lora_rank=d.get("o_lora_rank", 1024),
        layer_types=_layer_types(d, n), csa_rate=rates["compressed_sparse_attention"],
        hca_rate=rates["heavily_compressed_attention"], window=d.get("sliding_window", 128),
        index_heads=d.get("index_n_heads", 64), index_head_dim=d.get("index_head_dim", 128),
        index_topk=d.get("index_topk", 512), n_experts=d.get("n_routed_experts", 256),
        top_k=d.get("num_experts_per_tok", 6), expert_dim=d.get("moe_intermediate_size", 2048),
        n_hash_layers=_n_hash(d, n), routed_scale=float(d.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(d.get("swiglu_limit", 10.0)), hc_mult=d.get("hc_mult", 4),
        hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", 20), hc_eps=float(d.get("hc_eps", 1e-6)),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float((rope.get("main") or {}).get("rope_theta", d.get("rope_theta", 10_000.0))),
        compress_rope_theta=float((compress or {}).get("rope_theta", d.get("compress_rope_theta", 160_000.0))),
        rope_scaling=_scaling_from_hf(compress or {}), max_seq_len=d.get("max_position_embeddings", 1_048_576),
        n_mtp_layers=0, init_std=float(d.get("initializer_range", 0.02)),
    )  # fmt: skip


def _ignored(cfg: v4.Config) -> tuple[str, ...]:
    return ("mtp.**", "model.mtp.**")  # MTP modules: imported configs have n_mtp_layers=0 (transformers has none)


hf.register_family(
    hf.Family(
        name="deepseek_v4",
        config_type=v4.Config,
        model_type="deepseek_v4",
        model=v4.model,
        weights=hf_weights,
        config_to_hf=config_to_hf,
        config_from_hf=config_from_hf,
        ignored=_ignored,
    )
)
