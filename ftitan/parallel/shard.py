"""Params on a mesh: ``shard_params`` (a tree of DTensors), and the gathered view a step computes with.

Storage: every leaf is a ``DTensor`` with the placements its logical axes
resolve to (``rules.resolve``): split over ``tp`` / ``ep`` for compute and
over ``dp_shard`` for storage (FSDP). Compute: a parallel step works on the
local shards (``to_local``); :func:`gathered` is the params view the model
reads, which all-gathers each leaf over its data axes when the model first
touches it (layer by layer, as the forward walks the layers), with the
adjoint in backward: gradients are reduce-scattered over ``dp_shard`` and
all-reduced over the data axes the leaf is replicated on (DDP).

Under a mixed-precision policy (``ftitan.train.MixedPrecision``) the local
shard is cast to the compute dtype *before* the all-gather (bfloat16 sends
half the bytes of float32), and the gradient is cast to the reduce dtype
before the reduce-scatter and all-reduce, then arrives in the shard's
(master) dtype: one autograd node per leaf does both directions
(:func:`gather_leaf`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ftitan import tree
from ftitan.parallel import collectives as C
from ftitan.parallel.layout import Layout
from ftitan.parallel.rules import Rules, Sharding, check_sharded, local_slice, resolve

if TYPE_CHECKING:
    from ftitan.train.precision import MixedPrecision

__all__ = ["BUCKETS", "Buckets", "from_local", "gathered", "local_shard", "on_shards", "per_layer_bucket",
           "shard_params", "to_local", "unshard"]  # fmt: skip

# axes a weight may be stored split over but is gathered on for compute (tp / ep stay split)
GATHERED_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp")


def shard_params(
    params: tree.Tree,
    axes: tree.Tree,
    rules: Rules,
    layout: Layout | DeviceMesh,
    *,
    check: bool = False,
    min_numel: int = 1 << 16,
) -> tree.Tree:
    """Every leaf as a ``DTensor`` placed by ``rules`` (built from this rank's blocks of the full,
    identical-on-every-rank ``params``; no communication), on ``layout.storage_mesh``: the mesh axes
    of size > 1, pp aside.

    ``check=True`` also runs the "insufficiently sharded" check
    (:func:`ftitan.parallel.check_sharded`) for leaves of ``min_numel`` or more.
    """
    if isinstance(layout, DeviceMesh):  # a mesh from parallel.mesh(...): placed by these rules
        layout = Layout(layout, rules)
    shardings = resolve(params, axes, rules, layout.mesh)
    if check:
        check_sharded(params, shardings, layout.mesh, min_numel=min_numel)

    def one(x: torch.Tensor, s: Sharding) -> DTensor:
        local = local_slice(x, s, layout.coords, layout.sizes).contiguous()
        placements = s.placements(layout.storage_axes)
        return DTensor.from_local(local, layout.storage_mesh, placements, run_check=False, shape=x.shape, stride=x.stride())

    return tree.map(one, params, shardings)


def to_local(params: tree.Tree) -> tree.Tree:
    """This rank's shards, as plain tensors (non-DTensor leaves pass through)."""
    return tree.map(lambda x: x.to_local() if isinstance(x, DTensor) else x, params)


def local_shard(x: Any) -> Any:
    """This rank's shard of a DTensor ``x`` for eager optimizer math (``to_local`` without its autograd node
    where nothing needs one; anything else as it is). Not for a traced step's inputs: the tensor it returns
    may be a view, which a compiled step would guard on."""
    if not isinstance(x, DTensor):
        return x
    if not x.requires_grad and not torch.compiler.is_compiling():
        return x._local_tensor  # what to_local returns, without its autograd node (~30 us a leaf)
    return x.to_local()


def from_local(local: tree.Tree, like: tree.Tree) -> tree.Tree:
    """Local shards placed like the DTensors of ``like`` (same mesh, placements, global shape)."""

    def one(x: torch.Tensor, ref: Any) -> Any:
        if not isinstance(ref, DTensor):
            return x
        if (x.dtype == ref.dtype and x.shape == ref._local_tensor.shape and not x.requires_grad
                and not torch.compiler.is_compiling()):  # fmt: skip
            # ref's spec as is (same mesh, placements, global shape and dtype): DTensor.from_local builds a
            # new spec through an autograd node, ~0.1 ms a leaf, which an optimizer step pays per state leaf
            return DTensor(x, ref._spec, requires_grad=False)
        return DTensor.from_local(x, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride())

    return tree.map(one, local, like)


def on_shards(transform: Any) -> Any:
    """``transform`` (an ``ftitan.optim.Transform`` whose math is elementwise: AdamW, weight decay, a
    learning rate, momentum) run on each DTensor's local shard: DTensors in and out (updates placed like the
    gradients, state like the state it was given), plain tensors in between, so none of its ops pays
    DTensor's dispatch. Its state is the inner transform's, leaf for leaf (a checkpoint does not see it)."""
    from ftitan.optim.transform import Transform

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        local = lambda t: tree.map(local_shard, t)  # noqa: E731
        updates, new_state = transform.update(local(grads), local(state), None if params is None else local(params))
        return from_local(updates, grads), from_local(new_state, state)

    return Transform(transform.init, update)


def unshard(params: tree.Tree) -> tree.Tree:
    """Full tensors on every rank (``DTensor.full_tensor``), e.g. to compare with a single-process run."""
    return tree.map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, params)


class _Unshard(torch.autograd.Function):
    """FSDP/DDP's view of one local shard: cast, then all-gather over each gathered axis (innermost
    first); backward casts the gradient to the reduce dtype, reduce-scatters it over those axes in
    reverse, all-reduces it over the replicated data axes, and returns it in the shard's dtype."""

    @staticmethod
    def forward(x, gathers, replicated, compute, reduce):  # type: ignore[override]
        y = x.to(compute)
        for dim, group in gathers:
            y = C._ag(y, dim, group)
        return y if y is not x else x.view_as(x)  # an autograd.Function must not return its input

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, ctx.gathers, ctx.replicated, _compute, ctx.reduce = inputs
        ctx.dtype = x.dtype

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        g = g.to(ctx.reduce)
        for dim, group in reversed(ctx.gathers):
            g = C._rs(g, dim, group)
        for group in ctx.replicated:
            g = C._ar(g, group)
        return g.to(ctx.dtype), None, None, None, None


def gather_leaf(
    x: torch.Tensor,
    s: Sharding,
    layout: Layout,
    *,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The compute view of one local shard: gathered over its data axes (tp / ep stay split).

    Backward: reduce-scatter over the axes gathered here, all-reduce over the
    data axes the leaf is replicated on (cheapest order: the all-reduce runs on
    the shard, after the reduce-scatter). ``compute_dtype`` (default: the
    shard's) is what the shard is cast to before the gather, so the gathered
    bytes are the compute dtype's; ``reduce_dtype`` (default: the shard's)
    is what the gradient is reduced in. The gradient returned to the shard is
    in the shard's dtype.
    """
    stored = set(s.mesh_axes())
    # a leaf split over ep (routed experts) gets its whole gradient back through EP's all-to-all
    replicated = tuple(layout.group(a) for a in layout.data_axes() if a not in stored)
    inner_first = reversed([a for a in s.mesh_axes() if a in GATHERED_AXES])
    gathers = tuple((s.dim_of(a), layout.group(a)) for a in inner_first if layout.group(a) is not None)
    compute = x.dtype if compute_dtype is None or not x.is_floating_point() else compute_dtype
    reduce = x.dtype if reduce_dtype is None or not x.is_floating_point() else reduce_dtype
    if not gathers and not replicated:
        return x.to(compute)  # nothing to communicate: the cast alone (its backward casts the gradient back)
    return _Unshard.apply(x, gathers, replicated, compute, reduce)


def _dtypes(path: str, x: torch.Tensor, precision: MixedPrecision | None) -> tuple[torch.dtype, torch.dtype]:
    """``(compute, reduce)`` dtypes of one leaf under ``precision`` (its own dtype where the policy keeps it)."""
    if precision is None or (precision.keep and precision.keeps(path)) or not x.is_floating_point():
        return x.dtype, x.dtype
    return precision.compute_dtype, precision.reduce_dtype


def per_layer_bucket(path: str) -> str:
    """FlexShard's default bucket of a leaf: its transformer layer (``layers.<i>``), or ``rest``."""
    parts = path.split(".")
    return f"layers.{parts[1]}" if parts[0] == "layers" and len(parts) > 2 else "rest"


class Buckets:
    """The leaves of a params view by bucket, gathered a bucket at a time (one collective per bucket and
    kind) the first time the model reads any of its leaves."""

    def __init__(self, local: Any, shardings: Any, layout: Layout, precision: MixedPrecision | None,
                 bucket_of: Callable[[str], str], quantize: str | None = None) -> None:  # fmt: skip
        paths, xs, _ = tree.flatten_with_paths(local)
        self.leaves = dict(zip(paths, zip(xs, tree.leaves(shardings), strict=True), strict=True))
        self.members: dict[str, list[str]] = {}
        for path in paths:
            self.members.setdefault(bucket_of(path), []).append(path)
        self.bucket_of, self.layout, self.precision, self.quantize = bucket_of, layout, precision, quantize
        self.cache: dict[str, torch.Tensor] = {}

    def get(self, path: str) -> torch.Tensor:
        if path not in self.cache:
            self._gather(self.members[self.bucket_of(path)])
        return self.cache[path]

    def _gather(self, paths: list[str]) -> None:
        layout = self.layout
        units: dict[tuple[Any, ...], list[str]] = {}
        for path in paths:
            x, s = self.leaves[path]
            if not isinstance(x, torch.Tensor):
                self.cache[path] = x
                continue
            compute, reduce = _dtypes(path, x, self.precision)
            stored = set(s.mesh_axes())
            replicated = tuple(a for a in layout.data_axes() if a not in stored)
            gathers = [a for a in s.mesh_axes() if a in GATHERED_AXES and layout.group(a) is not None]
            dim = s.dim_of("dp_shard")
            if gathers == ["dp_shard"] and len(s.dims[dim]) == 1 and x.is_floating_point():
                units.setdefault(("packed", replicated, compute, reduce), []).append(path)
            elif not gathers and replicated and x.is_floating_point():
                units.setdefault(("replicated", replicated, compute, reduce), []).append(path)
            else:  # anything else (split over cp or dp_replicate too; integer leaves): on its own, as before
                self.cache[path] = gather_leaf(x, s, layout, compute_dtype=compute, reduce_dtype=reduce)
        for key, members in units.items():
            parts = [self.leaves[p][0] for p in members]
            groups = tuple(layout.group(a) for a in key[-3])
            if key[0] == "packed":  # FlexShard's packed gather: even Shard parts over dp_shard
                from ftitan.flexshard.packed import packed_gather

                group = layout.group("dp_shard")
                dims = [self.leaves[p][1].dim_of("dp_shard") for p in members]
                outs = packed_gather(parts, None, dims, group,
                                     compute=key[-2], reduce=key[-1], replicated=groups,
                                     quantize=self.quantize)  # fmt: skip
            else:
                from ftitan.flexshard.packed import replicated

                outs = replicated(parts, groups, compute=key[-2], reduce=key[-1])
            self.cache.update(zip(members, outs, strict=True))


class _Gathered(Mapping[str, Any]):
    """Read-only params view that gathers a leaf (or its bucket) the first time the model reads it."""

    def __init__(
        self,
        local: Mapping[str, Any],
        shardings: Mapping[str, Any],
        layout: Layout,
        precision: MixedPrecision | None,
        prefix: str = "",
        buckets: Buckets | None = None,
    ) -> None:
        self._local, self._shardings, self._layout = local, shardings, layout
        self._precision, self._prefix, self._buckets = precision, prefix, buckets
        self._memo: dict[str, Any] = {}

    def _leaf(self, path: str, x: torch.Tensor, s: Sharding) -> torch.Tensor:
        if self._buckets is not None:
            return self._buckets.get(path)
        compute, reduce = _dtypes(path, x, self._precision)
        return gather_leaf(x, s, self._layout, compute_dtype=compute, reduce_dtype=reduce)

    def __getitem__(self, key: str) -> Any:
        if key not in self._memo:
            x, s = self._local[key], self._shardings[key]
            path = f"{self._prefix}{key}"
            if isinstance(x, Mapping):
                self._memo[key] = _Gathered(x, s, self._layout, self._precision, f"{path}.", self._buckets)
            else:
                self._memo[key] = self._leaf(path, x, s) if isinstance(x, torch.Tensor) else x
        return self._memo[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._local)

    def __len__(self) -> int:
        return len(self._local)


BUCKETS = ("per_layer", "per_leaf")  # FlexShard's bucket policies for dp_shard


def gathered(
    local: tree.Tree,
    shardings: tree.Tree,
    layout: Layout,
    *,
    precision: MixedPrecision | None = None,
    buckets: str | Callable[[str], str] = "per_layer",
    quantize: str | None = None,
) -> Mapping[str, Any]:
    """The params view for compute: leaves gathered lazily, layer by layer, as the model reads them.

    ``buckets`` (FlexShard): ``"per_layer"`` gathers a layer's leaves stored split over ``dp_shard`` in
    one all-gather of their packed parts (their gradients: one reduce-scatter, then one all-reduce per
    data axis they are replicated on) and its replicated leaves' gradients in one all-reduce per axis,
    the first time the model reads any leaf of the layer; ``"per_leaf"`` a collective per leaf; or a
    function from a leaf's dotted path to its bucket's name. Leaves split over other gathered axes
    (``cp``, ``dp_replicate``) are gathered on their own either way. ``quantize`` (``"int8"`` / ``"fp8"``,
    with bucketed gathers): a bucket's dp_shard parts travel blockwise-quantized, 128 values a scale
    (``ftitan.flexshard.quant``); gradients stay in full precision.

    With ``precision`` each leaf (its ``keep`` globs aside) is gathered in its ``compute_dtype`` and
    its gradient reduced in its ``reduce_dtype`` (:func:`gather_leaf`).
    """
    if not isinstance(local, Mapping):
        raise TypeError(f"gathered: params must be a dict tree, got {type(local).__name__}")
    if isinstance(buckets, str) and buckets not in BUCKETS:
        raise ValueError(f"gathered: buckets={buckets!r}; expected one of {BUCKETS} or a path -> bucket function")
    bucket_of = per_layer_bucket if buckets == "per_layer" else None if buckets == "per_leaf" else buckets
    if quantize is not None and bucket_of is None:
        raise ValueError(f"gathered: quantize={quantize!r} quantizes bucketed gathers; use buckets='per_layer'")
    packer = None if bucket_of is None else Buckets(local, shardings, layout, precision, bucket_of, quantize)
    return _Gathered(local, shardings, layout, precision, buckets=packer)
