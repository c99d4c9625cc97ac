"""FlexShard plans: which rank stores which part of each leaf, and the packed collectives between them.

A :class:`Plan` is static data computed once from the params' shapes, the buckets and the world size;
the sharded state is a plain tree of local tensors (this rank's part of each leaf), so optimizers map
over it as over any params tree. Gathering a bucket packs this rank's parts of its leaves into one flat
buffer, all-gathers it (one collective), and cuts the full leaves out of the ranks' buffers; its
gradient is the adjoint: one reduce-scatter of the packed gradients (``ftitan.parallel.collectives``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

from ftitan import tree
from ftitan.flexshard import quant
from ftitan.flexshard import packed
from ftitan.parallel import collectives as C

__all__ = [
    "BlockShard",
    "Bucket",
    "LeafPlan",
    "Owned",
    "Placement",
    "Plan",
    "Replicate",
    "Shard",
    "balance",
    "newton_schulz_cost",
    "per_layer",
    "per_leaf",
    "plan",
]


@attrs.frozen
class Shard:
    """Rows along ``dim`` split over the ranks, as evenly as they go (the first ``n % world`` ranks get one
    more: ragged, never padded in the state)."""

    dim: int = 0


@attrs.frozen
class BlockShard:
    """Whole ``block_size``-row blocks along ``dim`` per rank (e.g. one attention head's rows of a
    projection, one expert of an expert stack), the blocks split over the ranks as evenly as they go."""

    dim: int
    block_size: int

    def __attrs_post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"BlockShard(block_size={self.block_size}): must be >= 1")


@attrs.frozen
class Owned:
    """The whole tensor on one rank (its owner), e.g. for a matrix optimizer's compute; owners are chosen
    by :func:`plan` to balance :func:`newton_schulz_cost`."""


@attrs.frozen
class Replicate:
    """The whole tensor on every rank (its gradient all-reduced)."""


Placement = Shard | BlockShard | Owned | Replicate


def _patterns(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@attrs.frozen
class Bucket:
    """Leaves whose dotted paths match one of ``patterns`` (globs, ``ftitan.tree.match``), stored with
    ``placement`` and gathered together: one packed collective per bucket. ``gather_dtype``: what the parts
    are cast to before the all-gather (e.g. ``torch.bfloat16``: half the bytes of float32); ``quantize``
    (``"int8"`` / ``"fp8"``): the parts travel blockwise-quantized, values and scales in the one buffer
    (``ftitan.flexshard.quant``), and arrive dequantized in ``gather_dtype``; the gradients (a
    reduce-scatter in full precision) come back in the state's dtype either way. A leaf belongs to the
    first bucket that matches it."""

    patterns: tuple[str, ...] = attrs.field(converter=_patterns)
    placement: Placement = Shard(0)
    gather_dtype: torch.dtype | None = None
    quantize: str | None = None  # "int8" / "fp8": the all-gather sends blockwise-quantized parts (quant.encode)
    quant_block: quant.Block = quant.BLOCK  # values of a row per scale, or (rows, cols) tiles
    name: str = ""  # default: the first pattern

    def __attrs_post_init__(self) -> None:
        if self.quantize is not None and self.quantize not in quant.FORMATS:
            raise ValueError(f"Bucket(quantize={self.quantize!r}): expected one of {sorted(quant.FORMATS)} or None")

    @property
    def label(self) -> str:
        return self.name or self.patterns[0]


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """Flops-proportional cost of orthogonalizing a tensor of ``shape`` (a batch of ``(m, n)`` matrices over
    its last two dims): ``batch * m * n * min(m, n)``; vectors count their length."""
    if len(shape) < 2:
        return math.prod(shape)
    m, n = shape[-2], shape[-1]
    return math.prod(shape[:-2]) * m * n * min(m, n)


def _even(n: int, world: int) -> list[tuple[int, int]]:
    """``[(lo, hi)]`` per rank: ``n`` items split as evenly as they go, the first ranks one more."""
    base, extra = divmod(n, world)
    out, lo = [], 0
    for r in range(world):
        hi = lo + base + (r < extra)
        out.append((lo, hi))
        lo = hi
    return out


@attrs.frozen
class LeafPlan:
    """One leaf: its full shape, placement, bucket, and each rank's rows ``(lo, hi)`` along ``dim``
    (Owned: the owner's are all rows, the others' none; Replicate: all rows on every rank)."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement
    bucket: str
    dim: int
    rows: tuple[tuple[int, int], ...]  # per rank
    owner: int | None = None  # Owned only

    def local_shape(self, rank: int) -> tuple[int, ...]:
        if not self.shape:
            return self.shape
        lo, hi = self.rows[rank]
        return (*self.shape[: self.dim], hi - lo, *self.shape[self.dim + 1 :])

    def numel(self, rank: int) -> int:
        return math.prod(self.local_shape(rank))

    @property
    def packed(self) -> bool:
        """Whether the leaf travels in its bucket's collective (Replicate leaves do not)."""
        return not isinstance(self.placement, Replicate)


def _leaf_plan(path: str, x: Any, bucket: Bucket, world: int) -> LeafPlan:
    shape, dtype = tuple(x.shape), x.dtype
    p = bucket.placement
    if isinstance(p, Replicate) or not shape:
        whole = ((0, shape[0] if shape else 0),) * world
        return LeafPlan(path, shape, dtype, p if shape else Replicate(), bucket.label, 0, whole)
    if isinstance(p, Owned):  # the owner is set by plan(), once every Owned leaf is known
        return LeafPlan(path, shape, dtype, p, bucket.label, 0, ((0, 0),) * world)
    dim = p.dim % len(shape)
    if isinstance(p, BlockShard):
        if shape[dim] % p.block_size:
            raise ValueError(f"flexshard: {path} has {shape[dim]} rows along dim {dim}, not whole blocks of "
                             f"BlockShard(block_size={p.block_size}); use a block size that divides {shape[dim]}, "
                             f"or Shard({dim})")  # fmt: skip
        blocks = _even(shape[dim] // p.block_size, world)
        rows = tuple((lo * p.block_size, hi * p.block_size) for lo, hi in blocks)
    else:
        rows = tuple(_even(shape[dim], world))
    return LeafPlan(path, shape, dtype, p, bucket.label, dim, rows)


def balance(costs: Sequence[int], world: int) -> list[int]:
    """An owner rank for each item of ``costs``: the largest first, each to the least loaded rank (ties: the
    lowest rank; equal costs in item order): deterministic, balanced (longest-processing-time first)."""
    load, out = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += costs[i]
    return out


def _owners(leaves: list[LeafPlan], world: int) -> dict[str, int]:
    """Owned leaves to ranks by :func:`balance` of their :func:`newton_schulz_cost` (equal costs in path order)."""
    leaves = sorted(leaves, key=lambda lp: lp.path)
    return dict(zip((lp.path for lp in leaves), balance([newton_schulz_cost(lp.shape) for lp in leaves], world),
                    strict=True))  # fmt: skip


class Plan:
    """Where each leaf lives, and the packed gather / reduce of each bucket (see the module docstring).

    ``world`` / ``rank``: the data-parallel group's size and this rank's index in it (from ``mesh``, a 1-D
    ``DeviceMesh``; without one, a plan for any ``rank`` of ``world`` can be made to compute layouts, but
    its collectives need the mesh)."""

    def __init__(self, leaves: list[LeafPlan], treedef: Any, buckets: list[Bucket], mesh: DeviceMesh | None,
                 world: int, rank: int) -> None:  # fmt: skip
        self.leaves = {lp.path: lp for lp in leaves}
        self.treedef = treedef
        self.buckets = {b.label: b for b in buckets if any(lp.bucket == b.label for lp in leaves)}
        self.mesh, self.world, self.rank = mesh, world, rank
        self.members = {name: [lp for lp in leaves if lp.bucket == name] for name in self.buckets}
        # per bucket: the length of every rank's buffer (the largest rank's packed parts)
        self.padded = {name: packed.padded_length(self.part_shapes(name)) for name in self.members}

    # ------------------------------------------------------------------------------------------ state

    def shard(self, params: tree.Tree) -> tree.Tree:
        """This rank's part of every leaf of the full ``params`` (the same on every rank): no communication."""
        paths, xs, _ = tree.flatten_with_paths(params)

        def part(path: str, x: torch.Tensor) -> torch.Tensor:
            lp = self.leaves[path]
            if not lp.shape or isinstance(lp.placement, Replicate):
                return x.clone()
            lo, hi = lp.rows[self.rank]
            return x.narrow(lp.dim, lo, hi - lo).contiguous()

        return tree.unflatten(self.treedef, [part(p, x) for p, x in zip(paths, xs, strict=True)])

    def local_shapes(self, rank: int | None = None) -> tree.Tree:
        """The shapes of a rank's parts (default: this rank's), as a tree of tuples."""
        r = self.rank if rank is None else rank
        return tree.unflatten(self.treedef, [lp.local_shape(r) for lp in self.leaves.values()])

    def owner(self, path: str) -> int | None:
        return self.leaves[path].owner

    # ------------------------------------------------------------------------------------ collectives

    def gather(self, local: tree.Tree, bucket: str) -> dict[str, torch.Tensor]:
        """``{path: full tensor}`` of ``bucket``'s leaves from every rank's parts: one all-gather of the packed
        buffer (Replicate leaves: this rank's own, cast). Differentiable: the gradient of the parts is one
        reduce-scatter of the packed gradients (summed over the ranks)."""
        flat = self._flat(local)
        b = self.buckets[bucket]
        members = [lp for lp in self.members[bucket] if lp.packed]
        out = {}
        if members:
            parts = [flat[lp.path] for lp in members]
            outs = packed.packed_gather(parts, self.part_shapes(bucket), [lp.dim for lp in members], self._group(),
                                        compute=b.gather_dtype or parts[0].dtype, quantize=b.quantize,
                                        block=b.quant_block)  # fmt: skip
            out = dict(zip((lp.path for lp in members), outs, strict=True))
        whole = [lp for lp in self.members[bucket] if not lp.packed]
        if whole:  # every rank holds them: the identity, whose gradient is one all-reduce of them all, packed
            parts = [flat[lp.path] for lp in whole]
            group = self._group()
            same = packed.replicated(parts, () if group is None else (group,), compute=b.gather_dtype or parts[0].dtype)
            out.update(zip((lp.path for lp in whole), same, strict=True))
        return {lp.path: out[lp.path] for lp in self.members[bucket]}

    def gather_all(self, local: tree.Tree) -> tree.Tree:
        """Every bucket gathered: the full params tree (differentiable, like :meth:`gather`)."""
        full: dict[str, torch.Tensor] = {}
        for name in self.buckets:
            full.update(self.gather(local, name))
        return tree.unflatten(self.treedef, [full[p] for p in self.leaves])

    def reduce_grads(self, grads: tree.Tree, *, dtype: torch.dtype | None = None) -> tree.Tree:
        """Full-size gradients of every rank (each rank's own, e.g. of its batch rows) to this rank's parts
        of their sum: one reduce-scatter per bucket (Replicate leaves: an all-reduce), in ``dtype``
        (default: the gradients'), returned in the state's dtypes."""
        flat = self._flat(grads)
        out: dict[str, torch.Tensor] = {}
        for name, members in self.members.items():
            split = [lp for lp in members if lp.packed]
            if split:
                gs = [flat[lp.path] for lp in split]
                shapes = self.part_shapes(name)
                buf = packed.pack_grads(gs, shapes, [lp.dim for lp in split], dtype or gs[0].dtype)
                mine = buf if self.world == 1 else C.reduce_scatter(buf, self._group())
                own = packed.unpack_own(mine, shapes, self.rank)
                out.update({lp.path: x.to(lp.dtype) for lp, x in zip(split, own, strict=True)})
            whole = [lp for lp in members if not lp.packed]
            if whole:  # one all-reduce of them all, packed
                gs = [flat[lp.path].to(dtype or flat[lp.path].dtype) for lp in whole]
                summed = _unflat(C.all_reduce(_cat(gs), self._group()), gs)
                out.update({lp.path: g.to(lp.dtype) for lp, g in zip(whole, summed, strict=True)})
        return tree.unflatten(self.treedef, [out[p] for p in self.leaves])

    def part_shapes(self, bucket: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Each rank's part shape of each of ``bucket``'s packed leaves (``[leaf][rank]``, in the bucket's
        order): the layout of its buffers (``ftitan.flexshard.packed``)."""
        return tuple(tuple(lp.local_shape(r) for r in range(self.world)) for lp in self.members[bucket] if lp.packed)

    def gather_leaf(self, x: torch.Tensor, path: str) -> torch.Tensor:
        """One leaf's full tensor from every rank's part ``x`` (this rank's): one packed all-gather of the parts
        (not differentiable; e.g. an optimizer's whole-matrix input)."""
        lp = self.leaves[path]
        if not lp.packed or self.world == 1:
            return x
        with torch.no_grad():
            shapes = (tuple(lp.local_shape(r) for r in range(self.world)),)
            return packed.packed_gather([x], shapes, [lp.dim], self._group())[0]

    def unshard(self, local: tree.Tree) -> tree.Tree:
        """The full params on every rank (e.g. to compare with a single-process run, or to save)."""
        with torch.no_grad():
            return self.gather_all(local)

    def parts(self, local: tree.Tree, *, write: bool = True) -> tree.Tree:
        """``local`` (the parts, or any tree holding part-shaped trees: an optimizer state) with each part a
        ``ftitan.checkpoint.Part`` placed in its full tensor, for ``ftitan.checkpoint.save`` / ``load``:
        a checkpoint of FlexShard state that loads under another plan or rank count (:meth:`from_parts`).
        A leaf is matched to the plan's leaf whose path ends its own and whose part has its shape; other
        leaves (step counts) stay as they are. Each block is written once: Replicate leaves by rank 0 of
        the group, Owned ones by their owner; ``write=False`` for a rank whose group duplicates another's
        (e.g. ``dp_replicate`` coordinate > 0)."""
        from ftitan.checkpoint import Part

        def one(path: str, x: Any) -> Any:
            lp = self._match(path, x)
            if lp is None:
                return x
            lo = lp.rows[self.rank][0]
            offsets = tuple(lo if d == lp.dim else 0 for d in range(len(lp.shape)))
            return Part(x, lp.shape, offsets, write and (lp.packed or self.rank == 0))

        return tree.map_with_path(one, local)

    def from_parts(self, parts: tree.Tree) -> tree.Tree:
        """:meth:`parts`' inverse: the tensors of the ``Part`` leaves (as loaded into this plan's layout)."""
        from ftitan.checkpoint import Part

        return tree.map(lambda x: x.local if isinstance(x, Part) else x, parts)

    def _match(self, path: str, x: Any) -> LeafPlan | None:
        """The plan's leaf whose path is the longest dotted suffix of ``path`` and whose part has ``x``'s shape."""
        if not isinstance(x, torch.Tensor):
            return None
        names = path.split(".")
        for i in range(len(names)):
            lp = self.leaves.get(".".join(names[i:]))
            if lp is not None:
                return lp if tuple(x.shape) == lp.local_shape(self.rank) else None
        return None

    def global_norm(self, local: tree.Tree) -> torch.Tensor:
        """The L2 norm of the full tree whose parts are ``local`` (e.g. the gradients): the parts' squares
        summed over the ranks (one all-reduce of a scalar), replicated leaves counted once."""
        flat = self._flat(local)
        parts = [flat[p].float().square().sum() for p, lp in self.leaves.items() if lp.packed]
        whole = [flat[p].float().square().sum() for p, lp in self.leaves.items() if not lp.packed]
        zero = torch.zeros((), device=next(iter(flat.values())).device)
        sq = sum(parts, zero)
        if self.world > 1:
            sq = C.all_reduce_value(sq, self._group())
        return torch.sqrt(sq + sum(whole, zero))

    def _flat(self, x: Any) -> Mapping[str, torch.Tensor]:
        """``{path: leaf}`` of a tree shaped like the params, or of such a mapping already."""
        if isinstance(x, Mapping) and x and set(x) <= set(self.leaves) and all(
                isinstance(v, torch.Tensor) for v in x.values()):  # fmt: skip
            return x
        return dict(zip(*tree.flatten_with_paths(x)[:2], strict=True))

    def _group(self) -> DeviceMesh | None:
        if self.world > 1 and self.mesh is None:
            raise ValueError(f"flexshard: this plan was made for rank {self.rank} of {self.world} without a mesh; "
                             f"its collectives need one: flexshard.plan(params, buckets, mesh)")  # fmt: skip
        return self.mesh if self.world > 1 else None

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}: {len(m)} leaves, {self.padded[name]} per rank" for name, m in self.members.items())
        return f"Plan(world={self.world}, rank={self.rank}; {parts})"


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:  # flattened, one buffer (one dtype)
    return torch.cat([x.reshape(-1) for x in xs])


def _unflat(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:  # _cat's inverse
    return [piece.view(x.shape) for piece, x in zip(buf.split([x.numel() for x in like]), like, strict=True)]


def plan(
    params: tree.Tree,
    buckets: Sequence[Bucket],
    mesh: DeviceMesh | None = None,
    *,
    world: int | None = None,
    rank: int | None = None,
) -> Plan:
    """The :class:`Plan` of ``params`` (tensors, or anything with ``.shape`` and ``.dtype``: meta tensors)
    under ``buckets`` over the 1-D ``mesh`` (the data-parallel group; ``None``: one rank, or pass ``world``
    and ``rank`` to compute another rank's layout without communicating). Every leaf must match a bucket."""
    if mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(f"flexshard.plan: the mesh must be 1-D (the data-parallel group), got {mesh.ndim}-D")
        world, rank = mesh.size(), mesh.get_local_rank()
    world = 1 if world is None else world
    rank = 0 if rank is None else rank
    if not 0 <= rank < world:
        raise ValueError(f"flexshard.plan: rank {rank} is not in a world of {world}")
    if not buckets:
        raise ValueError("flexshard.plan: no buckets; pass e.g. flexshard.per_layer(params)")
    labels = [b.label for b in buckets]
    if len(set(labels)) != len(labels):
        raise ValueError(f"flexshard.plan: bucket names repeat ({labels}); give each Bucket a name=")
    paths, xs, treedef = tree.flatten_with_paths(params)
    leaves = []
    for path, x in zip(paths, xs, strict=True):
        b = next((b for b in buckets if any(tree.match(path, pat) for pat in b.patterns)), None)
        if b is None:
            raise ValueError(f"flexshard.plan: {path} matches no bucket's patterns; add a catch-all bucket, e.g. "
                             f"Bucket('**', Shard(0))")  # fmt: skip
        leaves.append(_leaf_plan(path, x, b, world))
    owners = _owners([lp for lp in leaves if isinstance(lp.placement, Owned)], world)
    leaves = [attrs.evolve(lp, owner=owners[lp.path], rows=tuple((0, lp.shape[0]) if r == owners[lp.path] else (0, 0)
                                                                 for r in range(world)))
              if lp.path in owners else lp for lp in leaves]  # fmt: skip
    return Plan(leaves, treedef, list(buckets), mesh, world, rank)


def per_layer(params: tree.Tree, placement: Placement = Shard(0), *, gather_dtype: torch.dtype | None = None,
              quantize: str | None = None, rest: Placement | None = None) -> list[Bucket]:  # fmt: skip
    """The default policy: one bucket per transformer layer (``layers.<i>.**``, gathered as the forward
    reaches it) and one for every other leaf (embeddings, final norm, head; ``rest``: its placement,
    default ``placement``); ``gather_dtype`` and ``quantize`` as in :class:`Bucket`, for every bucket."""
    from ftitan.parallel.shard import per_layer_bucket  # the trainer's per-layer buckets: one idea of a layer

    layers = sorted({per_layer_bucket(p) for p in tree.paths(params)} - {"rest"}, key=_layer_key)
    out = [Bucket(f"{name}.**", placement, gather_dtype, quantize) for name in layers]
    return [*out, Bucket("**", placement if rest is None else rest, gather_dtype, quantize, name="rest")]


def per_leaf(params: tree.Tree, placement: Placement = Shard(0), *, gather_dtype: torch.dtype | None = None,
             quantize: str | None = None) -> list[Bucket]:  # fmt: skip
    """One bucket per leaf: a collective per tensor (today's per-leaf FSDP; the benchmarks' baseline)."""
    return [Bucket(_escape(p), placement, gather_dtype, quantize, name=p) for p in tree.paths(params)]


def _layer_key(name: str) -> tuple[int, str]:  # "layers.<i>" in numeric order
    i = name.split(".", 1)[1]
    return (int(i), "") if i.isdigit() else (1 << 30, i)


def _escape(path: str) -> str:
    if any(c in path for c in "*?"):
        raise ValueError(f"flexshard.per_leaf: the path {path!r} has glob characters")
    return path
