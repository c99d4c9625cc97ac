"""Writing an HF model directory leaf by leaf: never the whole model in memory.

:func:`save_hf_streamed` is :func:`ftitan.models.hf.save_hf` for params
that are read one leaf at a time (a sharded checkpoint's ``Reader``). The
safetensors header is computed up front from shapes and dtypes alone (the
family's name table applied to meta tensors), then each leaf is read,
split into its HF tensors (``WeightMap.to_hf``) and appended, in header
order. The result is the same ``model.safetensors`` + ``config.json`` that
``transformers``' ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ftitan import random, tree
from ftitan.models.hf import CONFIG_FILE, WEIGHTS_FILE, _atomic_write, config_to_hf, export_name, family_of, to_hf

__all__ = ["save_hf_streamed"]

# safetensors' dtype names
_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}  # fmt: skip


def _header(tensors: dict[str, torch.Tensor]) -> bytes:
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for name, t in tensors.items():
        if t.dtype not in _CODES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name; cast the params first")
        end = start + t.numel() * t.element_size()
        doc[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [start, end]}
        start = end
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def _append(f: BinaryIO, name: str, t: torch.Tensor, want: torch.Tensor) -> None:
    if t.dtype != want.dtype or tuple(t.shape) != tuple(want.shape):
        raise ValueError(f"{name}: got {t.dtype}{list(t.shape)}, the header says {want.dtype}{list(want.shape)}")
    f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))


def save_hf_streamed(
    read_leaf: Callable[[str], torch.Tensor],
    cfg: Any,
    directory: str | os.PathLike[str],
    *,
    dtypes: dict[str, torch.dtype] | None = None,
) -> Path:
    """Write ``model.safetensors`` and ``config.json`` (what ``save_hf`` writes) reading one leaf at a time.

    ``read_leaf(path)``: the full tensor of params leaf ``path`` (``"layers.0.attn.wq"``), called once
    per leaf, in the family's name-table order; ``dtypes``: each leaf's dtype when it differs from the
    model's init (e.g. what a checkpoint's manifest records). Peak memory: one leaf and its HF tensors.
    """
    family = family_of(cfg)
    dtypes = dtypes or {}
    shapes = family.model(cfg).init(random.key(0), device="meta")
    meta = tree.map_with_path(lambda p, x: torch.empty(x.shape, dtype=dtypes.get(p, x.dtype), device="meta"), shapes)
    header = to_hf(meta, cfg)  # name -> meta tensor, in the order written below
    maps = [m for m in family.weights(cfg)]
    names = [export_name(family, n) for m in maps for n in m.names]
    empties = [n for n in header if n not in set(names)]  # family.empty(cfg): zero-size or zeros
    if names + empties != list(header):
        raise ValueError(f"{family.name}: to_hf's tensor order differs from its name table; fix {family.name}.weights")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    def write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(_header(header))
            for m in maps:
                leaf = read_leaf(m.path)
                parts = tuple(m.to_hf(leaf)) if m.to_hf else (leaf,)
                for name, t in zip(m.names, parts, strict=True):
                    name = export_name(family, name)
                    _append(f, name, t, header[name])
                del leaf, parts
            for name in empties:
                _append(f, name, torch.zeros(header[name].shape, dtype=header[name].dtype), header[name])
            f.flush()
            os.fsync(f.fileno())

    _atomic_write(out / WEIGHTS_FILE, write)
    hf_config = dict(config_to_hf(cfg))
    floats = [x.dtype for x in tree.leaves(meta) if x.is_floating_point()]
    if floats:
        hf_config["dtype"] = str(floats[0]).removeprefix("torch.")
    config_text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    _atomic_write(out / CONFIG_FILE, lambda p: Path(p).write_text(config_text))
    return out
