"""Which ftitan families run inside vLLM, under which architecture names, and what vLLM's CPU
attention accepts. Plain data and checks: importing this does not import vLLM."""

from __future__ import annotations

from typing import Any

from ftitan.models import hf

__all__ = ["ARCHITECTURES", "CPU_HEAD_DIMS", "architecture_of", "check_supported"]

# ftitan family name -> the vLLM architecture name its class is registered under
ARCHITECTURES = {
    "llama": "FtitanLlamaForCausalLM",
    "qwen3": "FtitanQwen3ForCausalLM",
    "qwen3_moe": "FtitanQwen3MoeForCausalLM",
}

# head sizes vLLM 0.32's CPU attention backend has kernels for
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def architecture_of(cfg: Any) -> str:
    """The vLLM architecture name of a ftitan config's family; ValueError for a family without one."""
    family = hf.family_of(cfg).name
    if family not in ARCHITECTURES:
        raise ValueError(
            f"ftitan.vllm: family {family!r} does not run inside vLLM yet (supported: {sorted(ARCHITECTURES)}); "
            "its attention is not the GQA layout vLLM's paged Attention caches"
        )
    return ARCHITECTURES[family]


def check_supported(cfg: Any, *, cpu: bool) -> str:
    """The architecture name (:func:`architecture_of`), after checking ``cfg.head_dim`` is a size vLLM's
    CPU attention supports (when ``cpu``); the error names the config field to change."""
    arch = architecture_of(cfg)
    family, head_dim = hf.family_of(cfg).name, cfg.head_dim
    if cpu and head_dim not in CPU_HEAD_DIMS:
        if family == "llama":  # head_dim is derived there
            field = f"llama.Config: head_dim = dim // n_heads = {cfg.dim} // {cfg.n_heads} = {head_dim}"
            fix = "change dim or n_heads so that dim // n_heads is"
        else:
            field = f"{family}.Config.head_dim={head_dim}"
            fix = "set head_dim to"
        raise ValueError(f"{field}: vLLM's CPU attention supports head sizes {CPU_HEAD_DIMS} only; {fix} one of them")
    return arch
