"""``attn_impl="flex"`` under tensor x context parallelism (merged into ``_parity.py``'s launch).

Muse Glimmer (3 sliding layers with a 4-token window over 16 tokens, 1 global NoPE): under cp each rank's
head-tail chunks attend over the gathered keys through an explicit (T_local, T) mask with the window on
true positions, which flex takes as a mask function. Logits under ``torch.no_grad`` run FlexAttention
itself; the loss and gradients run its fallback (SDPA with the same mask) and must match one process.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py flex_logits_tp2_cp2``.
"""

from __future__ import annotations

import torch
from _checks_muse_glimmer import _params, grads, tiny  # torchrun puts this folder on sys.path
from _parity import batch_for

from ftitan import parallel, tree
from ftitan.models import muse_glimmer


def logits(name: str, degrees: dict[str, int]) -> dict:
    """Logits (head gathered) of this rank's head-tail chunks vs the one-process forward at their positions."""
    model = muse_glimmer.model(tiny(attn_impl="flex"))
    params = _params(model)
    batch = batch_for(4, 16, 256)
    with torch.no_grad():
        ref, _ = model.apply(params, batch["inputs"])
    layout = parallel.Layout(parallel.mesh(**degrees))
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    view = parallel.gathered(parallel.to_local(sharded), tree.map(parallel.sharding_of, sharded), layout)
    with parallel.use(layout), torch.no_grad():
        got, _ = model.apply(view, parallel.shard_batch(batch, layout)["inputs"])
    pos = parallel.cp_positions(16, layout.sizes["cp"], layout.coords["cp"])
    return {"check": name, "shape_ok": list(got.shape) == [4, len(pos), 256],
            "diff": float((got - ref[:, pos]).abs().max())}  # fmt: skip


CHECKS = {
    "flex_logits_tp2_cp2": lambda: logits("flex_logits_tp2_cp2", {"tp": 2, "cp": 2}),
    "flex_muse_glimmer_tp2_cp2": lambda: grads("flex_muse_glimmer_tp2_cp2", {"tp": 2, "cp": 2}, impl="flex"),
}
