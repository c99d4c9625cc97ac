"""Parameter specs: one declaration gives a leaf's shape, logical axes and init.

A layer describes its parameters as a tree of :class:`Param` specs; a model
assembles the layers' specs into one tree shaped like its params. From that
single tree come ``init`` (each leaf drawn from ``fold_in(key, path)``, so a
leaf's value depends only on the key and its own dotted path, never on the
rest of the tree or on how it is later sharded) and the logical axes
(``param_axes``), so the two can never disagree on structure.

>>> import torch, ftitan as ft
>>> from ftitan import nn
>>> specs = {"w": nn.linear_param(4, 8, axes=("mlp", "embed"))}
>>> params = nn.init(specs, ft.random.key(0))
>>> params["w"].shape, nn.axes(specs)["w"]
(torch.Size([8, 4]), ('mlp', 'embed'))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from ftitan import random, tree

__all__ = [
    "Initializer",
    "Param",
    "axes",
    "init",
    "normal_init",
    "ones_init",
    "shapes",
    "truncated_normal_init",
    "zeros_init",
]

# (key, shape, dtype, device) -> Tensor; must honour device="meta" (shape only)
Initializer = Callable[[torch.Tensor, tuple[int, ...], torch.dtype, "torch.device | str | None"], torch.Tensor]


def normal_init(std: float) -> Initializer:
    """N(0, std^2)."""

    def fn(key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
        return random.normal(key, shape, std=std, dtype=dtype, device=device)

    return fn


def truncated_normal_init(std: float, *, bound: float = 3.0) -> Initializer:
    """N(0, std^2) truncated to ``[-bound*std, bound*std]`` (TorchTitan's init)."""

    def fn(key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
        return random.truncated_normal(key, shape, std=std, bound=bound, dtype=dtype, device=device)

    return fn


def ones_init(_key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    return torch.ones(shape, dtype=dtype, device=device)


def zeros_init(_key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def _as_shape(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


def _as_axes(value: Any) -> tuple[str | None, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class Param:
    """Spec of one parameter leaf: shape, logical axis per dim, initializer.

    A ``Param`` is a leaf for optree (it is not a registered node), so a dict
    of ``Param`` has the same structure as the params it describes.
    """

    shape: tuple[int, ...] = attrs.field(converter=_as_shape)  # tensor shape, e.g. (out, in)
    axes: tuple[str | None, ...] = attrs.field(converter=_as_axes)  # logical axis name per dim
    init: Initializer = attrs.field(eq=False)  # (key, shape, dtype, device) -> Tensor

    def __attrs_post_init__(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ValueError(
                f"Param shape {self.shape} has {len(self.shape)} dims but axes {self.axes} name "
                f"{len(self.axes)}; give one logical axis (or None) per dim"
            )
        if any(d < 0 for d in self.shape):
            raise ValueError(f"Param shape {self.shape} has a negative dim")


def _is_param(x: Any) -> bool:
    return isinstance(x, Param)


def _check_specs(specs: tree.Tree) -> None:
    bad = [p for p, x in zip(*tree.flatten_with_paths(specs)[:2], strict=True) if not _is_param(x)]
    if bad:
        raise TypeError(f"spec tree leaves must be nn.Param; not at: {', '.join(p or '<root>' for p in bad)}")


def init(
    specs: tree.Tree,
    key: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tree.Tree:
    """Params for a spec tree; leaf ``path`` is drawn from ``random.fold_in(key, path)``.

    A lone ``Param`` (empty path) is drawn from ``key`` itself. With
    ``device="meta"`` only shapes are built: nothing is allocated. Nothing
    reads the key's value in Python, so ``torch.func.vmap(lambda k: init(specs, k))(keys)``
    gives one init per key (the stack of single inits) and ``init`` compiles
    with ``fullgraph=True``.
    """
    _check_specs(specs)

    def one(path: str, spec: Param) -> torch.Tensor:
        leaf_key = random.fold_in(key, path) if path else key
        x = spec.init(leaf_key, spec.shape, dtype, device)
        if tuple(x.shape) != spec.shape:
            raise ValueError(f"{path or '<root>'}: initializer returned shape {tuple(x.shape)}, spec says {spec.shape}")
        return x

    return tree.map_with_path(one, specs)


def axes(specs: tree.Tree) -> tree.Tree:
    """The tree of logical-axis tuples (same structure as the params)."""
    _check_specs(specs)
    return tree.map(lambda s: s.axes, specs)


def shapes(specs: tree.Tree) -> tree.Tree:
    """The tree of shape tuples (same structure as the params)."""
    _check_specs(specs)
    return tree.map(lambda s: s.shape, specs)
