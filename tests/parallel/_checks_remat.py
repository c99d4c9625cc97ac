"""Remat and regional compile on real gloo ranks, merged into ``_parity.py``'s launch: a Llama whose blocks
run under remat policies and/or the regionally compiled block (aot_eager), under FlexShard (dp_shard 4,
dp_shard 2 x tp 2, the per-layer bucketed gathers) and pipeline stages (pp 2 x dp_shard 2, 1F1B), against
the single-process torch.func gradients without remat. ``graphs``: the compiled graphs of this rank (the
block compiled once for every layer it runs).

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py remat_full_dp_shard4``.
"""

from __future__ import annotations

import contextlib

import attrs
import torch
from torch._dynamo.utils import counters

import ftitan as ft
from ftitan import parallel
from ftitan.models import llama
from ftitan.train import regional
from _parity import batch_for, max_diff, parallel_grads  # torchrun puts this folder on sys.path
from _checks_pp import pipeline_vs_one_process


def _setup(policy: str):
    cfg = llama.Config(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
    plain = llama.model(cfg)
    params = plain.init(ft.random.key(0))
    batch = batch_for(8, 16, 256)
    ref_g, (ref_l, _) = ft.train.value_and_grad(ft.train.next_token_loss(plain, chunk_size=24))(params, batch)
    model = llama.model(attrs.evolve(cfg, remat=policy))
    return model, params, batch, ref_g, ref_l


def _context(compiled: bool):
    torch._dynamo.reset()
    counters.clear()
    return regional.compiling("aot_eager") if compiled else contextlib.nullcontext()


def fsdp_check(name: str, policy: str, degrees: dict[str, int], *, compiled: bool = False) -> dict:
    model, params, batch, ref_g, ref_l = _setup(policy)
    with _context(compiled):
        total, full, _, _, _ = parallel_grads(model, params, ft.train.next_token_loss(model, chunk_size=24), batch,
                                              degrees)  # fmt: skip
    return {"check": name, "loss_diff": abs(float(total) - float(ref_l)), "grad_diff": max_diff(full, ref_g),
            "graphs": counters["stats"]["unique_graphs"]}  # fmt: skip


def pp_check(name: str, policy: str, degrees: dict[str, int], *, compiled: bool = False) -> dict:
    model, params, batch, ref_g, ref_l = _setup(policy)
    layout = parallel.Layout(parallel.mesh(**degrees))
    total, grad_diff = pipeline_vs_one_process(model, params, batch, ref_g, layout, _context(compiled))
    return {"check": name, "loss_diff": abs(total - float(ref_l)), "grad_diff": grad_diff,
            "graphs": counters["stats"]["unique_graphs"]}  # fmt: skip


CHECKS = {
    "remat_full_dp_shard4": lambda: fsdp_check("remat_full_dp_shard4", "full", {"dp_shard": 4}),
    "remat_save_matmuls_dp_shard2_tp2": lambda: fsdp_check("remat_save_matmuls_dp_shard2_tp2", "save-matmuls",
                                                           {"dp_shard": 2, "tp": 2}),  # fmt: skip
    "regional_dp_shard4": lambda: fsdp_check("regional_dp_shard4", "none", {"dp_shard": 4}, compiled=True),
    "regional_dp_shard2_tp2": lambda: fsdp_check("regional_dp_shard2_tp2", "none", {"dp_shard": 2, "tp": 2},
                                                 compiled=True),  # fmt: skip
    "regional_remat_full_dp_shard4": lambda: fsdp_check("regional_remat_full_dp_shard4", "full", {"dp_shard": 4},
                                                        compiled=True),  # fmt: skip
    "remat_full_pp2_dp_shard2": lambda: pp_check("remat_full_pp2_dp_shard2", "full", {"pp": 2, "dp_shard": 2}),
    "regional_remat_full_pp2_dp_shard2": lambda: pp_check("regional_remat_full_pp2_dp_shard2", "full",
                                                          {"pp": 2, "dp_shard": 2}, compiled=True),  # fmt: skip
}
