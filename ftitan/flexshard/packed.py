"""The packed all-gather of a bucket: FlexShard's one collective, for ``Plan.gather`` and the trainer's dp_shard.

Every rank holds a part of each of the bucket's leaves (any sizes: even, ragged, whole or nothing). Its
parts are cast to the compute dtype (or blockwise-quantized, ``ftitan.flexshard.quant``: values and scales in
one ``uint8`` buffer), packed into one flat buffer padded to the largest rank's, and all-gathered once; each
leaf is the ranks' parts concatenated along its dim. The backward is the adjoint: the leaves' gradients, in
the reduce dtype, cut into the ranks' parts and packed rank by rank, reduce-scattered once (summed), then
all-reduced once per group the leaves are replicated over (other data axes), and returned in the parts'
dtypes. With quantization the gradient passes straight through the rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ftitan.flexshard import quant
from ftitan.parallel import collectives as C

__all__ = ["pack", "pack_grads", "packed_gather", "padded_length", "replicated", "unpack", "unpack_own"]

Shapes = tuple[tuple[tuple[int, ...], ...], ...]  # per leaf, each rank's part shape


def _sizes(shapes: Shapes, quantize: str | None, block: quant.Block) -> list[list[int]]:
    """What each rank's part of each leaf takes in a buffer: elements, or bytes when quantized."""
    if quantize is None:
        return [[math.prod(s) for s in per_rank] for per_rank in shapes]
    return [[quant.encoded_bytes(s, block) for s in per_rank] for per_rank in shapes]


def padded_length(shapes: Shapes, quantize: str | None = None, block: quant.Block = quant.BLOCK) -> int:
    """The length of every rank's buffer: the largest rank's parts (elements; bytes when quantized)."""
    sizes = _sizes(shapes, quantize, block)
    if not sizes:
        return 0
    return max([sum([per_rank[r] for per_rank in sizes]) for r in range(len(sizes[0]))])


def pack(parts: Sequence[torch.Tensor], shapes: Shapes, compute: torch.dtype, quantize: str | None = None,
         block: quant.Block = quant.BLOCK) -> torch.Tensor:  # fmt: skip
    """This rank's ``parts`` as its buffer for the all-gather: cast to ``compute`` (or encoded), packed,
    zero-padded to :func:`padded_length`."""
    mine = [p.to(compute).reshape(-1) if quantize is None else quant.encode(p, quantize, block) for p in parts]
    pad = padded_length(shapes, quantize, block) - sum([m.numel() for m in mine])
    return torch.cat([*mine, torch.zeros(pad, dtype=mine[0].dtype, device=mine[0].device)])


def unpack(every: torch.Tensor, shapes: Shapes, dims: Sequence[int], compute: torch.dtype,
           quantize: str | None = None, block: quant.Block = quant.BLOCK) -> list[torch.Tensor]:  # fmt: skip
    """The whole leaves from every rank's buffer (``(world, padded)``: an all-gather's result), each the
    ranks' parts concatenated along its dim, in ``compute``."""
    sizes = _sizes(shapes, quantize, block)
    ends, outs = [0] * every.shape[0], []
    for k, per_rank in enumerate(shapes):
        if quantize is not None and len(set(per_rank)) == 1 and math.prod(per_rank[0]) and len(set(ends)) == 1:
            # every rank's part alike and at the same offset (even shards): one dequantization for them all
            start, size = ends[0], sizes[k][0]
            ends = [e + size for e in ends]
            rows = quant.decode_rows(every[:, start : start + size], per_rank[0], quantize, block, compute)
            outs.append(torch.cat(rows.unbind(0), dim=dims[k]) if len(per_rank) > 1 else rows[0])
            continue
        pieces = []
        for r, shape in enumerate(per_rank):
            raw = every[r, ends[r] : ends[r] + sizes[k][r]]
            ends[r] += sizes[k][r]
            if math.prod(shape):
                pieces.append(raw.view(shape) if quantize is None else
                              quant.decode(raw, shape, quantize, block, compute))  # fmt: skip
        outs.append(torch.cat(pieces, dim=dims[k]) if len(pieces) > 1 else pieces[0].clone())
    return outs


def pack_grads(grads: Sequence[torch.Tensor], shapes: Shapes, dims: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Whole-leaf gradients cut into every rank's parts and packed rank by rank, each rank's zero-padded to
    :func:`padded_length` (``(world * padded,)`` in ``dtype``): what a reduce-scatter splits."""
    world, padded = len(shapes[0]), padded_length(shapes)
    rows = []
    for r in range(world):
        row = []
        for g, per_rank, dim in zip(grads, shapes, dims, strict=True):
            lo = sum([s[dim] for s in per_rank[:r] if math.prod(s)])
            if math.prod(per_rank[r]):
                row.append(g.to(dtype).narrow(dim, lo, per_rank[r][dim]).reshape(-1))
        row.append(torch.zeros(padded - sum([x.numel() for x in row]), dtype=dtype, device=grads[0].device))
        rows.append(torch.cat(row))
    return torch.cat(rows)


def unpack_own(buf: torch.Tensor, shapes: Shapes, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s parts of every leaf from its own buffer (a reduce-scatter's result)."""
    own = [math.prod(per_rank[rank]) for per_rank in shapes]
    return [x.view(per_rank[rank]) for x, per_rank in zip(buf[: sum(own)].split(own), shapes, strict=True)]


def _even(shapes: Shapes | None, group: DeviceMesh | None, parts: Sequence[torch.Tensor]) -> Shapes:
    """``shapes``, or for ``None`` every rank's part shaped like this rank's (read inside the Function, so
    a traced step sees the parts' sizes as its own, not as constants of the call)."""
    if shapes is not None:
        return shapes
    world = 1 if group is None else group.size()
    return tuple((tuple(p.shape),) * world for p in parts)


class _PackedGather(torch.autograd.Function):
    @staticmethod
    def forward(shapes, dims, group, replicated, compute, reduce, quantize, block, *parts):  # type: ignore[override]
        shapes = _even(shapes, group, parts)
        buf = pack(parts, shapes, compute, quantize, block)
        every = buf if group is None else C._ag(buf, 0, group)
        return tuple(unpack(every.view(-1, buf.numel()), shapes, dims, compute, quantize, block))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        shapes, ctx.dims, ctx.group, ctx.replicated, _compute, ctx.reduce, _quantize, _block, *parts = inputs
        ctx.shapes = _even(shapes, ctx.group, parts)
        ctx.dtypes = [p.dtype for p in parts]

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor):  # type: ignore[override]
        group = ctx.group
        mine = pack_grads(gs, ctx.shapes, ctx.dims, ctx.reduce)
        if group is not None:
            mine = C._rs(mine, 0, group)
        for other in ctx.replicated:
            mine = C._ar(mine, other)
        own = unpack_own(mine, ctx.shapes, 0 if group is None else group.get_local_rank())
        return (None,) * 8 + tuple(x.to(d) for x, d in zip(own, ctx.dtypes, strict=True))


def packed_gather(
    parts: Sequence[torch.Tensor],
    shapes: Shapes | None,
    dims: Sequence[int],
    group: DeviceMesh | None,
    *,
    compute: torch.dtype | None = None,
    reduce: torch.dtype | None = None,
    replicated: Sequence[DeviceMesh] = (),
    quantize: str | None = None,
    block: quant.Block = quant.BLOCK,
) -> tuple[torch.Tensor, ...]:
    """The whole leaves whose parts on this rank are ``parts`` (see the module docstring): ``shapes[k][r]``
    is rank ``r``'s part of leaf ``k`` (``None``: every rank's is shaped like this rank's, an even split),
    concatenated along ``dims[k]``; ``compute`` (default: the first part's dtype) is what travels and what
    the leaves are in, ``reduce`` (default: ``compute``) what their gradients are summed in; ``replicated``:
    groups the gradients are also all-reduced over; ``quantize`` (``"int8"`` / ``"fp8"``): the parts travel
    blockwise-quantized, a scale per ``block`` (values of a row, or ``(rows, cols)`` tiles).
    ``group=None``: one rank (no collective). Differentiable; traceable by ``torch.compile``."""
    compute = compute or parts[0].dtype
    if shapes is not None:
        shapes = tuple(tuple(tuple(s) for s in per_rank) for per_rank in shapes)
    return _apply(_PackedGather, shapes, tuple(dims), group, tuple(replicated), compute, reduce or compute, quantize,
                  block, *parts)  # fmt: skip


class _Replicated(torch.autograd.Function):
    @staticmethod
    def forward(groups, compute, reduce, *parts):  # type: ignore[override]
        return tuple(p.to(compute).view_as(p) for p in parts)  # (a view: a Function must not return its input)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.groups, _compute, ctx.reduce, *parts = inputs
        ctx.shapes = [tuple(p.shape) for p in parts]
        ctx.dtypes = [p.dtype for p in parts]

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor):  # type: ignore[override]
        flat = torch.cat([g.to(ctx.reduce).reshape(-1) for g in gs])
        for group in ctx.groups:
            flat = C._ar(flat, group)
        pieces = flat.split([math.prod(s) for s in ctx.shapes])
        return (None, None, None, *[x.view(s).to(d) for x, s, d in zip(pieces, ctx.shapes, ctx.dtypes, strict=True)])


def replicated(parts: Sequence[torch.Tensor], groups: Sequence[DeviceMesh], *, compute: torch.dtype | None = None,
               reduce: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A bucket's leaves every rank holds whole (norm scales): cast to ``compute`` (default: the first
    part's dtype); backward: their gradients packed in ``reduce`` (default: ``compute``) and all-reduced
    once per group in ``groups`` (the groups whose ranks saw other data), returned in the parts' dtypes."""
    compute = compute or parts[0].dtype
    return _apply(_Replicated, tuple(groups), compute, reduce or compute, *parts)


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` where a gradient is wanted, its forward alone where none is (no grad mode, or no
    part requires one). Under torch 2.13's dynamo, ``apply`` with no gradient wanted passed these Functions'
    forwards a context object as their first argument (``_PackedGather`` saw it as ``shapes`` and a dtype as
    ``quantize``; a minimal Function of the same signature did not reproduce it): the compiled forward of a
    sharded model (evaluation under ``torch.no_grad()``, generation) failed in the trace."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn.apply(*args)
    return fn.forward(*args)
