"""Parallelism as data: a mesh, a rules table, and placements for every leaf.

- :class:`ParallelDims` / :func:`mesh`: the six degrees (``dp_replicate,
  dp_shard, ep, cp, tp, pp``) and the named ``DeviceMesh``.
- :class:`Rules` / :func:`default_rules` / :func:`resolve` / :func:`dump` /
  :func:`check_sharded`: logical axes -> mesh axes -> a :class:`Sharding`
  (DTensor placements) per leaf.
- :func:`shard_params`: params as DTensors; :func:`shard_as` and the other
  seams in :mod:`ftitan.parallel.activations` for activations (no-ops
  without a layout).
- :mod:`ftitan.parallel.expert`: expert parallelism for the MoE layers
  (routed experts split over ``ep``, tokens dispatched and combined by
  all-to-all; router statistics of the global batch).
- :func:`make_train_step`: the parallel train step (FSDP / DDP gathers and
  reductions, TP / SP / CP through the seams), with :func:`shard_batch`.
- :mod:`ftitan.parallel.pipeline`: pipeline parallelism over ``pp``
  (:func:`stage_params`, :func:`pipeline_grad` with GPipe / 1F1B schedules).

See docs/parallelism.md.
"""

from ftitan.parallel import activations, collectives, expert
from ftitan.parallel.activations import cp_positions, shard_as
from ftitan.parallel.dims import AXES, DATA_AXES, ParallelDims, end_rank, mesh, shutdown
from ftitan.parallel.init import init_params
from ftitan.parallel.layout import Layout, current, use
from ftitan.parallel.pipeline import pipeline_grad, schedule_actions, stage_layers, stage_params
from ftitan.parallel.rules import Rules, Sharding, check_sharded, default_rules, dump, resolve, resolve_one
from ftitan.parallel.shard import from_local, gathered, on_shards, shard_params, to_local, unshard
from ftitan.parallel.step import make_parallel_loss, make_train_step, shard_batch, sharding_of

__all__ = [
    "AXES",
    "DATA_AXES",
    "Layout",
    "ParallelDims",
    "Rules",
    "Sharding",
    "activations",
    "check_sharded",
    "collectives",
    "cp_positions",
    "current",
    "default_rules",
    "dump",
    "end_rank",
    "expert",
    "from_local",
    "on_shards",
    "gathered",
    "init_params",
    "make_parallel_loss",
    "make_train_step",
    "mesh",
    "pipeline_grad",
    "resolve",
    "resolve_one",
    "schedule_actions",
    "shard_as",
    "shard_batch",
    "shard_params",
    "shutdown",
    "sharding_of",
    "stage_layers",
    "stage_params",
    "to_local",
    "unshard",
    "use",
]
