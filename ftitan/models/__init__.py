"""Model families as pure functions: ``family.model(cfg) -> Model``.

``llama``: Llama 3 / 3.1 / 3.2. ``qwen3``: Qwen3 dense (QK-norm).
``qwen3_moe``: Qwen3-MoE. ``deepseek_v3``: DeepSeek-V3 (MLA + MoE), also
Moonlight and Kimi K2 / K2.5 / K2.6 / K2.7 (``mtp``: its multi-token
prediction modules). ``deepseek_v4``: DeepSeek-V4 (compressed sparse
attention, hyper-connections, hash routing). ``muse_glimmer``: Muse
Glimmer's text decoder (sliding-window and global layers, gated attention).
``qwen3_next``: Qwen3-Next and Qwen3.5 (Gated DeltaNet hybrids; Qwen3.5's
flavors in ``qwen3_5``). ``hf``: Hugging Face name tables and
checkpoint import/export shared by all families. ``registry``: any
family's config -> its ``Model``, configs to and from dicts.
``from_pretrained(directory) -> (model, params)``: an HF model directory
or an ftitan run directory in one call.
"""

from ftitan.models import base, deepseek_v3, deepseek_v4, hf, llama, muse_glimmer, qwen3, qwen3_5, qwen3_moe, qwen3_next
from ftitan.models import lora, registry
from ftitan.models.base import Model
from ftitan.models.hf import config_from_hf, config_to_hf, from_hf, load_hf, save_hf, to_hf
from ftitan.models.pretrained import from_pretrained

__all__ = [
    "Model",
    "base",
    "config_from_hf",
    "config_to_hf",
    "deepseek_v3",
    "deepseek_v4",
    "from_hf",
    "from_pretrained",
    "hf",
    "llama",
    "load_hf",
    "lora",
    "muse_glimmer",
    "qwen3",
    "qwen3_5",
    "qwen3_moe",
    "qwen3_next",
    "registry",
    "save_hf",
    "to_hf",
]
