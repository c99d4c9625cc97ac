"""The rules table: logical axes -> mesh axes, resolved into a placement for every leaf.

Model code names logical axes only (``("heads", "embed")`` for ``wq``);
which mesh axes hold them is data, here. ``Rules`` is an ordered table of
``(logical_axis, mesh_axes)`` pairs plus path-pattern overrides. Resolution
walks a leaf's dims in order and gives each dim the mesh axes its rule lists,
skipping axes of size 1 and axes an earlier dim already took (so ``"embed"``
maps to ``dp_shard`` for weights, while an activation ``("batch", "seq",
"embed")`` whose batch already uses ``dp_shard`` keeps ``embed`` whole) --
MaxText's convention.

The result for a leaf is a :class:`Sharding`: the mesh axes of each dim; it
converts to DTensor placements with :meth:`Sharding.placements`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from ftitan import tree
from ftitan.parallel.dims import AXES

__all__ = ["Rules", "Sharding", "check_sharded", "default_rules", "dump", "local_slice", "resolve", "resolve_one"]

MeshAxes = tuple[str, ...]


def _as_rule_table(value: Any) -> tuple[tuple[str, MeshAxes], ...]:
    pairs = value.items() if isinstance(value, Mapping) else value
    out = []
    for logical, axes in pairs:
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        for a in axes:
            if a not in AXES:
                raise ValueError(f"rules: logical axis {logical!r} maps to unknown mesh axis {a!r}; mesh axes are {AXES}")
        out.append((str(logical), axes))
    return tuple(out)


def _as_overrides(value: Any) -> tuple[tuple[str, tuple[MeshAxes, ...]], ...]:
    pairs = value.items() if isinstance(value, Mapping) else value
    out = []
    for pattern, per_dim in pairs:
        dims = tuple(((d,) if isinstance(d, str) else tuple(d or ())) for d in per_dim)
        for d in dims:
            for a in d:
                if a not in AXES:
                    raise ValueError(f"rules override {pattern!r}: unknown mesh axis {a!r}; mesh axes are {AXES}")
        out.append((str(pattern), dims))
    return tuple(out)


@attrs.frozen
class Rules:
    """Ordered ``(logical_axis, mesh_axes)`` pairs, plus ``(path_glob, mesh_axes_per_dim)`` overrides.

    An override replaces the rules for every leaf whose dotted path matches
    its glob (first match wins), e.g. ``("layers.*.attn.wq", (("tp",), ()))``.
    """

    table: tuple[tuple[str, MeshAxes], ...] = attrs.field(converter=_as_rule_table)
    overrides: tuple[tuple[str, tuple[MeshAxes, ...]], ...] = attrs.field(default=(), converter=_as_overrides)

    def mesh_axes(self, logical: str, *, path: str = "<activation>") -> MeshAxes:
        """The mesh axes a logical axis maps to; raises naming ``path`` when it has no rule."""
        for name, axes in self.table:
            if name == logical:
                return axes
        raise ValueError(
            f"{path}: logical axis {logical!r} has no rule; add ({logical!r}, ('tp',)) to shard it over tp, "
            f"or ({logical!r}, ()) to replicate it: rules.with_rule({logical!r}, ...)"
        )

    def with_rule(self, logical: str, mesh_axes: str | Sequence[str]) -> Rules:
        """These rules with ``logical`` mapped to ``mesh_axes`` (replacing its rule, or appended)."""
        new = _as_rule_table([(logical, mesh_axes)])[0]
        names = [n for n, _ in self.table]
        table = [new if n == logical else (n, a) for n, a in self.table]
        if logical not in names:
            table.append(new)
        return Rules(tuple(table), self.overrides)

    def with_override(self, pattern: str, per_dim: Sequence[str | Sequence[str]]) -> Rules:
        """These rules with an override for leaves matching ``pattern`` (checked before older overrides)."""
        return Rules(self.table, _as_overrides([(pattern, per_dim)]) + self.overrides)


def default_rules() -> Rules:
    """The default table: FSDP over ``embed`` (or a LoRA rank), TP over heads / MLP width / vocab,
    EP over experts, CP over the sequence, sequence parallel for the residual stream."""
    return Rules(
        (
            # activations
            ("batch", ("dp_replicate", "dp_shard", "ep")),  # each data-parallel rank reads its own rows
            ("seq", ("cp",)),  # context parallel: head-tail chunks of the sequence
            ("norm_seq", ("cp", "tp")),  # residual stream between blocks: + sequence parallel over tp
            # weights
            ("vocab", ("tp",)),
            ("heads", ("tp",)),
            ("kv_heads", ("tp",)),
            ("mlp", ("tp",)),
            ("experts", ("ep",)),
            ("embed", ("dp_shard",)),  # FSDP: weights stored sharded along the model dim
            ("q_lora", ("dp_shard",)),  # MLA low-rank dims: FSDP where a weight has no embed dim
            ("kv_lora", ("dp_shard",)),
            ("norm", ()),  # norm scales are small: replicated
            # stacked q|k|v and gate|up rows (ftitan.models.fused): whole rows on every rank (their head
            # groups are not contiguous per tp rank: models.decoder refuses them under tp); FSDP splits "embed"
            ("fused_qkv", ()),
            ("fused_mlp", ()),
        )
    )


@attrs.frozen
class Sharding:
    """The mesh axes holding each dim of one tensor (``()``: that dim is whole on every rank)."""

    dims: tuple[MeshAxes, ...]

    def mesh_axes(self) -> tuple[str, ...]:
        """Every mesh axis some dim is split over."""
        return tuple(a for d in self.dims for a in d)

    def dim_of(self, axis: str) -> int | None:
        """The dim split over mesh ``axis``, or None."""
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def placements(self, axes: Sequence[str] = AXES) -> tuple[Placement, ...]:
        """DTensor placements, one per mesh axis of ``axes`` (default: all of ``AXES``)."""
        return tuple(Shard(d) if (d := self.dim_of(a)) is not None else Replicate() for a in axes)

    def local_shape(self, shape: Sequence[int], sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(s // math.prod(sizes[a] for a in d) for s, d in zip(shape, self.dims, strict=True))

    def __str__(self) -> str:
        parts = [f"{'x'.join(d)}" if d else "-" for d in self.dims]
        return "(" + ", ".join(parts) + ")"


def _sizes(mesh: Any) -> dict[str, int]:
    if isinstance(mesh, Mapping):
        return {a: int(mesh.get(a, 1)) for a in AXES}
    return {a: int(mesh[a].size()) for a in AXES}


def resolve_one(
    shape: Sequence[int],
    axes: Sequence[str | None],
    rules: Rules,
    mesh: Any,  # DeviceMesh, or {axis: size}
    *,
    path: str = "<activation>",
) -> Sharding:
    """The :class:`Sharding` of one tensor of ``shape`` whose dims have logical ``axes``."""
    sizes = _sizes(mesh)
    shape = tuple(shape)
    if len(axes) != len(shape):
        raise ValueError(f"{path}: {len(axes)} logical axes {tuple(axes)} for a tensor of shape {shape}")
    override = next((dims for pattern, dims in rules.overrides if tree.match(path, pattern)), None)
    if override is not None and len(override) != len(shape):
        raise ValueError(f"{path}: override gives {len(override)} dims for a tensor of shape {shape}")
    used: set[str] = set()
    dims = []
    for i, logical in enumerate(axes):
        if override is not None:
            wanted = override[i]
        else:
            wanted = () if logical is None else rules.mesh_axes(logical, path=path)
        # mesh order, outermost first: DTensor splits a dim over several axes in that order
        take = tuple(sorted((a for a in wanted if sizes[a] > 1 and a not in used), key=AXES.index))
        n = math.prod(sizes[a] for a in take)
        if shape[i] % n:
            name = f"logical axis {logical!r}" if logical is not None else "an unnamed axis"
            raise ValueError(
                f"{path}: dim {i} ({name}) has size {shape[i]}, which does not split evenly over mesh axes "
                f"{take} of size {n}; choose degrees that divide {shape[i]}, or override its placement: "
                f"rules.with_override({path!r}, ...)"
            )
        used.update(take)
        dims.append(take)
    return Sharding(tuple(dims))


def resolve(params: tree.Tree, axes: tree.Tree, rules: Rules, mesh: Any) -> tree.Tree:
    """Tree of :class:`Sharding` (one per leaf of ``params``; shapes read from the leaves, meta works)."""

    def one(path: str, x: Any, ax: Sequence[str | None]) -> Sharding:
        shape = tuple(x.shape) if hasattr(x, "shape") else tuple(x)
        return resolve_one(shape, ax, rules, mesh, path=path)

    return tree.map_with_path(one, params, axes)


def dump(shardings: tree.Tree) -> dict[str, str]:
    """``{path: placement}``, one line per leaf, for golden tests and reading a layout.

    ``"(tp, dp_shard)"``: dim 0 split over ``tp``, dim 1 over ``dp_shard``;
    ``-``: a dim held whole (replicated over every axis that splits no dim).
    """
    ps, ls, _ = tree.flatten_with_paths(shardings)
    return {p: str(s) for p, s in zip(ps, ls, strict=True)}


def check_sharded(
    params: tree.Tree, shardings: tree.Tree, mesh: Any, *, axis: str = "dp_shard", min_numel: int = 1 << 16
) -> None:
    """Raise if a leaf of ``min_numel`` elements or more is not split over ``axis`` (when it has size > 1).

    The "insufficiently sharded" check: a large weight silently replicated
    over the FSDP axis costs its full size on every rank.
    """
    if _sizes(mesh)[axis] == 1:
        return
    ps, ls, treedef = tree.flatten_with_paths(params)
    bad = [
        f"{p} {tuple(x.shape)} {s}"
        for p, x, s in zip(ps, ls, treedef.flatten_up_to(shardings), strict=True)
        if math.prod(x.shape) >= min_numel and axis not in s.mesh_axes()
    ]
    if bad:
        raise ValueError(
            f"insufficiently sharded: {len(bad)} leaves of >= {min_numel} elements are replicated over {axis!r}: "
            + "; ".join(bad)
            + f". Map one of their logical axes to {axis!r} in the rules, or override their placement"
        )


def local_slice(x: torch.Tensor, sharding: Sharding, coords: Mapping[str, int], sizes: Mapping[str, int]) -> torch.Tensor:
    """This rank's block of a full tensor ``x``: dim ``i`` split over its mesh axes in ``AXES`` order."""
    for i, d in enumerate(sharding.dims):
        if not d:
            continue
        n = math.prod(sizes[a] for a in d)
        index = 0
        for a in d:  # row-major over the axes, outermost first (DTensor's order for Shard on several axes)
            index = index * sizes[a] + coords[a]
        x = x.chunk(n, dim=i)[index]
    return x
