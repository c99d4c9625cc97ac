"""Qwen3-Next / Qwen3.5 under FSDP x TP (merged into ``_parity.py``'s launch): loss and every gradient of a
parallel step against the single-process step.

The tiny models have every feature of the family: Gated DeltaNet layers (key-head groups of the fused or
separate projections and of the conv split over tp, the per-head decay and gate vectors with the value
heads, the gated head norm shared over tp), a gated attention layer with partial RoPE, zero-centered norms
(summed over tp under sequence parallelism), MoE with the sigmoid-gated shared expert.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py qwen3_next_dp_shard2_tp2``.
"""

from __future__ import annotations

import torch

import ftitan as ft
from ftitan.models import qwen3_next
from _parity import batch_for, max_diff, parallel_grads  # torchrun puts this folder on sys.path


def tiny(variant: str, moe: bool) -> qwen3_next.Config:
    experts = dict(n_experts=4, top_k=2, expert_dim=32, shared_expert_dim=32) if moe else {}
    return qwen3_next.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64,
                             linear_k_heads=2, linear_v_heads=4, linear_k_dim=16, linear_v_dim=8, attention_every=2,
                             variant=variant, max_seq_len=64, chunk=8, **experts)  # fmt: skip


def grads(name: str, variant: str, moe: bool, degrees: dict[str, int]) -> dict:
    model = qwen3_next.model(tiny(variant, moe))
    params = model.init(ft.random.key(0))
    g = torch.Generator().manual_seed(0)  # zero-centered norms off 0, routers decisive (no near-ties)
    params = ft.tree.map_with_path(
        lambda p, x: x + 0.1 * torch.randn(x.shape, generator=g) if x.dim() == 1 else 25 * x if p.endswith("router")
        else x, params)  # fmt: skip
    batch = batch_for(4, 16, 256)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    ref_g, (ref_l, _) = ft.train.value_and_grad(loss_fn)(params, batch)
    total, full, _, _, _ = parallel_grads(model, params, loss_fn, batch, degrees)
    gdn = ref_g["layers"]["0"]["gdn"]
    return {"check": name, "loss": float(ref_l), "loss_diff": abs(float(total) - float(ref_l)),
            "grad_diff": max_diff(full, ref_g), "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g)),
            "gdn_grad": min(float(gdn[k].abs().max()) for k in ("conv", "A_log", "dt_bias", "norm"))}  # fmt: skip


CHECKS = {
    "qwen3_next_dp_shard2_tp2": lambda: grads("qwen3_next_dp_shard2_tp2", "qwen3_next", True,
                                              {"dp_shard": 2, "tp": 2}),
    "qwen3_5_dp_shard2_tp2": lambda: grads("qwen3_5_dp_shard2_tp2", "qwen3_5", False, {"dp_shard": 2, "tp": 2}),
}
