"""FlexShard: data-parallel sharding by buckets, as pure state transforms.

>>> import ftitan as ft
>>> from ftitan import flexshard as fs
>>> plan = fs.plan(params, fs.per_layer(params), mesh["dp_shard"])   # one bucket per layer
>>> local = plan.shard(params)                  # this rank's part of every leaf (a plain tree)
>>> full = plan.gather(local, "layers.0.**")    # one all-gather of the bucket's packed parts
>>> grads = plan.reduce_grads(full_grads)       # one reduce-scatter per bucket

Distributed Muon (:func:`muon`, :func:`muon_with_adamw`): each rank orthogonalizes what it holds whole.
In ``ftitan train`` (DTensor state): :func:`mesh_muon_with_adamw`, each matrix orthogonalized by one owner
rank, or per head / expert where a rank holds whole ones (:func:`block_rules`, :func:`head_blocks`).
:func:`packed_gather` is the one packed all-gather behind a plan's buckets and the trainer's dp_shard.

Placements: :class:`Shard` (rows along a dim, ragged), :class:`BlockShard` (whole blocks of rows: heads,
experts), :class:`Owned` (a whole tensor on one rank: a matrix optimizer's compute), :class:`Replicate`.
"""

from ftitan.flexshard.plan import (
    BlockShard,
    Bucket,
    LeafPlan,
    Owned,
    Placement,
    Plan,
    Replicate,
    Shard,
    balance,
    newton_schulz_cost,
    per_layer,
    per_leaf,
    plan,
)
from ftitan.flexshard.mesh import block_rules, head_blocks, mesh_muon, mesh_muon_with_adamw
from ftitan.flexshard.muon import local_kind, muon, muon_with_adamw, scale_by_muon
from ftitan.flexshard.packed import packed_gather

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
    "block_rules",
    "head_blocks",
    "local_kind",
    "mesh_muon",
    "mesh_muon_with_adamw",
    "muon",
    "muon_with_adamw",
    "newton_schulz_cost",
    "packed_gather",
    "per_layer",
    "per_leaf",
    "plan",
    "scale_by_muon",
]
