"""``Layout``: a mesh and its rules, and the one active while a parallel step traces.

Model code does not take a mesh argument: the few places that need one (the
activation seams in :mod:`ftitan.parallel.activations`) read
:func:`current`, which is ``None`` outside a parallel step, so every seam is
a no-op in single-process code.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from ftitan.parallel import collectives as C

from ftitan.parallel.dims import AXES, DATA_AXES
from ftitan.parallel.rules import Rules, default_rules

__all__ = ["Layout", "current", "use"]


class Layout:
    """A ``DeviceMesh`` (axes ``AXES``) with the rules that place tensors on it.

    ``sizes`` / ``coords``: each axis's size and this rank's index on it.
    ``group(axis)``: the 1-D mesh of that axis (``None`` for size 1, which
    every collective treats as "nothing to do").
    """

    def __init__(self, mesh: DeviceMesh, rules: Rules | None = None) -> None:
        if tuple(mesh.mesh_dim_names or ()) != AXES:
            raise ValueError(f"Layout: mesh axes {mesh.mesh_dim_names} must be {AXES}; build it with parallel.mesh(...)")
        self.mesh = mesh
        self.rules = default_rules() if rules is None else rules
        self.sizes = {a: mesh[a].size() for a in AXES}
        self.coords = {a: mesh[a].get_local_rank() for a in AXES}
        self._groups = {a: mesh[a] for a in AXES if self.sizes[a] > 1}
        # DTensors live on the axes in use (DTensor's sharding propagation grows with the mesh's
        # dims, and a 6-dim mesh of mostly size-1 axes made an eager optimizer step take minutes);
        # pp is left out: each stage holds different params
        self.storage_axes = tuple(a for a in AXES if self.sizes[a] > 1 and a != "pp") or ("tp",)
        self.storage_mesh = mesh[self.storage_axes]

    def group(self, axis: str) -> DeviceMesh | None:
        return self._groups.get(axis)

    def axes_of(self, logical: str) -> tuple[str, ...]:
        """Mesh axes (size > 1) the rules map a logical axis to, in mesh order."""
        return tuple(sorted((a for a in self.rules.mesh_axes(logical) if self.sizes[a] > 1), key=AXES.index))

    def size_of(self, logical: str) -> int:
        return math.prod(self.sizes[a] for a in self.axes_of(logical))

    @property
    def tp(self) -> int:
        return self.sizes["tp"]

    @property
    def sequence_parallel(self) -> bool:
        """Whether the residual stream is split over ``tp`` along the sequence (rule ``norm_seq``)."""
        return "tp" in self.axes_of("norm_seq")

    def data_rank(self) -> tuple[int, int]:
        """``(index, count)`` of this rank's rows of the global batch (rule ``batch``)."""
        index, count = 0, 1
        for a in self.axes_of("batch"):
            index, count = index * self.sizes[a] + self.coords[a], count * self.sizes[a]
        return index, count

    def data_axes(self) -> tuple[str, ...]:
        """Axes (size > 1) whose ranks see different tokens."""
        return tuple(a for a in DATA_AXES if self.sizes[a] > 1)

    def sum(self, x: torch.Tensor, axes: Sequence[str]) -> torch.Tensor:
        """``x`` summed over the mesh ``axes`` (not differentiable: counts, losses, metrics)."""
        for a in axes:
            x = C.all_reduce_value(x, self.group(a))
        return x

    def __repr__(self) -> str:
        degrees = ", ".join(f"{a}={self.sizes[a]}" for a in AXES if self.sizes[a] > 1) or "single rank"
        return f"Layout({degrees})"


_CURRENT: Layout | None = None


def current() -> Layout | None:
    """The layout of the parallel step being run or traced, or ``None``."""
    return _CURRENT


@contextlib.contextmanager
def use(layout: Layout | None) -> Iterator[Layout | None]:
    """Make ``layout`` current inside the block (``None``: single-process semantics)."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, layout
    try:
        yield layout
    finally:
        _CURRENT = previous
