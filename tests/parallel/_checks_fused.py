"""Fused projections (``fuse_projections=True``: ``wqkv``, ``w13``) on several ranks, merged into
``_parity.py``'s launch: the loss and every gradient under dp_shard 4 (FSDP splits the stacked leaves' embed
dim), dp_replicate 2 x dp_shard 2, dp_shard 2 x cp 2 and the pipeline (pp 2 x dp_shard 2) against the
single-process fused model, whose gradients ``tests/models/test_fused_projections.py`` checks against the
unfused model; per-rank init (``parallel.init_params``) against the single-process init; and tp 2 refused
naming the fix.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py fused_dp_shard4``.
"""

from __future__ import annotations

import attrs

import ftitan as ft
from ftitan import parallel
from ftitan.models import llama
# torchrun puts this folder on sys.path
from _parity import batch_for, grads_vs_one_process, max_diff, parallel_grads, tiny_llama
from _checks_pp import pipeline_vs_one_process


def _model():
    return llama.model(attrs.evolve(tiny_llama(), fuse_projections=True))


def grads_check(name: str, degrees: dict[str, int]) -> dict:
    model = _model()
    diffs, params, full, sharded = grads_vs_one_process(model, degrees)
    layout = parallel.Layout(parallel.mesh(**degrees))
    inited = parallel.unshard(parallel.init_params(model, ft.random.key(0), layout))
    wqkv = sharded["layers"]["0"]["attn"]["wqkv"]
    return {"check": name, **diffs, "init_diff": max_diff(inited, params),
            "wqkv_placements": [str(p) for p in wqkv.placements],
            "leaves": sorted(full["layers"]["0"]["attn"]) + sorted(full["layers"]["0"]["mlp"])}  # fmt: skip


def pp_check(name: str, degrees: dict[str, int]) -> dict:
    """The pipeline (1f1b, 2 micro-batches): each stage's stacked leaves, loss and gradients vs one process."""
    model = _model()
    params = model.init(ft.random.key(0))
    batch = batch_for(4, 16, model.config.vocab_size)
    ref_g, (ref_l, _) = ft.train.value_and_grad(ft.train.next_token_loss(model, chunk_size=24))(params, batch)
    total, grad_diff = pipeline_vs_one_process(model, params, batch, ref_g, parallel.Layout(parallel.mesh(**degrees)))
    return {"check": name, "loss_diff": abs(total - float(ref_l)), "grad_diff": grad_diff,
            "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g))}  # fmt: skip


def tp_check(name: str, degrees: dict[str, int]) -> dict:
    model = _model()
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    try:
        parallel_grads(model, params, loss_fn, batch_for(4, 16, model.config.vocab_size), degrees)
    except ValueError as e:
        return {"check": name, "refused": str(e)}
    return {"check": name, "refused": None}


CHECKS = {
    "fused_dp_shard4": lambda: grads_check("fused_dp_shard4", {"dp_shard": 4}),
    "fused_dp_replicate2_dp_shard2": lambda: grads_check("fused_dp_replicate2_dp_shard2",
                                                         {"dp_replicate": 2, "dp_shard": 2}),
    "fused_dp_shard2_cp2": lambda: grads_check("fused_dp_shard2_cp2", {"dp_shard": 2, "cp": 2}),
    "fused_pp2_dp_shard2": lambda: pp_check("fused_pp2_dp_shard2", {"pp": 2, "dp_shard": 2}),
    "fused_tp2_refused": lambda: tp_check("fused_tp2_refused", {"dp_shard": 2, "tp": 2}),
}
