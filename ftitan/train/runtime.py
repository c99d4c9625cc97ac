"""Where a run's steps execute: one process, or a torchrun world with a parallel layout.

The trainer talks to a ``Runtime`` and stays the same for both:
``place(params)`` (DTensors on the mesh, or as they are), ``make_step``,
``local_batch`` (this rank's rows and sequence chunks), ``eval_loss``,
``to_full`` / ``from_full`` for checkpoints (a checkpoint holds full
tensors, so it loads under any layout), and ``is_main`` (rank 0 writes
files and shows progress).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ftitan import parallel
from ftitan import tree as T
from ftitan.config.schema import ParallelConfig
from ftitan.parallel.rules import local_slice
from ftitan.train.step import make_train_step

__all__ = ["Runtime", "setup"]


def _rules(cfg: ParallelConfig) -> parallel.Rules:
    rules = parallel.default_rules()
    return rules if cfg.sequence_parallel else rules.with_rule("norm_seq", ("cp",))


class Runtime:
    """A single process (``layout is None``) or this rank of a parallel world."""

    def __init__(self, layout: parallel.Layout | None, cfg: ParallelConfig) -> None:
        self.layout, self.cfg = layout, cfg
        self.is_main = layout is None or dist.get_rank() == 0
        self._owns_group = False

    def place(self, params: Any, axes: Any) -> Any:
        if self.layout is None:
            return params
        return parallel.shard_params(params, axes, self.layout.rules, self.layout)

    def make_step(self, loss_fn: Any, opt: Any, *, accum_steps: int, compile: bool, update_buffers: Any) -> Callable:
        if self.layout is None:
            step = make_train_step(loss_fn, opt, accum_steps=accum_steps, update_buffers=update_buffers)
            return torch.compile(step, fullgraph=True) if compile else step
        if accum_steps != 1:
            raise ValueError(f"--accum-steps={accum_steps}: parallel runs take one batch per step; use --accum-steps 1")
        return parallel.make_train_step(loss_fn, opt, self.layout, compile=compile, update_buffers=update_buffers)

    def local_batch(self, batch: Any) -> Any:
        return batch if self.layout is None else parallel.shard_batch(batch, self.layout)

    @torch.no_grad()
    def eval_loss(self, loss_fn: Any, params: Any, batch: Any) -> float:
        """The global batch's mean loss (MoE: without the balancing term)."""
        if self.layout is None:
            loss, aux = loss_fn(params, batch)
            return float(aux.get("ce_loss", loss))
        shardings = T.map(parallel.sharding_of, params)
        local = parallel.make_parallel_loss(_ce_only(loss_fn), self.layout, shardings)
        with parallel.use(self.layout):
            loss, _ = local(parallel.to_local(params), self.local_batch(batch))
        for a in (*self.layout.data_axes(), "tp"):
            loss = parallel.collectives.all_reduce_value(loss, self.layout.group(a))
        return float(loss)

    def to_full(self, tree: Any) -> Any:
        """Full tensors (collective: every rank calls it)."""
        return tree if self.layout is None else parallel.unshard(tree)

    def from_full(self, full: Any, like: Any) -> Any:
        """``full`` placed like the DTensors of ``like`` (this rank's blocks; no communication)."""
        if self.layout is None:
            return full

        def one(x: Any, ref: Any) -> Any:
            if not isinstance(ref, DTensor):
                return x
            local = local_slice(x, parallel.sharding_of(ref), self.layout.coords, self.layout.sizes).contiguous()
            return DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                                      stride=ref.stride())  # fmt: skip

        return T.map(one, full, like)

    def barrier(self) -> None:
        if self.layout is not None:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group this runtime joined (the world's ranks all call it)."""
        if self.layout is not None and self._owns_group:
            dist.barrier()
            dist.destroy_process_group()


def _ce_only(loss_fn: Any) -> Any:
    def fn(params: Any, batch: Any) -> Any:
        loss, aux = loss_fn(params, batch)
        return aux.get("ce_loss", loss), aux

    return fn


def setup(cfg: ParallelConfig) -> Runtime:
    """The runtime for this process: joins the torchrun world (``WORLD_SIZE`` > 1) and checks the degrees.

    Fails before any work when the degrees' product differs from the world size.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dims = parallel.ParallelDims(dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, ep=cfg.ep, cp=cfg.cp,
                                 tp=cfg.tp, pp=cfg.pp)  # fmt: skip
    dims.check(world)
    if world == 1:
        return Runtime(None, cfg)
    if cfg.pp > 1:
        raise NotImplementedError("--parallel.pp > 1 in `ftitan train` is not wired yet; use parallel.pipeline directly")
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(cfg.backend)
    rt = Runtime(parallel.Layout(parallel.mesh(dims), _rules(cfg)), cfg)
    rt._owns_group = owns
    return rt
