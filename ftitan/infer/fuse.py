"""Fused projections for inference: ``[wq; wk; wv] -> wqkv`` and ``[w1; w3] -> w13``, one matmul each.

At decode time a step is a handful of skinny matmuls per layer; stacking the
ones that read the same input (q/k/v, gate/up) makes fewer and wider ones, as
inference engines do. The model functions accept either layout
(``decoder.attention`` reads ``wqkv``, ``nn.swiglu`` reads ``w13``), so this
is a pure transform of the params tree, not a second model. Training keeps
the separate leaves (their shardings and HF names).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ftitan import tree

__all__ = ["FUSED", "fuse_projections", "fused_slices"]

# fused leaf -> the leaves it stacks along the output dimension, in order
FUSED: dict[str, tuple[str, ...]] = {"wqkv": ("wq", "wk", "wv"), "w13": ("w1", "w3")}


def _fusable(node: Mapping[str, Any], parts: tuple[str, ...]) -> bool:
    leaves = [node.get(k) for k in parts]
    return all(isinstance(x, torch.Tensor) and x.dim() == 2 for x in leaves) and len(
        {x.shape[1] for x in leaves}) == 1  # fmt: skip


def _fuse(node: Any) -> Any:
    if not isinstance(node, Mapping):
        return node
    out = {k: _fuse(v) for k, v in node.items()}
    for fused, parts in FUSED.items():
        if _fusable(out, parts):
            out[fused] = torch.cat([out.pop(k) for k in parts])
    return out


def fuse_projections(params: tree.Tree) -> tree.Tree:
    """``params`` with every ``{wq, wk, wv}`` (2-D, same input width) stacked into ``wqkv`` and every
    ``{w1, w3}`` into ``w13`` (dense SwiGLUs; MoE experts are 3-D and stay). Pure (new tensors);
    already fused trees come back unchanged."""
    return _fuse(params)


def fused_slices(params: tree.Tree) -> dict[str, tuple[str, int, int]]:
    """For an unfused ``params`` tree: ``{leaf path: (fused path, first row, end row)}`` of each leaf
    :func:`fuse_projections` stacks, e.g. ``"layers.0.attn.wk" -> ("layers.0.attn.wqkv", 256, 320)``."""
    slices: dict[str, tuple[str, int, int]] = {}

    def visit(node: Any, prefix: str) -> None:
        if not isinstance(node, Mapping):
            return
        for fused, parts in FUSED.items():
            if _fusable(node, parts):
                row = 0
                for k in parts:
                    slices[prefix + k] = (prefix + fused, row, row + node[k].shape[0])
                    row += node[k].shape[0]
        for k, v in node.items():
            visit(v, f"{prefix}{k}.")

    visit(params, "")
    return slices
