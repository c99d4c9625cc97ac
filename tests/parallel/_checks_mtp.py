"""DeepSeek-V3's multi-token-prediction loss on 4 gloo ranks (merged into ``_parity.py``'s launch): loss and
every gradient (the MTP modules' included) under expert and data parallelism vs one process, and the
layouts that split the sequence refused.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py mtp_ep2_dp_shard2``.
"""

from __future__ import annotations

from _checks_ep import EP2_DP2, batch_for, grads_check, init_params, tiny_deepseek_v3  # torchrun's sys.path
from _parity import parallel_grads

import ftitan as ft
from ftitan.models import deepseek_v3


def mtp_grads_check(name: str, degrees: dict[str, int]) -> dict:
    """``_checks_ep.grads_check`` with one MTP module (weight 0.3, the batch's first row partly ignored so
    ranks weigh their main losses unequally), plus the MTP gradients' scale (nonzero: the check bites)."""
    out = grads_check(name, "deepseek_v3", degrees, n_mtp_layers=1, mtp_loss_weight=0.3)
    model = deepseek_v3.model(tiny_deepseek_v3(n_mtp_layers=1))
    g, _ = ft.train.value_and_grad(ft.train.next_token_loss(model, chunk_size=24))(
        init_params("deepseek_v3", model), batch_for(8, 16, 256))  # fmt: skip
    out["mtp_grad_scale"] = max(float(x.abs().max()) for x in ft.tree.leaves(g["mtp"]))
    return out


def refused_check(name: str, degrees: dict[str, int]) -> dict:
    """The MTP loss under a layout that splits the sequence: the error it raises."""
    model = deepseek_v3.model(tiny_deepseek_v3(n_mtp_layers=1))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    try:
        parallel_grads(model, init_params("deepseek_v3", model), loss_fn, batch_for(8, 16, 256), degrees)
    except NotImplementedError as e:
        return {"check": name, "refused": str(e)}
    return {"check": name, "refused": None}


CHECKS = {
    "mtp_ep2_dp_shard2": lambda: mtp_grads_check("mtp_ep2_dp_shard2", EP2_DP2),
    "mtp_dp_shard4": lambda: mtp_grads_check("mtp_dp_shard4", {"dp_shard": 4}),
    "mtp_tp2_dp_shard2_refused": lambda: refused_check("mtp_tp2_dp_shard2_refused", {"tp": 2, "dp_shard": 2}),
}
