"""Differentiable collectives over one mesh axis, and a count of the bytes they send.

Each is a ``torch.autograd.Function`` built on functional collectives
(``torch.distributed._functional_collectives``), with its adjoint as the
backward: all-gather <-> reduce-scatter, all-reduce <-> identity,
all-to-all <-> the reverse all-to-all, and :func:`psum` (an all-reduce whose
backward all-reduces too). They run eagerly, under
``torch.autograd.grad`` and under ``torch.compile(fullgraph=True)``.

Why the collectives run under ``no_grad`` inside forward/backward: torch
2.13 registers the functional collectives' own autograd through
``torch.library``, as an ``autograd.Function`` without ``setup_context``,
which functorch refuses; the math of the adjoint is here anyway. (Under
``torch.func.grad`` *and* ``torch.compile`` together these Functions give
wrong gradients in torch 2.13, so parallel steps differentiate with the
``"autograd"`` path of ``ftitan.train.value_and_grad``, which compiles.)

Bytes are counted per rank (what this rank sends, ring algorithms) while a
:func:`count_bytes` block is open, in eager mode only (a compiled graph
does not run this Python):
all-gather ``(n-1) * b`` for a local shard of ``b`` bytes; reduce-scatter
``(n-1)/n * b`` for an input of ``b``; all-reduce ``2 (n-1)/n * b``;
all-to-all the bytes addressed to other ranks; send ``b``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "count_bytes",
    "count_calls",
    "grad_all_reduce",
    "psum",
    "reduce_scatter",
    "record",
    "split",
]

_COUNTS: Counter[str] | None = None
_CALLS: Counter[str] | None = None


@contextlib.contextmanager
def count_bytes() -> Iterator[Counter[str]]:
    """Count the bytes this rank sends in the block, by collective name (eager only)."""
    global _COUNTS
    previous, _COUNTS = _COUNTS, Counter()
    try:
        yield _COUNTS
    finally:
        _COUNTS = previous


@contextlib.contextmanager
def count_calls() -> Iterator[Counter[str]]:
    """Count the collectives this rank calls in the block, by name (eager only)."""
    global _CALLS
    previous, _CALLS = _CALLS, Counter()
    try:
        yield _CALLS
    finally:
        _CALLS = previous


def record(name: str, nbytes: float) -> None:
    """Add ``nbytes`` under ``name`` to the open :func:`count_bytes` block and one call to the open
    :func:`count_calls` block, if any."""
    if torch.compiler.is_compiling():
        return
    if _COUNTS is not None:
        _COUNTS[name] += int(nbytes)
    if _CALLS is not None:
        _CALLS[name] += 1


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _ag(x: torch.Tensor, dim: int, group: DeviceMesh) -> torch.Tensor:
    n = group.size()
    record("all_gather", (n - 1) * _nbytes(x))
    with torch.no_grad():
        return fc.wait_tensor(fc.all_gather_single(x.contiguous(), dim, group))


def _rs(x: torch.Tensor, dim: int, group: DeviceMesh) -> torch.Tensor:
    n = group.size()
    record("reduce_scatter", (n - 1) / n * _nbytes(x))
    with torch.no_grad():
        return fc.wait_tensor(fc.reduce_scatter_single(x.contiguous(), "sum", dim, group))


def _ar(x: torch.Tensor, group: DeviceMesh) -> torch.Tensor:
    n = group.size()
    record("all_reduce", 2 * (n - 1) / n * _nbytes(x))
    with torch.no_grad():
        return fc.wait_tensor(fc.all_reduce(x.contiguous(), "sum", group))


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: DeviceMesh) -> torch.Tensor:
    me = group.get_local_rank()
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    record("all_to_all", (sum(in_splits) - in_splits[me]) * row)
    with torch.no_grad():
        return fc.wait_tensor(fc.all_to_all_single(x.contiguous(), out_splits, in_splits, group))


def _local_block(x: torch.Tensor, dim: int, group: DeviceMesh) -> torch.Tensor:
    return x.chunk(group.size(), dim=dim)[group.get_local_rank()].contiguous()


def _same(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return x.view_as(x)  # a view: an autograd.Function must not return its input as is


def _a2a_back(g: torch.Tensor, out_splits: list[int], in_splits: list[int], group: DeviceMesh) -> torch.Tensor:
    return _a2a(g, in_splits, out_splits, group)


# name -> (forward, its adjoint); both take (tensor, *args) with the same args
_ADJOINTS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "all_gather": (_ag, _rs),  # args: (dim, group)
    "reduce_scatter": (_rs, _ag),
    "split": (_local_block, _ag),
    "all_reduce": (_ar, _same),  # args: (group,)
    "grad_all_reduce": (_same, _ar),
    "psum": (_ar, _ar),
    "all_to_all": (_a2a, _a2a_back),  # args: (out_splits, in_splits, group)
}


class _Collective(torch.autograd.Function):
    """``_ADJOINTS[name]``: the collective forward, its adjoint backward."""

    @staticmethod
    def forward(x: torch.Tensor, name: str, args: tuple[Any, ...]) -> torch.Tensor:  # type: ignore[override]
        return _ADJOINTS[name][0](x, *args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.name, ctx.args = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return _ADJOINTS[ctx.name][1](g, *ctx.args), None, None


def all_gather(x: torch.Tensor, group: DeviceMesh | None, *, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; backward reduce-scatters (sums) the gradient."""
    return x if group is None or group.size() == 1 else _Collective.apply(x, "all_gather", (dim, group))


def reduce_scatter(x: torch.Tensor, group: DeviceMesh | None, *, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's block along ``dim``; backward all-gathers."""
    return x if group is None or group.size() == 1 else _Collective.apply(x, "reduce_scatter", (dim, group))


def all_reduce(x: torch.Tensor, group: DeviceMesh | None) -> torch.Tensor:
    """Sum partial values over ranks (the result is replicated); backward passes the gradient through."""
    return x if group is None or group.size() == 1 else _Collective.apply(x, "all_reduce", (group,))


def grad_all_reduce(x: torch.Tensor, group: DeviceMesh | None) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ranks.

    Marks a replicated value that each rank goes on to use with different
    data, so its gradient is the sum of every rank's part (Megatron's ``f``).
    """
    return x if group is None or group.size() == 1 else _Collective.apply(x, "grad_all_reduce", (group,))


def psum(x: torch.Tensor, group: DeviceMesh | None) -> torch.Tensor:
    """Sum ``x`` over ranks (the result is replicated); backward sums the cotangent over ranks too.

    The full adjoint of a sum over ranks: use it when each rank goes on to
    use the sum differently, so every rank's input must receive the
    cotangents of all ranks (e.g. router statistics of the global
    batch in a loss each rank weights by its own token count). :func:`all_reduce`
    is the cheaper form for when those cotangents are identical on every rank.
    """
    return x if group is None or group.size() == 1 else _Collective.apply(x, "psum", (group,))


def split(x: torch.Tensor, group: DeviceMesh | None, *, dim: int = 0) -> torch.Tensor:
    """This rank's block of a replicated ``x`` along ``dim``; backward all-gathers."""
    return x if group is None or group.size() == 1 else _Collective.apply(x, "split", (dim, group))


def all_to_all(
    x: torch.Tensor, group: DeviceMesh | None, *, out_splits: Sequence[int], in_splits: Sequence[int]
) -> torch.Tensor:
    """Send ``in_splits[j]`` rows of ``x`` to rank ``j``, receive ``out_splits[j]`` rows from it.

    Backward sends the gradients back the same way.
    """
    if group is None or group.size() == 1:
        return x
    return _Collective.apply(x, "all_to_all", ([int(s) for s in out_splits], [int(s) for s in in_splits], group))


def all_reduce_value(x: torch.Tensor, group: DeviceMesh | None, *, op: str = "sum") -> torch.Tensor:
    """Non-differentiable all-reduce (counts, maxima, metrics)."""
    if group is None or group.size() == 1:
        return x
    record("all_reduce", 2 * (group.size() - 1) / group.size() * _nbytes(x))
    with torch.no_grad():
        return fc.wait_tensor(fc.all_reduce(x.detach().contiguous(), op, group))


def send(x: torch.Tensor, dst: int, group: Any = None) -> None:
    """Point-to-point send (global rank ``dst``), counted."""
    record("send", _nbytes(x))
    dist.send(x.contiguous(), dst, group=group)
