"""Any family's config -> its ``Model``, and configs to and from plain dicts.

Runs and checkpoints store a model config as ``{"family": "llama", ...fields}``
(JSON-friendly); :func:`config_from_dict` rebuilds the frozen config,
nested attrs fields (rope scaling, MoE settings) included.

>>> from ftitan.models import llama, registry
>>> d = registry.config_to_dict(llama.Config.debug())
>>> d["family"], registry.config_from_dict(d) == llama.Config.debug()
('llama', True)
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

import attrs

from ftitan.models import hf
from ftitan.models.base import Model

__all__ = ["config_from_dict", "config_to_dict", "family_name", "model_for"]


def family_name(cfg: Any) -> str:
    """The family module's name (``"llama"``, ``"qwen3_moe"``, ...) of a config instance."""
    return hf.family_of(cfg).name


def model_for(cfg: Any) -> Model:
    """``family.model(cfg)`` for whichever registered family ``cfg`` belongs to."""
    return hf.family_of(cfg).model(cfg)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """``{"family": name, **fields}`` with nested attrs configs as dicts."""
    return {"family": family_name(cfg), **attrs.asdict(cfg)}


def _attrs_class_of(hint: Any) -> type | None:
    if attrs.has(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(hint) if attrs.has(a)]
        if len(found) == 1:
            return found[0]
    return None


def _structure(cls: type, d: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in attrs.fields(cls):
        if f.name not in d:
            continue
        value = d[f.name]
        nested = _attrs_class_of(hints.get(f.name))
        kwargs[f.name] = _structure(nested, value) if nested is not None and isinstance(value, Mapping) else value
    return cls(**kwargs)


def config_from_dict(d: Mapping[str, Any]) -> Any:
    """The config :func:`config_to_dict` wrote (a dict without ``"family"`` is read as Llama, as older runs wrote)."""
    d = dict(d)
    name = d.pop("family", "llama")
    known = {f.name: f for f in hf.families()}
    if name not in known:
        raise ValueError(f"model family {name!r} is not registered; known: {sorted(known)}")
    return _structure(known[name].config_type, d)
