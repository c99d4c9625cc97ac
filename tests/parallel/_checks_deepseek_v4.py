"""DeepSeek-V4 under FSDP x TP (merged into ``_parity.py``'s launch): loss and every gradient of a parallel
step against the single-process step, logits with the head gathered, and the layouts it refuses.

The tiny model has every feature of the family: hca, csa (indexer keeping 2 of up to 4 entries) and
sliding layers over 16 tokens, 3 hyper-connection streams, a hash-routed first block, the balancing
bias, and the indexer's KL loss (its target summed over the heads of every tp rank).

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py deepseek_v4_dp_shard2_tp2``.
"""

from __future__ import annotations

import torch

import ftitan as ft
from ftitan import parallel
from ftitan.models import deepseek_v4 as v4
from _parity import batch_for, logits_check, max_diff, parallel_grads  # torchrun puts this folder on sys.path


def tiny(**kw) -> v4.Config:
    return v4.Config(vocab_size=256, dim=32, n_layers=4, n_heads=4, head_dim=16, rope_dim=8, q_lora_rank=24,
                     o_groups=2, o_lora_rank=8, layer_types=("hca", "csa", "sliding", "csa"), csa_rate=4, hca_rate=4,
                     window=4, index_heads=4, index_head_dim=12, index_topk=2, n_experts=8, top_k=2, expert_dim=16,
                     n_hash_layers=1, hc_mult=3, hc_sinkhorn_iters=4, n_mtp_layers=0, **kw)  # fmt: skip


def _params(model):
    params = model.init(ft.random.key(0))
    g = torch.Generator().manual_seed(0)  # norms, sinks and position biases off their init, so their sums show
    return ft.tree.map(lambda x: x + 0.1 * torch.randn(x.shape, generator=g) if x.dim() == 1 or x.shape[0] == 4
                       and x.dim() == 2 and x.shape[1] in (16, 24, 32) else x, params)  # fmt: skip


def grads(name: str, degrees: dict[str, int], rules=None) -> dict:
    model = v4.model(tiny())
    params = _params(model)
    batch = batch_for(4, 16, 256)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    ref_g, (ref_l, ref_aux) = ft.train.value_and_grad(loss_fn)(params, batch)
    total, full, _, _, _ = parallel_grads(model, params, loss_fn, batch, degrees, rules)
    paths, got = ft.tree.flatten_with_paths(full)[:2]
    diffs = {p: float((a - b).abs().max()) for p, a, b in zip(paths, got, ft.tree.leaves(ref_g), strict=True)}
    indexer = [float(x.abs().max()) for p, x in zip(*ft.tree.flatten_with_paths(ref_g)[:2], strict=True)
               if ".indexer." in p]  # fmt: skip
    return {"check": name, "loss": float(ref_l), "loss_diff": abs(float(total) - float(ref_l)),
            "grad_diff": max_diff(full, ref_g), "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g)),
            "indexer_grad": min(indexer), "kl": float(ref_aux["indexer.kl"]),
            "worst": sorted(diffs, key=diffs.get)[-6:]}  # fmt: skip


def logits(name: str, degrees: dict[str, int]) -> dict:
    """``apply(..., logits=True)`` under a layout: the vocab-split head gathered."""
    model = v4.model(tiny())
    return logits_check(name, degrees, model, _params(model))


def refuses(name: str, degrees: dict[str, int]) -> dict:
    model = v4.model(tiny())
    try:
        parallel_grads(model, model.init(ft.random.key(0)), ft.train.next_token_loss(model), batch_for(4, 16, 256),
                       degrees)  # fmt: skip
    except (ValueError, NotImplementedError) as e:
        return {"check": name, "error_text": str(e)}
    return {"check": name, "error_text": ""}


CHECKS = {
    "deepseek_v4_dp_shard2_tp2": lambda: grads("deepseek_v4_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
    "deepseek_v4_dp_shard2_tp2_no_sp": lambda: grads(
        "deepseek_v4_dp_shard2_tp2_no_sp", {"dp_shard": 2, "tp": 2},
        parallel.default_rules().with_rule("norm_seq", ("cp",)),
    ),
    "deepseek_v4_logits_dp_shard2_tp2": lambda: logits("deepseek_v4_logits_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
    "deepseek_v4_cp2_refused": lambda: refuses("deepseek_v4_cp2_refused", {"dp_shard": 2, "cp": 2}),
}
