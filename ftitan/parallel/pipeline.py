"""Pipeline parallelism: the layers split into stages over the mesh's ``pp`` axis, run over micro-batches.

Each ``pp`` rank holds one stage (:func:`stage_params`): consecutive blocks
``layers.{i}`` for ``i`` in :func:`stage_layers` (keeping their global
names), plus ``embed`` on the first stage and everything else outside
``layers`` (``norm``, ``head``) on the last. The model runs a stage through
``Model.stage`` (see :class:`ftitan.models.base.StageFn`); inside a stage
the FSDP / TP / CP seams work as in :func:`ftitan.parallel.make_train_step`.

The local batch is split along its rows into ``n_microbatches`` equal
micro-batches. A schedule is data: per stage, a list of actions
``("F", m)`` (forward micro-batch ``m``: receive its activation from the
previous stage, run the stage, send the output on) and ``("B", m)``
(backward: receive the gradient of that output from the next stage, back-
propagate, send the input's gradient back). One executor runs any list:

- GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural
  Networks using Pipeline Parallelism"): every forward, then every backward;
  a stage holds the activations of all ``M`` micro-batches at once.
- 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM"; PipeDream-Flush): stage ``s``
  of ``pp`` runs ``pp - s - 1`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards; it holds at
  most ``pp - s`` micro-batches' activations, and has GPipe's bubble.

Activations and their gradients move point-to-point between neighbouring
stages (``isend`` / blocking ``recv`` on the ``pp`` group; sends never block,
so any schedule whose dependencies are acyclic cannot deadlock), counted as
``"send"`` bytes by :func:`ftitan.parallel.collectives.count_bytes`.

Weighting: the last stage takes micro-batch ``m``'s mean cross-entropy
times ``n_m / n_global / tp`` (``n_m`` its tokens with a target,
``n_global`` those of the whole step over every data-parallel rank), as
:func:`ftitan.parallel.make_parallel_loss` does for a whole batch: summed over
micro-batches and ranks, losses and gradients are those of the global mean.

MoE families (``Model.apply_with_aux``; their stages also return each MoE
layer's router statistics, :class:`ftitan.models.base.StageOut`): the
Switch balancing loss pools the statistics over every layer before its
product, ``LB = E sum_e (C_e / R) (P_e / R)`` (``C``: expert counts, ``P``:
router-probability sums, ``R``: rows, each summed over layers; see
``nn.moe.load_balancing_loss``), so per-stage losses do not add. But ``C``
and ``R`` are piecewise constant (no gradient), and ``LB`` is linear in
``P``: ``LB = sum_s E <C, P_s> / R^2`` with ``P_s`` the sum over stage
``s``'s layers, exactly, in value and gradient, once every stage knows the
totals ``C`` and ``R``. So each forward sends, after the activation, a
packet ``(C, P, R)`` (detached, ``2E + 1`` floats) accumulated over the
stages so far; the last stage holds the totals of micro-batch ``m`` and
sends them back with the gradients, and each stage's backward of ``m``
adds its term ``c E <C, P_s> / R^2``, weighted like the cross-entropy
(``n_m / n_global / tp``). Each term is the balancing loss of micro-batch
``m`` (its statistics summed over the data axes), as with gradient
accumulation: the objective is ``sum_m n_m / n_global (CE_m + c LB_m)``.
The router loads (``moe.tokens_per_expert`` (L_moe, E), summed over
micro-batches) are summed over ``pp`` after the step, so every stage
reports, and DeepSeek-V3's ``update_buffers`` reads, the whole model's.

FSDP inside a stage: each leaf is gathered once per step (not per
micro-batch), a layer's leaves in one collective (FlexShard's per-layer
buckets, ``parallel.gathered``); micro-batch gradients accumulate on the
gathered weights and are reduce-scattered / all-reduced once, after the last backward (what
TorchTitan does for PP with FSDP: no reshard between micro-batches).

>>> grad_fn = pipeline_grad(model, layout, schedule="1f1b", n_microbatches=4)
>>> step = parallel.make_train_step(None, opt, layout, grad_fn=grad_fn)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from ftitan import tree as T
from ftitan.models.base import Model
from ftitan.parallel import collectives as C
from ftitan.parallel.expert import global_stats
from ftitan.parallel.layout import Layout, use
from ftitan.parallel.shard import Buckets, per_layer_bucket
from ftitan.parallel.step import loss_share
from ftitan.train.losses import IGNORE_INDEX, cross_entropy

__all__ = [
    "SCHEDULES",
    "Action",
    "gpipe",
    "one_f_one_b",
    "pipeline_grad",
    "schedule_actions",
    "stage_layers",
    "stage_params",
]

Action = tuple[Literal["F", "B"], int]  # (forward | backward, micro-batch index)
Schedule = Literal["gpipe", "1f1b"]
GradFn = Callable[[Any, Any], tuple[Any, tuple[torch.Tensor, dict[str, torch.Tensor]]]]


# ---------------------------------------------------------------- stages


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """The blocks of ``stage`` (of ``pp``): an even split of ``range(n_layers)``, earlier stages taking
    the one extra block of a remainder (the last stage also runs the head and the loss)."""
    if pp > n_layers:
        raise ValueError(
            f"pipeline: pp={pp} stages for a model of {n_layers} layers; every stage needs a layer, "
            f"use pp <= {n_layers}"
        )
    if not 0 <= stage < pp:
        raise ValueError(f"pipeline: stage {stage} is not in range({pp})")
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def _family(model: Model) -> str:
    return type(model.config).__module__.rsplit(".", 1)[-1]


def _check_staged(model: Model, pp: int) -> None:
    family = _family(model)
    if pp > 1 and model.stage is None:
        raise ValueError(
            f"pipeline parallel: the {family} Model has no `stage` function, so it cannot be split into "
            f"pp={pp} stages; use pp=1, or a family that has one (llama, qwen3, qwen3_moe, deepseek_v3)"
        )
    if pp > 1 and getattr(model.config, "tie_embeddings", False):
        raise ValueError(
            f"pipeline parallel: {family}.Config.tie_embeddings=True ties the output head (last stage) to the "
            f"embedding (first stage), which pp={pp} puts on different ranks; set tie_embeddings=False or pp=1"
        )


def stage_params(params: Mapping[str, Any], model: Model, layout: Layout) -> dict[str, Any]:
    """The subtree this ``pp`` rank holds: its ``layers.{i}`` (global names), ``embed`` on the first
    stage, every other top-level entry (``norm``, ``head``) on the last.

    Works on any tree shaped like the params (DTensors from ``shard_params``,
    ``model.param_axes``); with ``pp == 1`` it is ``params``.
    """
    pp, stage = layout.sizes["pp"], layout.coords["pp"]
    _check_staged(model, pp)
    if "layers" not in params:
        raise ValueError(f"stage_params: params have no 'layers' subtree to split (top level: {sorted(params)})")
    n_layers = model.config.n_layers
    if len(params["layers"]) != n_layers:
        raise ValueError(f"stage_params: params hold {len(params['layers'])} layers, the config {n_layers}")
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key == "layers":
            out[key] = {str(i): value[str(i)] for i in stage_layers(n_layers, pp, stage)}
        elif (key == "embed" and stage == 0) or (key != "embed" and stage == pp - 1):
            out[key] = value
    return out


# ---------------------------------------------------------------- schedules as data


def gpipe(n_stages: int, stage: int, n_microbatches: int) -> list[Action]:
    """GPipe (Huang et al. 2019): every micro-batch forward, then every one backward."""
    del n_stages, stage  # the same on every stage
    return [("F", m) for m in range(n_microbatches)] + [("B", m) for m in range(n_microbatches)]


def one_f_one_b(n_stages: int, stage: int, n_microbatches: int) -> list[Action]:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): ``n_stages - stage - 1`` warm-up forwards, then
    one forward and one backward at a time, then the remaining backwards (at most ``n_stages - stage``
    micro-batches in flight)."""
    warmup = min(n_stages - stage - 1, n_microbatches)
    actions: list[Action] = [("F", m) for m in range(warmup)]
    for m in range(warmup, n_microbatches):
        actions += [("F", m), ("B", m - warmup)]
    actions += [("B", m) for m in range(n_microbatches - warmup, n_microbatches)]
    return actions


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def schedule_actions(schedule: str, n_stages: int, stage: int, n_microbatches: int) -> list[Action]:
    """The action list of ``stage`` (of ``n_stages``) for ``schedule`` (``"gpipe"`` or ``"1f1b"``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: schedule={schedule!r}; use one of {sorted(SCHEDULES)}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"pipeline: n_microbatches={n_microbatches!r} must be an int >= 1")
    return SCHEDULES[schedule](n_stages, stage, n_microbatches)


# ---------------------------------------------------------------- point-to-point

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # int64s: dtype code, ndim, shape (up to 6 dims)


class _Neighbours:
    """Sends (non-blocking, counted) and receives (blocking) between stages of the ``pp`` group."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.group = layout.mesh["pp"].get_group() if layout.sizes["pp"] > 1 else None
        self.device = device
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, x: torch.Tensor, stage: int) -> None:
        x = x.detach().contiguous()
        C.record("send", x.numel() * x.element_size())
        self.pending.append((dist.isend(x, group=self.group, group_dst=stage), x))  # x kept alive until wait

    def recv(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, stage: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, group=self.group, group_src=stage)
        return buf

    def send_header(self, x: torch.Tensor, stage: int) -> None:
        """The shape and dtype of the activations to come (once per step; micro-batches are equal)."""
        if x.dim() > _HEADER - 2 or x.dtype not in _DTYPES:
            raise ValueError(f"pipeline: cannot send a stage output of shape {tuple(x.shape)} and dtype {x.dtype}")
        header = [_DTYPES.index(x.dtype), x.dim(), *x.shape] + [0] * (_HEADER - 2 - x.dim())
        self.send(torch.tensor(header, dtype=torch.int64, device=self.device), stage)

    def recv_header(self, stage: int) -> tuple[tuple[int, ...], torch.dtype]:
        header = self.recv((_HEADER,), torch.int64, stage).tolist()
        return tuple(header[2 : 2 + header[1]]), _DTYPES[header[0]]

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


# ---------------------------------------------------------------- the executor


class _StageRun:
    """One step of one stage: ``forward(m)`` / ``backward(m)`` per action, activations kept in between."""

    def __init__(
        self, model: Model, layout: Layout, params: Any, micro: list[dict[str, torch.Tensor]], n_global: torch.Tensor,
        *, layers: range, chunk_size: int, device: torch.device,
    ) -> None:  # fmt: skip
        self.model, self.layout, self.params, self.micro = model, layout, params, micro
        self.n_global, self.layers, self.chunk_size = n_global, layers, chunk_size
        self.stage, self.n_stages = layout.coords["pp"], layout.sizes["pp"]
        self.first, self.last = self.stage == 0, self.stage == self.n_stages - 1
        self.p2p = _Neighbours(layout, device)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # m -> (stage input, output or loss)
        self.in_shape: tuple[tuple[int, ...], torch.dtype] | None = None
        self.header_sent = False
        self.loss = torch.zeros((), device=device)
        self.moe = _MoETerms(model, layout, device) if model.apply_with_aux is not None else None

    def forward(self, m: int) -> None:
        if self.first:
            x = self.micro[m]["inputs"]  # (b, T) int
        else:
            if self.in_shape is None:
                self.in_shape = self.p2p.recv_header(self.stage - 1)
            x = self.p2p.recv(*self.in_shape, self.stage - 1).requires_grad_()  # (b, T, D)
        out, stats, _ = self.model.stage(self.params, x, layers=self.layers, first=self.first, last=self.last)
        if self.moe is not None:
            before = None if self.first else self.p2p.recv((self.moe.packet_size,), torch.float32, self.stage - 1)
            packet = self.moe.forward(m, stats, before)
        if self.last:
            targets = self.micro[m]["targets"]
            ce = cross_entropy(out.reshape(-1, out.shape[-1]), self.model.head(self.params),
                                       targets.reshape(-1), chunk_size=self.chunk_size,
                                       logit_softcap=self.model.logit_softcap)  # fmt: skip
            n_m = (targets != IGNORE_INDEX).sum()
            out = loss_share(ce, n_m, self.n_global, self.layout)
            self.loss = self.loss + out.detach()
            if self.moe is not None:
                self.moe.totals[m] = packet
                self.moe.record_loss(packet, n_m)
        else:
            if not self.header_sent:
                self.p2p.send_header(out, self.stage + 1)
                self.header_sent = True
            self.p2p.send(out, self.stage + 1)
            if self.moe is not None:
                self.p2p.send(packet, self.stage + 1)
        self.saved[m] = (x, out)

    def backward(self, m: int) -> None:
        x, out = self.saved.pop(m)
        outs, grads = [out], [None if self.last else self.p2p.recv(out.shape, out.dtype, self.stage + 1)]
        if self.moe is not None:
            totals = self.moe.totals.pop(m) if self.last else self.p2p.recv(
                (self.moe.packet_size,), torch.float32, self.stage + 1)  # fmt: skip
            n_m = (self.micro[m]["targets"] != IGNORE_INDEX).sum()
            aux = self.moe.backward_term(m, totals)
            if aux is not None:  # this stage's share of the balancing loss, weighted like the cross-entropy
                aux = loss_share(aux, n_m, self.n_global, self.layout)
                self.loss = self.loss + aux.detach()
                outs.append(aux)
                grads.append(torch.ones_like(aux))
        torch.autograd.backward(outs, grads)
        if not self.first:
            self.p2p.send(x.grad if x.grad is not None else torch.zeros_like(x), self.stage - 1)
            if self.moe is not None:
                self.p2p.send(totals, self.stage - 1)


class _MoETerms:
    """A stage's part of the balancing loss and router-load metrics (see the module doc).

    A packet is ``(C (E,), P (E,), R (1,))``: expert counts, router-probability
    sums and rows, summed over the data axes and over the layers of the
    stages so far (detached; the stage keeps its own differentiable ``P_s``).
    """

    def __init__(self, model: Model, layout: Layout, device: torch.device) -> None:
        moe_cfg = model.config.moe
        self.layout, self.n_layers, self.device = layout, model.config.n_layers, device
        self.n_experts, self.coef = moe_cfg.n_experts, moe_cfg.aux_loss_coef
        self.packet_size = 2 * self.n_experts + 1
        self.probs: dict[int, torch.Tensor] = {}  # m -> this stage's P_s (E,), differentiable
        self.totals: dict[int, torch.Tensor] = {}  # m -> the whole model's packet (last stage, forward to backward)
        self.load: dict[int, torch.Tensor] = {}  # layer -> counts (E,) summed over micro-batches
        self.lb: list[tuple[torch.Tensor, torch.Tensor]] = []  # (n_m local, LB_m) per micro-batch (last stage)

    def forward(self, m: int, stats: Mapping[int, Any], before: torch.Tensor | None) -> torch.Tensor:  # (2E+1,)
        """Sum this stage's statistics of micro-batch ``m`` over the data axes; the packet after it."""
        packet = torch.zeros(self.packet_size, device=self.device) if before is None else before
        if not stats:
            return packet
        layers = list(stats)
        pooled = global_stats([stats[i] for i in layers])  # differentiable sums over the data axes
        for i, s in zip(layers, pooled, strict=True):
            self.load[i] = self.load.get(i, 0) + s.counts
        self.probs[m] = torch.stack([s.prob_sum for s in pooled]).sum(0)
        own = torch.cat([torch.stack([s.counts for s in pooled]).sum(0), self.probs[m].detach(),
                         torch.stack([s.n_tokens for s in pooled]).sum().reshape(1)])  # fmt: skip
        return packet + own.to(packet.dtype)

    def _split(self, packet: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        e = self.n_experts
        return packet[:e], packet[e : 2 * e], packet[2 * e].clamp(min=1)

    def backward_term(self, m: int, totals: torch.Tensor) -> torch.Tensor | None:
        """``c E <C, P_s> / R^2`` of micro-batch ``m`` (``None`` on a stage without MoE layers): its
        gradient is exactly ``c dLB/dP_s``, and the terms of all stages sum to ``c LB``."""
        probs = self.probs.pop(m, None)
        if probs is None:
            return None
        counts, _, rows = self._split(totals)
        return self.coef * self.n_experts * torch.dot(counts, probs.to(counts.dtype)) / rows**2

    def record_loss(self, totals: torch.Tensor, n_m: torch.Tensor) -> None:
        counts, probs, rows = self._split(totals)
        self.lb.append((n_m, self.n_experts * torch.dot(counts, probs) / rows**2))

    def metrics(self, n_global: torch.Tensor) -> dict[str, torch.Tensor]:
        """The whole model's ``moe.*`` metrics of the step (equal on every rank): loads summed over ``pp``,
        the balancing loss (token-weighted over micro-batches) from the last stage."""
        e = self.n_experts
        packed = torch.zeros(self.n_layers, e + 1, device=self.device)  # counts, "is MoE" per layer
        for i, counts in self.load.items():
            packed[i, :e], packed[i, e] = counts, 1.0
        lb = torch.zeros((), device=self.device)
        if self.lb:
            n = self.layout.sum(torch.stack([n for n, _ in self.lb]).to(lb.dtype), self.layout.data_axes())
            lb = (n / n_global * torch.stack([x for _, x in self.lb])).sum()
        flat = self.layout.sum(torch.cat([packed.reshape(-1), lb.reshape(1)]), ("pp",))
        packed, lb = flat[:-1].view(self.n_layers, e + 1), flat[-1]
        tokens = packed[packed[:, e] > 0, :e]  # (L_moe, E)
        max_load = (tokens.amax(-1) / tokens.mean(-1).clamp(min=1e-9)).amax()
        return {"moe.aux_loss": lb, "moe.tokens_per_expert": tokens, "moe.max_load": max_load}


def _execute(actions: list[Action], run: _StageRun) -> None:
    """Run a stage's action list (any schedule), then wait for its sends."""
    for kind, m in actions:
        if kind == "F":
            run.forward(m)
        elif kind == "B":
            run.backward(m)
        else:
            raise ValueError(f"pipeline: unknown action {(kind, m)!r}; actions are ('F' | 'B', micro-batch)")
    if run.saved:
        raise RuntimeError(f"pipeline: micro-batches {sorted(run.saved)} were forwarded but never backwarded")
    run.p2p.wait()


def _split(batch: Mapping[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    if "inputs" not in batch or "targets" not in batch:
        raise ValueError(f"pipeline: batch needs 'inputs' and 'targets' (B, T), got {sorted(batch)}")
    b = batch["inputs"].shape[0]
    if b % n:
        raise ValueError(
            f"pipeline: the local batch of {b} rows does not split into n_microbatches={n}; "
            f"use a divisor of {b} (or a local batch that is a multiple of {n})"
        )
    return [{k: v[i * (b // n) : (i + 1) * (b // n)] for k, v in batch.items()} for i in range(n)]


# ---------------------------------------------------------------- the grad function


def pipeline_grad(
    model: Model,
    layout: Layout,
    *,
    schedule: Schedule = "1f1b",
    n_microbatches: int = 4,
    chunk_size: int = 1024,
) -> Callable[[Any], GradFn]:
    """``make(shardings) -> grad_fn`` for ``parallel.make_train_step(..., grad_fn=...)``.

    ``grad_fn(local_stage_params, local_batch) -> (grads, (loss, aux))``:
    the next-token loss of ``model`` (chunked cross-entropy against
    ``model.head``, chunks of ``chunk_size`` tokens) run as a pipeline over
    this rank's stage (``stage_params``; ``shardings`` those of its leaves),
    with ``schedule`` over ``n_microbatches`` micro-batches of the local
    batch ``{"inputs", "targets"}`` (B, T). ``loss`` is this rank's weighted
    part (every rank's sum to the global mean, see the module doc; MoE
    families add each stage's share of the balancing loss), ``aux`` is
    ``{"n_tokens"}``, plus the ``moe.*`` metrics of the whole model for MoE
    families; ``grads`` are the stage's,
    already reduced over the data axes.
    """
    pp, stage = layout.sizes["pp"], layout.coords["pp"]
    _check_staged(model, pp)
    if model.stage is None:
        raise ValueError(f"pipeline_grad: the {_family(model)} Model has no `stage` function")
    layers = stage_layers(model.config.n_layers, pp, stage)
    actions = schedule_actions(schedule, pp, stage, n_microbatches)

    def make(shardings: Any) -> GradFn:
        def grad_fn(local_params: Any, batch: Any) -> tuple[Any, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
            with use(layout), torch.enable_grad():
                return _step(model, layout, shardings, local_params, batch, actions, layers, n_microbatches, chunk_size)

        return grad_fn

    return make


def _step(
    model: Model, layout: Layout, shardings: Any, local_params: Any, batch: Any, actions: list[Action],
    layers: range, n_microbatches: int, chunk_size: int,
) -> tuple[Any, tuple[torch.Tensor, dict[str, torch.Tensor]]]:  # fmt: skip
    paths, leaves, treedef = T.flatten_with_paths(local_params)
    diff = [x.is_floating_point() for x in leaves]
    inputs = [x.detach().requires_grad_(d) for x, d in zip(leaves, diff, strict=True)]
    # gathered once per step (FSDP, FlexShard's per-layer buckets); micro-batch gradients accumulate on detached copies
    packer = Buckets(T.unflatten(treedef, inputs), shardings, layout, None, per_layer_bucket)
    full = [packer.get(p) if d else x for p, x, d in zip(paths, inputs, diff, strict=True)]
    compute = [f.detach().requires_grad_(d) for f, d in zip(full, diff, strict=True)]

    micro = _split(batch, n_microbatches)
    n_local = (batch["targets"] != IGNORE_INDEX).sum()
    n_global = layout.sum(n_local, layout.data_axes()).clamp(min=1)
    run = _StageRun(model, layout, T.unflatten(treedef, compute), micro, n_global, layers=layers,
                    chunk_size=chunk_size, device=n_global.device)  # fmt: skip
    _execute(actions, run)

    # one reduction per bucket (reduce-scatter over dp_shard, all-reduce where replicated) of the summed grads
    pairs = [(f, c.grad if c.grad is not None else torch.zeros_like(c), x)
             for f, c, x, d in zip(full, compute, inputs, diff, strict=True) if d]  # fmt: skip
    reduced = iter(torch.autograd.grad([p[0] for p in pairs], [p[2] for p in pairs], [p[1] for p in pairs],
                                       allow_unused=True, materialize_grads=True) if pairs else ())  # fmt: skip
    grads = [next(reduced) if d else torch.zeros_like(x) for x, d in zip(leaves, diff, strict=True)]
    aux = {"n_tokens": n_local, **(run.moe.metrics(n_global) if run.moe is not None else {})}
    return T.unflatten(treedef, grads), (run.loss, aux)
