"""Muon for hidden matrices, AdamW for the rest: the standard Muon recipe.

Jordan et al. 2024 apply Muon to the hidden layers' matrices only; the
embedding, the output head and every vector (norm scales, biases) use
AdamW. Liu et al. 2025 (Moonlight) train that split at scale with
``shape_scaling="match_rms_adamw"``, so that both halves share one lr and
weight decay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from ftitan import tree
from ftitan.optim.adam import adamw
from ftitan.optim.multi_transform import Labels, multi_transform, resolve_labels
from ftitan.optim.muon import Blocks, NesterovStyle, ShapeScaling, muon
from ftitan.optim.schedules import Schedule
from ftitan.optim.transform import Params, Transform

__all__ = ["ADAMW_PATH_NAMES", "muon_label", "muon_labels", "muon_with_adamw"]

ADAMW_PATH_NAMES = frozenset(
    {
        "embed",
        "embedding",
        "embeddings",
        "embed_tokens",
        "tok_embeddings",
        "wte",
        "wpe",
        "head",
        "lm_head",
        "output",
    }
)
"""Path components that mark a matrix as an embedding or output head (-> AdamW)."""


def muon_label(path: str, leaf: torch.Tensor) -> Literal["muon", "adamw"]:
    """``"muon"`` for a hidden matrix (ndim >= 2), ``"adamw"`` for everything else.

    Everything else is: vectors and scalars (norm scales, biases) and any leaf
    with a path component in :data:`ADAMW_PATH_NAMES` (``embed``,
    ``tok_embeddings``, ``head``, ``lm_head``, ``output``, ...). Stacked MoE
    experts (E, m, n) are hidden matrices.
    """
    if leaf.ndim < 2 or any(part in ADAMW_PATH_NAMES for part in path.split(".")):
        return "adamw"
    return "muon"


def muon_labels(params: Params) -> Any:
    """:func:`muon_label` of every leaf: a tree of ``"muon"`` / ``"adamw"`` like ``params``.

    For inspection and eager use; inside a compiled step pass :func:`muon_label`
    to ``multi_transform`` (dynamo cannot unflatten a tree of str leaves).
    """
    return tree.map_with_path(muon_label, params)


def muon_with_adamw(
    params: Params | None = None,
    *,
    lr: float | Schedule,
    adamw_lr: float | Schedule | None = None,
    weight_decay: float = 0.1,
    adamw_weight_decay: float | None = None,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_dtype: torch.dtype = torch.bfloat16,
    shape_scaling: ShapeScaling = "original",
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    labels: Labels = muon_label,
    ns_eps: float = 1e-7,
    nesterov_style: NesterovStyle = "torch",
    blocks: Blocks | None = None,
    muon_impl: Callable[..., Transform] = muon,
    adamw_impl: Callable[..., Transform] = adamw,
) -> Transform:
    """Muon on hidden matrices, AdamW on embeddings, head, norms and biases.

    ``multi_transform({"muon": muon(...), "adamw": adamw(...)}, labels)``.
    ``adamw_lr`` and ``adamw_weight_decay`` default to ``lr`` and
    ``weight_decay``, which suits ``shape_scaling="match_rms_adamw"``
    (Moonlight); with ``"original"`` Muon lrs are ~10-100x AdamW's, so pass
    ``adamw_lr``. AdamW betas default to (0.9, 0.95) as in Moonlight; ``eps``
    is AdamW's, ``ns_eps`` Newton-Schulz's norm clamp, and
    ``nesterov_style`` Muon's momentum convention and ``blocks`` its per-block matrices (per head; see
    :func:`scale_by_muon`); ``muon_impl`` and ``adamw_impl`` build the two parts
    (``ftitan.flexshard.muon_with_adamw`` passes a distributed Muon; the trainer an AdamW on local shards).
    Given ``params`` (or ``None``), the labels are resolved and checked now,
    so a bad labelling fails at construction rather than in the first step.
    """
    if params is not None:
        for path, label in resolve_labels(labels, params):
            if label not in ("muon", "adamw"):
                raise ValueError(f"{path}: label {label!r}; muon_with_adamw labels must be 'muon' or 'adamw'")
    return multi_transform(
        {
            "muon": muon_impl(
                lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                ns_dtype=ns_dtype,
                shape_scaling=shape_scaling,
                eps=ns_eps,
                nesterov_style=nesterov_style,
                blocks=blocks,
            ),
            "adamw": adamw_impl(
                lr if adamw_lr is None else adamw_lr,
                b1=b1,
                b2=b2,
                eps=eps,
                weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            ),
        },
        labels,
    )
