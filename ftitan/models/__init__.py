"""Model families as pure functions: ``family.model(cfg) -> Model``.

``llama``: Llama 3 / 3.1 / 3.2. ``qwen3``: Qwen3 dense (QK-norm).
``qwen3_moe``: Qwen3-MoE. ``deepseek_v3``: DeepSeek-V3 (MLA + MoE), also
Moonlight and Kimi K2 / K2.5. ``hf``: Hugging Face name tables and
checkpoint import/export shared by all families. ``registry``: any
family's config -> its ``Model``, configs to and from dicts.
``from_pretrained(directory) -> (model, params)``: an HF model directory
or an ftitan run directory in one call.
"""

from ftitan.models import base, deepseek_v3, hf, llama, qwen3, qwen3_moe, registry
from ftitan.models import lora
from ftitan.models.base import Model
from ftitan.models.hf import config_from_hf, config_to_hf, from_hf, load_hf, save_hf, to_hf
from ftitan.models.pretrained import from_pretrained

__all__ = [
    "Model",
    "base",
    "config_from_hf",
    "config_to_hf",
    "deepseek_v3",
    "from_hf",
    "from_pretrained",
    "hf",
    "llama",
    "load_hf",
    "lora",
    "qwen3",
    "qwen3_moe",
    "registry",
    "save_hf",
    "to_hf",
]
