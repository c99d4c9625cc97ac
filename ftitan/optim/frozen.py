"""Freezing: leaves that the optimizer leaves exactly as they are.

Two idioms (see docs/concepts.md, "Freezing and masking"):

- ``selective_transform(opt, freeze_mask=...)`` (optax's): ``opt`` sees and
  keeps state for the trainable leaves only; the frozen ones get zero
  updates. Wrap clipping in it too (``selective_transform(chain(clip,
  adamw), ...)``) so frozen gradients do not count in the clipping norm.
- ``freeze(mask)`` chained after an optimizer: zeroes the selected updates
  (optax's ``freeze``, ``masked(set_to_zero(), mask)``). Stateless itself,
  but the stages before it still keep state for the frozen leaves.

``make_train_step(..., trainable=...)`` goes further: frozen leaves get no
gradient at all.

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
from ftitan.optim.masking import check_mask_matches
from ftitan.optim.multi_transform import multi_transform
from ftitan.optim.transform import EmptyState, Params, Transform, Updates, set_to_zero
from ftitan.optim.weight_decay import Mask, _mask_fn

__all__ = ["freeze", "selective_transform"]


def freeze(mask: Mask, *, missing_ok: bool = False) -> Transform:
    """Zero updates where ``mask`` (glob pattern(s) over dotted paths, or a predicate) selects.

    A glob that matches no leaf raises at ``init`` (``missing_ok=True``
    accepts it, e.g. for a pipeline stage that holds none of them). optax:
    ``optax.freeze``.
    """
    selected = _mask_fn(mask)

    def init(params: Params) -> EmptyState:
        if not missing_ok:
            check_mask_matches(mask, params, "freeze")
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        del params
        return tree.map_with_path(lambda p, u: torch.zeros_like(u) if selected(p, u) else u, grads), state

    return Transform(init, update)


def selective_transform(optimizer: Transform, *, freeze_mask: Mask) -> Transform:
    """``optimizer`` on the leaves ``freeze_mask`` does not select; zero updates on those it does.

    ``multi_transform({"train": optimizer, "freeze": set_to_zero()}, ...)``:
    the optimizer's state holds the trainable leaves only, and a clipping
    stage inside ``optimizer`` sees only their gradients. A glob that
    matches no leaf raises at ``init``. optax: ``optax.selective_transform``.
    """
    pred = _mask_fn(freeze_mask)
    inner = multi_transform(
        {"train": optimizer, "freeze": set_to_zero()}, lambda path, leaf: "freeze" if pred(path, leaf) else "train"
    )

    def init(params: Params) -> object:
        check_mask_matches(freeze_mask, params, "selective_transform")
        return inner.init(params)

    return Transform(init, inner.update)
