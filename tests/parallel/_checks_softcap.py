"""The logit soft-cap (``Model.logit_softcap``) in the parallel losses, merged into ``_parity.py``'s launch:
Muse Glimmer with a head whose logits reach deep into the tanh's bend, its loss and every gradient under
tp 2 (the vocab-parallel cross-entropy caps each rank's slice) and pp 2 (the pipeline's last stage)
against the single-process loss, which ``tests/models/test_muse_glimmer_softcap.py`` checks against
transformers. ``uncapped_gap``: how far the uncapped loss is, so a path that dropped the cap would show.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py softcap_dp_shard2_tp2``.
"""

from __future__ import annotations

import torch

import ftitan as ft
from ftitan import parallel
from ftitan.models import muse_glimmer
from _parity import batch_for, max_diff, parallel_grads  # torchrun puts this folder on sys.path
from _checks_pp import pipeline_vs_one_process

CAP = 2.0


def _setup():
    cfg = muse_glimmer.Config(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                              window=4, max_seq_len=64, output_multiplier=0.7, logit_softcap=CAP)  # fmt: skip
    model = muse_glimmer.model(cfg)
    params = model.init(ft.random.key(0))
    params["head"] = params["head"] * 10  # std 0.2: logits up to ~cap
    batch = batch_for(8, 16, 256)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    ref_g, (ref_l, _) = ft.train.value_and_grad(loss_fn)(params, batch)
    with torch.no_grad():
        logits, _ = model.apply(params, batch["inputs"])
        h, _ = model.apply(params, batch["inputs"], logits=False)
        uncapped = ft.train.chunked_cross_entropy(h.flatten(0, 1), model.head(params), batch["targets"].flatten())
    facts = {"loss": float(ref_l), "uncapped_gap": abs(float(uncapped) - float(ref_l)),
             "max_logit": float(logits.abs().max()), "grad_scale": max(float(x.abs().max()) for x in
                                                                       ft.tree.leaves(ref_g))}  # fmt: skip
    return model, params, batch, loss_fn, ref_g, ref_l, facts


def tp_check(name: str, degrees: dict[str, int]) -> dict:
    model, params, batch, loss_fn, ref_g, ref_l, facts = _setup()
    total, full, _, _, _ = parallel_grads(model, params, loss_fn, batch, degrees)
    return {"check": name, **facts, "loss_diff": abs(float(total) - float(ref_l)), "grad_diff": max_diff(full, ref_g)}


def pp_check(name: str, degrees: dict[str, int]) -> dict:
    model, params, batch, _, ref_g, ref_l, facts = _setup()
    total, grad_diff = pipeline_vs_one_process(model, params, batch, ref_g, parallel.Layout(parallel.mesh(**degrees)))
    return {"check": name, **facts, "loss_diff": abs(total - float(ref_l)), "grad_diff": grad_diff}


CHECKS = {
    "softcap_dp_shard2_tp2": lambda: tp_check("softcap_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
    "softcap_pp2_dp_shard2": lambda: pp_check("softcap_pp2_dp_shard2", {"pp": 2, "dp_shard": 2}),
    "softcap_pp2_tp2": lambda: pp_check("softcap_pp2_tp2", {"pp": 2, "tp": 2}),
}
