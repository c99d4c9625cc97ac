"""Where a run's steps execute: one process, or a torchrun world with a parallel layout.

The trainer talks to a ``Runtime`` and stays the same for both:
``place(params, model)`` (this rank's pipeline stage as DTensors on the
mesh, or the params as they are), ``make_step``,
``local_batch`` (this rank's rows and sequence chunks), ``eval_loss``,
``is_main`` (rank 0 writes files and shows progress) and ``device``
(where params, optimizer state and batches live: ``--device auto`` takes
CUDA when there is one, and under torchrun each rank takes ``LOCAL_RANK``'s
GPU). Checkpoints need nothing from it: each rank saves and loads its own
blocks (:mod:`ftitan.checkpoint`).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ftitan import parallel, random
from ftitan import tree as T
from ftitan.config.schema import ParallelConfig
from ftitan.kernels import onednn
from ftitan.models.base import Model
from ftitan.parallel.activations import split_sequence
from ftitan.train import memory, regional, rendezvous
from ftitan.train.precision import MixedPrecision, apply_precision
from ftitan.train.remat import memory_budget
from ftitan.train.step import make_train_step, update_runs_by_layers

__all__ = ["Runtime", "gradient_path", "resolve_backend", "resolve_device", "setup", "step_options"]

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
ONE_RANK_WORK_S = 1800.0  # how long barrier() waits for one rank's slow work (torch's default gloo timeout)


def resolve_device(name: str, *, local_rank: int = 0) -> torch.device:
    """``--device`` as a ``torch.device``: "auto" is CUDA when available, else the CPU; a CUDA device is
    ``cuda:local_rank`` (torchrun's ``LOCAL_RANK``: one GPU per process)."""
    if name not in DEVICES:
        raise ValueError(f"--device={name!r}: expected one of {DEVICES}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device='cuda': torch sees no CUDA device (torch.cuda.is_available() is False); "
                         "use --device cpu or auto (or install a CUDA build of torch)")  # fmt: skip
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"--device='cuda': LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are "
                         f"visible; launch at most that many processes per node (torchrun --nproc-per-node)")  # fmt: skip
    return torch.device("cuda", local_rank)


def resolve_backend(name: str, device: torch.device) -> str:
    """``--parallel.backend``: "auto" is NCCL on CUDA and gloo on the CPU; NCCL needs CUDA."""
    if name not in BACKENDS:
        raise ValueError(f"--parallel.backend={name!r}: expected one of {BACKENDS}")
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and device.type != "cuda":
        raise ValueError("--parallel.backend='nccl' needs CUDA devices; use --parallel.backend gloo (or auto) on CPU")
    return name


def _rules(cfg: ParallelConfig) -> parallel.Rules:
    rules = parallel.default_rules()
    return rules if cfg.sequence_parallel else rules.with_rule("norm_seq", ("cp",))


class Runtime:
    """A single process (``layout is None``) or this rank of a parallel world."""

    def __init__(
        self,
        layout: parallel.Layout | None,
        cfg: ParallelConfig,
        *,
        owns_group: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.layout, self.cfg = layout, cfg
        self.device = device if device is not None else torch.device("cpu")
        self.is_main = layout is None or dist.get_rank() == 0
        self._owns_group = owns_group  # close() leaves the process group only if setup() joined it

    @property
    def pp(self) -> int:
        return 1 if self.layout is None else self.layout.sizes["pp"]

    def use_placement(self, placement: str, model: Model) -> None:
        """FlexShard's storage placement for ``model``'s weights (``--flexshard.placement``): ``"shard"`` (the
        rules as they are: dp_shard splits each weight's model dim) or ``"block"`` (whole heads and experts
        per dp_shard rank, ``ftitan.flexshard.mesh.block_rules``). Before any params are placed."""
        if self.layout is None or placement == "shard":
            return
        from ftitan.flexshard.mesh import block_rules

        self.layout = parallel.Layout(self.layout.mesh, block_rules(self.layout.rules, model, self.layout.sizes))

    def place(self, params: Any, model: Model) -> Any:
        """``params`` (full, e.g. a single-process tree) as this rank holds them: its stage, split by the rules."""
        if self.layout is None:
            return T.map(lambda x: x.to(self.device), params)
        axes = model.param_axes
        if self.pp > 1:
            params, axes = parallel.stage_params(params, model, self.layout), parallel.stage_params(axes, model, self.layout)
        params = T.map(lambda x: x.to(self.device), params)
        return parallel.shard_params(params, axes, self.layout.rules, self.layout)

    def init_params(self, model: Model, key: torch.Tensor) -> Any:
        """This rank's params drawn directly on its device: its pipeline stage, only its blocks
        (``ftitan.parallel.init_params``: equal to slicing the single-process init; never the whole model)."""
        if self.layout is None:
            return model.init(key, device=self.device)
        return parallel.init_params(model, key, self.layout, device=self.device)

    def load_hf(self, model: Model, directory: str) -> Any:
        """This rank's params read from an HF checkpoint directory, only the slices it holds (safetensors
        ``get_slice``), in float32 masters on its device; checked against ``model``'s shapes."""
        from ftitan.models import fused, hf

        _, params = hf.load_hf_sharded(directory, self.layout, dtype=torch.float32, device=self.device)
        if getattr(model.config, "fuse_projections", False):  # the checkpoint's leaves (or this rank's shards), stacked
            params = fused.fuse_projections(params)
        paths, likes, _ = T.flatten_with_paths(model.init(random.key(0), device="meta"))
        got_paths, got_leaves, _ = T.flatten_with_paths(params)
        got = dict(zip(got_paths, got_leaves, strict=True))  # DTensors: global shapes; under pp, this stage's
        for path, like in zip(paths, likes, strict=True):
            if path not in got and self.pp > 1:
                continue
            if path not in got:
                raise ValueError(f"--init.hf={directory!r}: the checkpoint has no {path}; is it the same architecture "
                                 "as --model.*?")  # fmt: skip
            if tuple(got[path].shape) != tuple(like.shape):
                raise ValueError(f"--init.hf={directory!r}: {path} is {tuple(got[path].shape)} in the checkpoint but "
                                 f"{tuple(like.shape)} in the run's model; drop the --model.* flags that change it")
        return params

    def _pipeline(self, model: Model) -> Any:
        n = self.cfg.pp_microbatches or 2 * self.pp
        return parallel.pipeline_grad(model, self.layout, schedule=self.cfg.pp_schedule, n_microbatches=n)

    def make_step(
        self,
        model: Model,
        loss_fn: Any,
        opt: Any,
        *,
        accum_steps: int,
        compile: bool | str,
        update_buffers: Any,
        precision: MixedPrecision | None = None,
        trainable: Any = None,
        buckets: str = "per_layer",
        quantize: str | None = None,
        remat: str = "none",
        kernels: str = "torch",
        attn_impl: str = "sdpa",
        float8: str = "",
    ) -> Callable:
        """The run's train step. ``compile``: True (whole step, fullgraph), False, or ``"regional"`` (each block
        compiled once, ``ftitan.train.regional``; ``"regional:<backend>"`` picks the backend). ``remat``: the
        model config's policy (``ftitan.train.remat``): with it, or regional, gradients come from the
        autograd path (saved-tensor hooks and compiled regions are refused under torch.func), the same gradients.
        So they do for the model config's ``kernels`` other than "torch" (``ftitan.kernels`` step aside for their
        references under torch.func), ``float8`` (torchao's recipe, gradient casts included, runs where
        torch.func does not) and ``attn_impl`` "flex" / "auto" (FlexAttention has no torch.func rules)."""
        region = regional.backend_of(compile)
        if self.layout is None:
            grad_impl = gradient_path(compile=compile, remat=remat, kernels=kernels, attn_impl=attn_impl,
                                      float8=float8)  # fmt: skip
            # regional: the update half too is compiled once per layer kind, where the optimizer runs by layers
            # (Transform.leafwise: AdamW, SGD, behind clipping and the guard; not Muon); else it stays eager
            by_layers = region is not None and update_runs_by_layers(opt, trainable=trainable,
                                                                     update_buffers=update_buffers)  # fmt: skip
            # the loop never reads a state twice: the step writes the new one into its buffers
            step = make_train_step(loss_fn, opt, accum_steps=accum_steps, update_buffers=update_buffers, donate=True,
                                   precision=precision, trainable=trainable, grad_impl=grad_impl,
                                   update_backend=region if by_layers else None)  # fmt: skip
            if region is not None:
                return regional.regional_step(step, region)
            return _with_budget(torch.compile(step, fullgraph=True, dynamic=False), remat) if compile else step
        if accum_steps != 1:
            raise ValueError(f"--accum-steps={accum_steps}: parallel runs take one batch per step; use --accum-steps 1 "
                             "(under pp, --parallel.pp-microbatches splits it)")  # fmt: skip
        if self.pp > 1:  # eager: the schedule's sends and receives run in Python
            if precision is not None and not precision.is_full:
                raise ValueError("--mixed-precision.compute: pipeline parallel runs in fp32 for now; "
                                 "use --mixed-precision.compute fp32 with --parallel.pp > 1")  # fmt: skip
            step = parallel.make_train_step(None, opt, self.layout, grad_fn=self._pipeline(model),
                                            update_buffers=update_buffers)  # fmt: skip
            return step if region is None else regional.regional_step(step, region)  # blocks of each stage
        step = parallel.make_train_step(loss_fn, opt, self.layout, compile=compile, update_buffers=update_buffers,
                                        precision=precision, trainable=trainable, buckets=buckets,
                                        quantize=quantize)  # fmt: skip
        return _with_budget(step, remat) if compile and region is None else step

    def data_rank(self) -> tuple[int, int]:
        """``(index, count)``: which slice of each global batch's rows this rank trains on."""
        return (0, 1) if self.layout is None else self.layout.data_rank()

    def local_batch(self, batch: Any, *, rows_local: bool = False) -> Any:
        """This rank's part of a global batch (its rows, its sequence chunks); ``rows_local``: ``batch``
        already holds only this rank's rows (a streaming loader reads them alone), split the sequence only."""
        if self.layout is None:
            return batch
        if rows_local:
            return T.map(lambda x: split_sequence(x, self.layout, dim=1) if x.dim() > 1 else x, batch)
        return parallel.shard_batch(batch, self.layout)

    def gather_by_data_rank(self, mine: Any) -> list[Any]:
        """Every data-parallel slice's ``mine`` (a small picklable value), in data-rank order (collective).
        Ranks that share a slice (tp, cp, pp peers) hold the same value; one of each is kept."""
        if self.layout is None:
            return [mine]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.data_rank()[0], mine))
        by_index = dict(everyone)
        return [by_index[i] for i in range(self.data_rank()[1])]

    def eval_loss(
        self,
        model: Model,
        loss_fn: Any,
        params: Any,
        batch: Any,
        *,
        rows_local: bool = False,
        precision: MixedPrecision | None = None,
    ) -> float:
        """The global batch's mean loss (MoE: without the balancing term), in ``precision``'s compute dtype."""
        if self.layout is None:
            with torch.no_grad():
                loss, aux = apply_precision(loss_fn, precision)(params, batch)
            return float(aux.get("ce_loss", loss))
        shardings = T.map(parallel.sharding_of, params)
        local_params, local_batch = parallel.to_local(params), self.local_batch(batch, rows_local=rows_local)
        if self.pp > 1:  # the pipeline's forward and backward; its gradients are dropped
            _, (loss, _) = self._pipeline(model)(shardings)(local_params, local_batch)
        else:
            with torch.no_grad(), parallel.use(self.layout):
                loss_of = parallel.make_parallel_loss(_ce_only(loss_fn), self.layout, shardings, precision=precision)
                loss, _ = loss_of(local_params, local_batch)
        return float(self.layout.sum(loss.detach(), (*self.layout.data_axes(), "tp", "pp")))

    def barrier(self) -> None:
        """Wait for every rank while one does slow work alone (rank 0 preparing the data, writing a checkpoint):
        up to ``max(--parallel.timeout-s, 30 min)``, not the collective timeout (a dead rank still fails it
        at once: gloo sees its connection close)."""
        if self.layout is None:
            return
        rendezvous.bound_group_timeouts([dist.group.WORLD], max(self.cfg.timeout_s, ONE_RANK_WORK_S))
        try:
            dist.barrier()
        finally:
            rendezvous.bound_group_timeouts([dist.group.WORLD], self.cfg.timeout_s)

    def close(self) -> None:
        """Leave the process group this runtime joined (the world's ranks all call it)."""
        if self.layout is not None and self._owns_group:
            parallel.shutdown()


def gradient_path(*, compile: bool | str = False, remat: str = "none", kernels: str = "torch",
                  attn_impl: str = "sdpa", float8: str = "") -> str:  # fmt: skip
    """``make_train_step``'s ``grad_impl`` for a one-process step: "autograd" where regional compile,
    rematerialization, ``ftitan.kernels`` (they step aside under torch.func), float8 (torchao's recipe; under
    torch.func a straight-through reference whose backward does not cast the output gradient to float8) or
    FlexAttention ("flex", "auto": no torch.func rules) need it, else "func". The same gradients either
    way, but for float8's gradient cast."""
    autograd = regional.backend_of(compile) is not None or remat != "none" or kernels != "torch" or bool(float8)
    return "autograd" if autograd or attn_impl in ("flex", "auto") else "func"


def step_options(model_cfg: Any) -> dict[str, str]:
    """What :meth:`Runtime.make_step` reads from a model config: its ``remat``, ``kernels``, ``attn_impl`` and
    ``float8`` (which pick the autograd gradient path; configs without a field get the default). ``float8`` is
    the recipe of the projections, else "rowwise" where only the MoE experts run in float8 (their recipe)."""
    float8 = getattr(model_cfg, "float8", "") or ("rowwise" if getattr(model_cfg, "float8_experts", False) else "")
    return {"remat": getattr(model_cfg, "remat", "none"), "kernels": getattr(model_cfg, "kernels", "torch"),
            "attn_impl": getattr(model_cfg, "attn_impl", "sdpa"), "float8": float8}  # fmt: skip


def _with_budget(step: Callable, policy: str) -> Callable:
    """A compiled ``step`` compiled (and run) under the activation memory budget of a ``budget:F`` remat policy."""
    if not policy.startswith("budget:"):
        return step

    def run(*args: Any) -> Any:
        with memory_budget(policy):
            return step(*args)

    return run


def _ce_only(loss_fn: Any) -> Any:
    def fn(params: Any, batch: Any) -> Any:
        loss, aux = loss_fn(params, batch)
        return aux.get("ce_loss", loss), aux

    return fn


def setup(cfg: ParallelConfig, *, device: str = "auto", malloc_retain: bool = False,
          gemm_library: str = "auto") -> Runtime:  # fmt: skip
    """The runtime for this process: its device, and the torchrun world (``WORLD_SIZE`` > 1) it joins.
    ``malloc_retain`` (``--malloc-retain``): on a CPU device the process keeps the host memory a step frees
    for the next step (:func:`ftitan.train.memory.retain_freed_memory`). ``gemm_library``
    (``--gemm-library``): "auto", the per-shape pick of ``ftitan.kernels.onednn``, or "aten", "onednn" or
    "onednn-matmul" for every GEMM of the process (``onednn.pin``; "onednn-matmul" refused on an AMX CPU).

    Fails before any work when the degrees' product differs from the world size, or the device or
    backend is not available here. Joining the world and each collective wait at most
    ``cfg.timeout_s`` for the other ranks (``--parallel.timeout-s``): then a
    :class:`~ftitan.train.faults.RunFailure` (joining: naming the ranks that never arrived) or
    gloo's timeout error.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dims = cfg.dims()
    dims.check(world)
    dev = resolve_device(device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    backend = resolve_backend(cfg.backend, dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NCCL and the mesh use the current device
    if dev.type == "cpu" and malloc_retain:
        memory.retain_freed_memory()
    onednn.pin(None if gemm_library == "auto" else gemm_library)
    if world == 1:
        return Runtime(None, cfg, device=dev)
    owns = not dist.is_initialized()
    if owns:  # joining is bounded too: a rank whose peers never arrive fails naming them
        store, rank = rendezvous.join(world, cfg.timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=dev if dev.type == "cuda"
                                else None, timeout=datetime.timedelta(seconds=cfg.timeout_s))  # fmt: skip
    mesh = parallel.mesh(dims, device_type=dev.type)
    rendezvous.bound_group_timeouts(mesh.get_all_groups(), cfg.timeout_s)  # a hung peer fails each collective
    layout = parallel.Layout(mesh, _rules(cfg))
    return Runtime(layout, cfg, owns_group=owns, device=dev)
