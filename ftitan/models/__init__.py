"""Model families as pure functions: ``family.model(cfg) -> Model``.

``llama``: Llama 3 / 3.1 / 3.2. ``hf``: Hugging Face name tables and
checkpoint import/export shared by all families.
"""

from ftitan.models import base, hf, llama
from ftitan.models.base import Model
from ftitan.models.hf import config_from_hf, config_to_hf, from_hf, load_hf, save_hf, to_hf

__all__ = [
    "Model",
    "base",
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "hf",
    "llama",
    "load_hf",
    "save_hf",
    "to_hf",
]
