"""The parallel train step: the same loss function, run on local shards, with a sharded optimizer.

``make_train_step(loss_fn, optimizer, layout)`` returns ``step(state, batch)
-> (state, metrics)`` like ``ftitan.train.make_train_step``; ``state.params``
and ``state.opt_state`` hold DTensors (from :func:`shard_params`), ``batch``
is this rank's part of the global batch (:func:`shard_batch`).

Inside, per step:
1. the loss runs on the local shards through the gathered params view
   (FSDP gathers per layer; the seams in ``parallel.activations`` do TP / SP
   / CP), and is weighted so that summing every rank's gradient gives the
   gradient of the global mean: ``loss * n_local / n_global / tp``;
2. gradients come from ``torch.autograd.grad`` over the local leaves (see
   ``parallel.collectives`` for why not ``torch.func`` here); they are
   already reduced, and are placed back as DTensors like the params;
3. the optimizer runs on DTensors, so global norms (clipping) and Muon's
   whole-matrix algebra see the full tensors, and every optimizer of
   ``ftitan.optim`` works unchanged.

``compile=True`` (or a backend name, e.g. ``"aot_eager"``) compiles steps
1-2 with ``fullgraph=True``; ``compile="regional"`` (``"regional:<backend>"``)
compiles each block once instead (``ftitan.train.regional``). A compiled
step also compiles step 3 where the optimizer is ``Transform.leafwise``
(AdamW, SGD, behind clipping and the non-finite guard): each rank updates
its own shards, layer by layer through one compiled update per layer kind
(``ftitan.train.step.LayerUpdate``), given the whole gradient's sum of
squares and non-finite flags, which one all-reduce per mesh axis of a
vector (two numbers a leaf) brings; the other optimizers (Muon) run
eagerly on DTensors.

``precision`` (``ftitan.train.MixedPrecision``) moves step 1 to its
compute dtype: each local shard is cast before its FSDP all-gather (the
gathered bytes are the compute dtype's), the model runs on the cast view,
and in backward each gradient is cast to the reduce dtype before the
reduce-scatter / all-reduce over the data axes, arriving in the master
dtype. Params, gradients and optimizer state stay in the master dtype; the
loss is float32.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import implicit_replication

from ftitan import optim
from ftitan import tree as T
from ftitan.parallel import collectives as C
from ftitan.parallel.activations import split_sequence
from ftitan.parallel.layout import Layout, use
from ftitan.parallel.rules import Sharding
from ftitan.parallel.shard import from_local, gathered, local_shard, to_local
from ftitan.train import regional
from ftitan.train.precision import MixedPrecision
from ftitan.optim.masking import merge, subset
from ftitan.train.state import Trainable, TrainState
from ftitan.train.step import LayerUpdate, update_runs_by_layers, value_and_grad

__all__ = ["loss_share", "make_parallel_loss", "make_train_step", "shard_batch", "sharding_of"]

# DTensor warns on every reduction of a leaf that is partial over several mesh axes (global norms of
# our gradients) that one flattened collective would be faster; correct, and not actionable per step
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def sharding_of(x: Any) -> Sharding:
    """The :class:`Sharding` of a DTensor on a ``parallel.mesh`` (replicated for a plain tensor)."""
    if not isinstance(x, DTensor):
        return Sharding(tuple(() for _ in range(x.dim())))
    dims: list[list[str]] = [[] for _ in range(x.dim())]
    for axis, p in zip(x.device_mesh.mesh_dim_names or (), x.placements, strict=True):
        if isinstance(p, Shard):
            dims[p.dim].append(axis)
    return Sharding(tuple(tuple(d) for d in dims))


def shard_batch(batch: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's part of a global batch: its rows (rule ``batch``), its head-tail sequence chunks (``cp``)."""
    index, count = layout.data_rank()

    def one(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % count:
            raise ValueError(
                f"shard_batch: batch size {x.shape[0]} does not split over {count} data-parallel ranks "
                f"(dp_replicate * dp_shard * ep); use a batch size divisible by {count}"
            )
        x = x.chunk(count, dim=0)[index]
        return split_sequence(x, layout, dim=1) if x.dim() > 1 else x

    return T.map(one, batch)


def loss_share(loss: torch.Tensor, n_local: torch.Tensor, n_global: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's share of the global mean: ``loss`` (a mean over ``n_local`` tokens) times
    ``n_local / n_global``, over ``tp`` (every tp rank computes the same loss). Summed over every
    rank, shares and their gradients are the global mean's."""
    return loss * (n_local / n_global) / layout.tp


def make_parallel_loss(
    loss_fn: Callable[[Any, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    layout: Layout,
    shardings: Any,
    *,
    precision: MixedPrecision | None = None,
    buckets: str | Callable[[str], str] = "per_layer",
    quantize: str | None = None,
) -> Callable[[Any, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """``loss_fn(params, batch)`` on local shards: ``(weighted local loss, aux)``.

    The weighted losses of all ranks sum to the global mean loss, and so do
    their gradients (``aux["n_tokens"]`` gives each rank's weight). With
    ``precision`` the params view is gathered in its compute dtype and the
    gradients reduced in its reduce dtype (``parallel.gathered``); the loss
    is returned in float32. ``buckets``: FlexShard's bucket policy for the
    gathers (``parallel.gathered``: a collective per layer, or per leaf); ``quantize``
    its blockwise-quantized all-gathers (``"int8"`` / ``"fp8"``).
    """
    data_axes = layout.data_axes()
    if precision is not None and precision.is_full:
        precision = None  # float32 throughout: the step without a policy

    def local_loss(local_params: Any, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        view = gathered(local_params, shardings, layout, precision=precision, buckets=buckets, quantize=quantize)
        loss, aux = loss_fn(view, batch)
        if precision is not None:
            loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
        n_local = aux["n_tokens"]
        n_global = layout.sum(n_local, data_axes).clamp(min=1)
        return loss_share(loss, n_local, n_global, layout), aux

    return local_loss


def _pp_sum(layout: Layout) -> Callable[[torch.Tensor], torch.Tensor]:
    def combine(sq: torch.Tensor) -> torch.Tensor:
        sq = sq.full_tensor() if isinstance(sq, DTensor) else sq
        return C.all_reduce_value(sq, layout.group("pp"))

    return combine


def _placed_like(x: Any, ref: Any) -> Any:
    if isinstance(x, DTensor) and isinstance(ref, DTensor) and x.placements != ref.placements:
        return x.redistribute(ref.device_mesh, ref.placements)
    return x


def _merge_aux(aux: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Metrics of the global batch: counts summed over data ranks, statistics averaged."""
    axes = layout.data_axes()
    n = 1
    for a in axes:
        n *= layout.sizes[a]
    out = {}
    for k, v in aux.items():
        total = layout.sum(v.detach().to(torch.float64) if v.is_floating_point() else v.detach(), axes)
        out[k] = total if not v.is_floating_point() else (total / n).to(v.dtype)
    return out


def _compiled(fn: Callable[..., Any], compile: bool | str) -> Callable[..., Any]:
    # static, as the single-process runtime: a run's batches have one shape (see docs/compile-and-memory.md)
    kw = {"backend": compile} if isinstance(compile, str) else {}
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, **kw)

    def run(*args: Any) -> Any:
        # dynamo traces torch.autograd.grad (the gradient path of parallel steps) only when asked to
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return compiled(*args)

    return run


def _copies(grads: Any, layout: Layout) -> list[int]:
    """Per leaf of ``grads`` (DTensors on ``layout.storage_mesh``), how many ranks hold each of its shards:
    every placement but Replicate splits a leaf (torch's ``_StridedShard`` is no ``is_shard()``)."""
    world = math.prod(layout.sizes[a] for a in layout.storage_axes)
    out = []
    for g in T.leaves(grads):
        placements = g.placements if isinstance(g, DTensor) else ()
        out.append(world // math.prod(g.device_mesh.size(i) for i, p in enumerate(placements) if not p.is_replicate()))
    return out


def _global_stats(squares: list[torch.Tensor], flags: list[torch.Tensor], copies: list[int],
                  layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The whole gradient's sum of squares and per-leaf non-finite flags (``LayerUpdate``'s statistics) from
    this rank's per-leaf ones (``LayerUpdate.leaf_stats`` of its shards): one all-reduce per storage-mesh axis
    of each leaf's sum of squares divided by its ``copies`` and of its flag (> 0 where any rank has one)."""
    acc = squares[0].dtype
    both = layout.sum(torch.stack([*(sq / n for sq, n in zip(squares, copies, strict=True)),
                                   *(f.to(acc) for f in flags)]), layout.storage_axes)  # fmt: skip
    return both[: len(squares)].sum(), both[len(squares) :] > 0


def make_train_step(
    loss_fn: Callable[[Any, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]] | None,
    optimizer: optim.Transform,
    layout: Layout,
    *,
    compile: bool | str = False,
    update_buffers: Callable[[Any, dict[str, torch.Tensor]], Any] | None = None,
    grad_fn: Callable[[Any], Callable[..., Any]] | None = None,
    precision: MixedPrecision | None = None,
    trainable: Trainable | None = None,
    buckets: str | Callable[[str], str] = "per_layer",
    quantize: str | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, torch.Tensor]]]:
    """A train step over ``layout``: ``step(state, local_batch) -> (state, metrics)`` (see the module doc).

    ``metrics`` are those of the global batch (``loss`` is the global mean,
    ``grad_norm`` the norm of the full gradient), the same on every rank.

    ``grad_fn(shardings) -> fn(local_params, local_batch) -> (grads, (loss, aux))``
    replaces the gradient of ``loss_fn`` (then unused, may be ``None``), e.g.
    ``parallel.pipeline_grad(model, layout, ...)`` for pipeline parallelism
    (``state.params`` then holds this rank's stage, ``parallel.stage_params``;
    keep ``compile=False``: its sends run eagerly). Its losses, summed over
    every rank, must be the global mean, like :func:`make_parallel_loss`'s.
    With ``pp > 1`` each rank's optimizer sees its stage's gradients; global
    norms (``clip_by_global_norm``, ``metrics["grad_norm"]``) add the squares
    of every stage (``ftitan.tree.norm_across``).

    ``precision`` (``ftitan.train.MixedPrecision``, e.g.
    ``MixedPrecision.from_names("fp32", "bf16", "fp32").for_model(model)``): gathers and
    compute in its compute dtype, data-parallel gradient reductions in its reduce dtype
    (see the module docstring). Not yet with ``grad_fn`` (pipeline parallelism).

    ``trainable`` (glob(s) or ``(path, leaf) -> bool``, e.g. ``ftitan.models.lora.TRAINABLE``) as in
    ``ftitan.train.make_train_step``: only those leaves are differentiated, hold optimizer state
    (``init_state(..., trainable=)``) and change; the others go into the loss as constants. Not yet
    with ``grad_fn``.

    ``buckets`` (FlexShard, ``parallel.gathered``): ``"per_layer"`` (default) gathers a layer's
    dp_shard-split leaves in one all-gather and reduces their gradients in one reduce-scatter;
    ``"per_leaf"`` a collective per leaf. ``quantize`` (``"int8"`` / ``"fp8"``): those all-gathers send
    blockwise-quantized parts (gradients stay in full precision).
    """
    if trainable is not None and grad_fn is not None:
        raise ValueError("parallel.make_train_step: trainable= with a grad_fn (pipeline parallelism) is not supported "
                         "yet; train every leaf under pp > 1")  # fmt: skip
    if grad_fn is None and loss_fn is None:
        raise ValueError("parallel.make_train_step: pass a loss_fn, or a grad_fn (e.g. parallel.pipeline_grad(...))")
    if grad_fn is not None and precision is not None and not precision.is_full:
        raise ValueError(
            f"parallel.make_train_step: precision={precision.names} with a grad_fn (pipeline parallelism) is "
            f"not supported yet; run pp > 1 in float32 (precision=None)"
        )
    cache: dict[Any, Callable[..., Any]] = {}
    # a compiled step compiles the update too, on each rank's shards, where it runs by layers (see the module doc)
    backend = regional.backend_of(compile) or ("inductor" if compile is True else compile or None)
    layered = None
    if backend is not None and grad_fn is None and layout.sizes["pp"] == 1 and update_runs_by_layers(
            optimizer, trainable=trainable
    ):
        layered = LayerUpdate(optimizer, backend, donate=False)

    def local_update(grads: Any, grads_local: Any, train: Any, opt_state: Any) -> tuple[Any, Any, Any] | None:
        """``(params, opt_state, grad_norm)`` from the compiled update of the local shards, or ``None``."""
        if layered is None or not layered.partitionable:
            return None
        params_local, state_local = T.map(local_shard, train), T.map(local_shard, opt_state)
        parts = LayerUpdate.parts_of(params_local, grads_local)
        if parts is None:
            return None
        total, bad = _global_stats(*layered.leaf_stats(parts, grads_local), _copies(grads, layout), layout)
        out = layered(parts, grads_local, state_local, params_local, total, bad)
        if out is None:
            return None
        new, state_new = out
        return from_local(new, train), from_local(state_new, opt_state), torch.sqrt(total)

    def grad_fn_for(params: Any) -> Callable[..., Any]:
        shardings = T.map(sharding_of, params)
        key = tuple(str(s) for s in T.leaves(shardings))
        if key not in cache:
            if grad_fn is not None:
                fn = grad_fn(shardings)
            else:
                local_loss = make_parallel_loss(loss_fn, layout, shardings, precision=precision, buckets=buckets,
                                                quantize=quantize)  # fmt: skip
                if trainable is not None:  # the selected leaves; the rest ride along with the batch
                    full_loss = local_loss

                    def local_loss(selected: Any, rest_and_batch: Any) -> Any:
                        rest, b = rest_and_batch
                        return full_loss(merge(rest, selected), b)

                fn = value_and_grad(local_loss, impl="autograd")
            if regional.backend_of(compile) is not None:  # "regional[:backend]": each block compiled once
                fn = regional.regional_step(fn, regional.backend_of(compile))
            elif compile:
                fn = _compiled(fn, compile)
            cache[key] = fn
        return cache[key]

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        grad_fn = grad_fn_for(state.params)
        local = to_local(state.params)
        train = state.params if trainable is None else subset(trainable, state.params)
        with use(layout):
            if trainable is None:
                grads_local, (loss, aux) = grad_fn(local, batch)
            else:
                grads_local, (loss, aux) = grad_fn(subset(trainable, local), (local, batch))
        grads = from_local(grads_local, train)
        compiled = local_update(grads, grads_local, train, state.opt_state)
        if compiled is not None:
            params, opt_state, grad_norm = compiled
        else:
            # with pp > 1 each rank holds one stage: norms (clipping, the metric) add every stage's squares
            across = T.norm_across(_pp_sum(layout)) if layout.sizes["pp"] > 1 else contextlib.nullcontext()
            with implicit_replication(), across:
                updates, opt_state = optimizer.update(grads, state.opt_state, train)
                # whole-matrix algebra (Muon's Newton-Schulz) may leave an update placed otherwise: keep
                # every param where the rules put it
                new = T.map(_placed_like, optim.apply_updates(train, updates), train)
                params = new if trainable is None else merge(state.params, new)
                grad_norm = T.global_norm(grads)
        axes = (*layout.data_axes(), "tp") if layout.tp > 1 else layout.data_axes()
        if layout.sizes["pp"] > 1:  # each pp rank holds one stage and its share of the loss
            axes = (*axes, "pp")
        metrics = {
            "loss": layout.sum(loss.detach(), axes),
            "grad_norm": grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm,
            **_merge_aux(aux, layout),
        }
        lr = optim.find_lr(opt_state)  # None for an optimizer without a learning-rate stage
        if lr is not None:
            metrics["lr"] = lr.full_tensor() if isinstance(lr, DTensor) else lr
        if update_buffers is not None:
            with implicit_replication():
                params = update_buffers(params, metrics)
        return TrainState(state.step + 1, params, opt_state, state.rng), metrics

    return step
