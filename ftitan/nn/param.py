"""Parameter specs: one declaration gives a leaf's shape, logical axes and init.

A layer describes its parameters as a tree of :class:`Param` specs; a model
assembles the layers' specs into one tree shaped like its params. From that
single tree come ``init`` (each leaf drawn from ``fold_in(key, path)``, so a
leaf's value depends only on the key and its own dotted path, never on the
rest of the tree or on how it is later sharded) and the logical axes
(``param_axes``), so the two can never disagree on structure.

``init(specs, key, blocks={path: ((start, stop), ...)})`` draws only a block
of a leaf, bit-equal to that block of the whole draw: the per-rank sharded
init (:func:`ftitan.parallel.init_params`) builds on it. Every built-in
initializer computes just its block (the draws in :mod:`ftitan.random` are
counter-based); an initializer without a ``block`` parameter still works, by
drawing the whole leaf and slicing it.

>>> import torch, ftitan as ft
>>> from ftitan import nn
>>> specs = {"w": nn.linear_param(4, 8, axes=("mlp", "embed"))}
>>> params = nn.init(specs, ft.random.key(0))
>>> params["w"].shape, nn.axes(specs)["w"]
(torch.Size([8, 4]), ('mlp', 'embed'))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from ftitan import random, tree

__all__ = [
    "Block",
    "Initializer",
    "Param",
    "axes",
    "block_shape",
    "draw",
    "init",
    "normal_init",
    "ones_init",
    "shapes",
    "takes_block",
    "truncated_normal_init",
    "zeros_init",
]

# (start, stop) per dim, leading dims first (the rest whole): a block of a leaf, as ftitan.random takes it
Block = Sequence[tuple[int, int]]

# (key, shape, dtype, device[, *, block=None]) -> Tensor: the whole leaf of ``shape``, or only ``block`` of
# it when the initializer takes ``block=``; must honour device="meta" (shape only)
Initializer = Callable[..., torch.Tensor]


def normal_init(std: float) -> Initializer:
    """N(0, std^2); ``block=`` draws only that block (bit-equal to it in the whole draw)."""

    def fn(
        key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: Any, *, block: Block | None = None
    ) -> torch.Tensor:
        return random.normal(key, shape, std=std, dtype=dtype, device=device, block=block)

    return fn


def truncated_normal_init(std: float, *, bound: float = 3.0) -> Initializer:
    """N(0, std^2) truncated to ``[-bound*std, bound*std]`` (TorchTitan's init); ``block=``: see :func:`normal_init`."""

    def fn(
        key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: Any, *, block: Block | None = None
    ) -> torch.Tensor:
        return random.truncated_normal(key, shape, std=std, bound=bound, dtype=dtype, device=device, block=block)

    return fn


def ones_init(
    _key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: Any, *, block: Block | None = None
) -> torch.Tensor:
    return torch.ones(block_shape(shape, block), dtype=dtype, device=device)


def zeros_init(
    _key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: Any, *, block: Block | None = None
) -> torch.Tensor:
    return torch.zeros(block_shape(shape, block), dtype=dtype, device=device)


def block_shape(shape: Sequence[int], block: Block | None, *, where: str = "block") -> tuple[int, ...]:
    """The shape of ``block`` of a tensor of ``shape`` (``None``: the whole of it); raises on a bad block."""
    shape = tuple(int(d) for d in shape)
    spans = [(int(lo), int(hi)) for lo, hi in (block or ())]
    if len(spans) > len(shape):
        raise ValueError(f"{where}: block {spans} names {len(spans)} dims but shape {shape} has {len(shape)}")
    for dim, ((lo, hi), size) in enumerate(zip(spans, shape, strict=False)):
        if not 0 <= lo <= hi <= size:
            raise ValueError(
                f"{where}: block dim {dim} is ({lo}, {hi}) but shape {shape} has {size} there; "
                f"give 0 <= start <= stop <= {size}"
            )
    return tuple(hi - lo for lo, hi in spans) + shape[len(spans) :]


def takes_block(initializer: Initializer) -> bool:
    """Whether ``initializer`` draws a block itself (has a ``block`` parameter)."""
    try:
        return "block" in inspect.signature(initializer).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


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
    blocks: Mapping[str, Block] | None = None,
) -> tree.Tree:
    """Params for a spec tree; leaf ``path`` is drawn from ``random.fold_in(key, path)``.

    A lone ``Param`` (empty path) is drawn from ``key`` itself. With
    ``device="meta"`` only shapes are built: nothing is allocated. Nothing
    reads the key's value in Python, so ``torch.func.vmap(lambda k: init(specs, k))(keys)``
    gives one init per key (the stack of single inits) and ``init`` compiles
    with ``fullgraph=True``.

    ``blocks`` (``{path: ((start, stop), ...)}``, leading dims; a leaf not named is drawn whole)
    gives only those blocks of the leaves, each bit-equal to that block of the whole draw
    (``init(specs, key)["w"][a:b, c:d]``) and computed without the rest, except for an
    initializer that takes no ``block=`` (it draws the whole leaf, then the block is copied out).
    """
    _check_specs(specs)
    blocks = dict(blocks or {})
    if blocks:
        unknown = sorted(set(blocks) - set(tree.flatten_with_paths(specs)[0]))
        if unknown:
            raise ValueError(f"init: blocks name paths that are not leaves of the specs: {', '.join(unknown)}")

    def one(path: str, spec: Param) -> torch.Tensor:
        leaf_key = random.fold_in(key, path) if path else key
        return draw(spec, leaf_key, dtype=dtype, device=device, block=blocks.get(path), path=path)

    return tree.map_with_path(one, specs)


def draw(
    spec: Param,
    key: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    block: Block | None = None,
    path: str = "",
) -> torch.Tensor:
    """One leaf of ``spec`` from its own key (``fold_in(key, path)`` in :func:`init`), or ``block`` of it."""
    where = path or "<root>"
    want = block_shape(spec.shape, block, where=where)
    if block is None or want == spec.shape:
        x = spec.init(key, spec.shape, dtype, device)
        if tuple(x.shape) != spec.shape:
            raise ValueError(f"{where}: initializer returned shape {tuple(x.shape)}, spec says {spec.shape}")
        return x
    if takes_block(spec.init):
        x = spec.init(key, spec.shape, dtype, device, block=tuple(block))
    else:  # fallback: the whole leaf, then a copy of the block (the whole leaf is freed on return)
        full = spec.init(key, spec.shape, dtype, device)
        if tuple(full.shape) != spec.shape:
            raise ValueError(f"{where}: initializer returned shape {tuple(full.shape)}, spec says {spec.shape}")
        x = full[tuple(slice(lo, hi) for lo, hi in block)].clone()
    if tuple(x.shape) != want:
        raise ValueError(f"{where}: initializer returned shape {tuple(x.shape)} for block {tuple(block)}, want {want}")
    return x


def axes(specs: tree.Tree) -> tree.Tree:
    """The tree of logical-axis tuples (same structure as the params)."""
    _check_specs(specs)
    return tree.map(lambda s: s.axes, specs)


def shapes(specs: tree.Tree) -> tree.Tree:
    """The tree of shape tuples (same structure as the params)."""
    _check_specs(specs)
    return tree.map(lambda s: s.shape, specs)
