"""Muse Glimmer under FSDP x TP and TP x CP (merged into ``_parity.py``'s launch): loss and every gradient
of a parallel step against the single-process step, and logits with the head gathered.

The tiny model has every feature of the family: 4 layers (3 sliding with a 4-token window over 16
tokens, 1 global NoPE), the sigmoid gate (split over tp with the heads), centered pre- and post-norms
(summed over tp under sequence parallelism), the scaled head and the soft-capped logits.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py muse_glimmer_dp_shard2_tp2``.
"""

from __future__ import annotations

import torch

import ftitan as ft
from ftitan import parallel
from ftitan.models import muse_glimmer
from _parity import batch_for, logits_check, max_diff, parallel_grads  # torchrun puts this folder on sys.path


def tiny(**kw) -> muse_glimmer.Config:
    return muse_glimmer.Config(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                               window=4, max_seq_len=64, output_multiplier=0.5, logit_softcap=10.0, **kw)  # fmt: skip


def _params(model):
    params = model.init(ft.random.key(0))
    g = torch.Generator().manual_seed(0)  # centered norms off 0, so that their gradients and sums show
    return ft.tree.map(lambda x: x + 0.1 * torch.randn(x.shape, generator=g) if x.dim() == 1 else x, params)


def grads(name: str, degrees: dict[str, int], rules=None, impl: str = "sdpa") -> dict:
    model = muse_glimmer.model(tiny(attn_impl=impl))
    params = _params(model)
    batch = batch_for(4, 16, 256)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    ref_g, (ref_l, _) = ft.train.value_and_grad(loss_fn)(params, batch)
    total, full, _, _, _ = parallel_grads(model, params, loss_fn, batch, degrees, rules)
    return {"check": name, "loss": float(ref_l), "loss_diff": abs(float(total) - float(ref_l)),
            "grad_diff": max_diff(full, ref_g), "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g)),
            "gate_grad": float(ref_g["layers"]["0"]["attn"]["wg"].abs().max())}  # fmt: skip


def logits(name: str, degrees: dict[str, int]) -> dict:
    """``apply(..., logits=True)`` under a layout: the vocab-split head gathered, then soft-capped."""
    model = muse_glimmer.model(tiny())
    return logits_check(name, degrees, model, _params(model))


CHECKS = {
    "muse_glimmer_dp_shard2_tp2": lambda: grads("muse_glimmer_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
    "muse_glimmer_dp_shard2_tp2_no_sp": lambda: grads(
        "muse_glimmer_dp_shard2_tp2_no_sp", {"dp_shard": 2, "tp": 2},
        parallel.default_rules().with_rule("norm_seq", ("cp",)),  # no sequence parallelism
    ),
    "muse_glimmer_logits_dp_shard2_tp2": lambda: logits("muse_glimmer_logits_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
    # context parallel: each rank's head-tail chunks attend over the gathered keys within their windows
    "muse_glimmer_tp2_cp2": lambda: grads("muse_glimmer_tp2_cp2", {"tp": 2, "cp": 2}),
    "muse_glimmer_tp2_cp2_math": lambda: grads("muse_glimmer_tp2_cp2_math", {"tp": 2, "cp": 2}, impl="math"),
}
