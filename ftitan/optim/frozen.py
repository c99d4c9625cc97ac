"""``freeze``: zero the updates of selected leaves (state that is not trained).

Chained after an optimizer, ``chain(opt, freeze(model.frozen))`` leaves the
selected params exactly as they are, weight decay included; a model's
``update_buffers`` moves them instead (optax's ``set_to_zero`` routed by a
mask).

>>> import torch, ftitan.optim as fo
>>> params = {"w": torch.ones(2), "bias": torch.ones(2)}
>>> opt = fo.chain(fo.sgd(0.5), fo.freeze("bias"))
>>> updates, _ = opt.update({"w": torch.ones(2), "bias": torch.ones(2)}, opt.init(params), params)
>>> updates["bias"].tolist(), updates["w"].tolist()
([0.0, 0.0], [-0.5, -0.5])
"""

from __future__ import annotations

import torch

from ftitan import tree
from ftitan.optim.transform import EmptyState, Params, Transform, Updates
from ftitan.optim.weight_decay import Mask, _mask_fn

__all__ = ["freeze"]


def freeze(mask: Mask) -> Transform:
    """Zero updates where ``mask`` (glob pattern(s) over dotted paths, or a predicate) selects."""
    selected = _mask_fn(mask)

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        del params
        return tree.map_with_path(lambda p, u: torch.zeros_like(u) if selected(p, u) else u, grads), state

    return Transform(init, update)
