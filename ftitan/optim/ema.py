"""Exponential moving averages: of updates (optax's ``ema``) and of parameters.

``ema(decay)`` averages the updates that flow through it (a smoothing stage
in a chain). ``ema_params(decay)``, chained last, leaves the updates alone
and keeps in its state the EMA of the params *after* each update: the
"EMA weights" (Polyak & Juditsky 1992) evaluated or exported instead of the
raw params. Read them with :func:`params_ema`.

>>> import torch, ftitan.optim as fo
>>> opt = fo.chain(fo.sgd(1.0), fo.ema_params(0.5))
>>> params = {"w": torch.zeros(1)}
>>> updates, state = opt.update({"w": torch.ones(1)}, opt.init(params), params)
>>> fo.params_ema(state)["w"].item()  # 0.5 * 0 + 0.5 * (0 - 1)
-0.5
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ftitan import tree
from ftitan.optim.adam import bias_correction
from ftitan.optim.transform import Params, Transform, Updates, accumulator_dtype, state_device

__all__ = ["EmaParamsState", "EmaState", "ema", "ema_params", "incremental_update", "params_ema"]


class EmaState(NamedTuple):
    count: torch.Tensor  # () int64: updates averaged so far
    ema: Updates  # the (undebiased) average, float32 (float64 for float64 params)


class EmaParamsState(NamedTuple):
    ema: Params  # EMA of the params after each update, float32 (float64 for float64 params)


def _check_decay(decay: float) -> float:
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
        raise ValueError(f"decay={decay!r}: expected a float in [0, 1)")
    return float(decay)


def ema(decay: float, debias: bool = True) -> Transform:
    """Replaces the updates by their EMA ``e = decay * e + (1 - decay) * u`` (optax's ``ema``).

    With ``debias`` the output is ``e / (1 - decay ** count)`` (Adam's bias
    correction); the state keeps ``e``. Starts from zeros.
    """
    decay = _check_decay(decay)

    def init(params: Params) -> EmaState:
        return EmaState(
            count=torch.zeros((), dtype=torch.int64, device=state_device(params)),
            ema=tree.map(lambda p: torch.zeros_like(p, dtype=accumulator_dtype(p)), params),
        )

    def update(grads: Updates, state: EmaState, params: Params | None = None) -> tuple[Updates, EmaState]:
        del params
        count = state.count + 1
        new = tree.map(lambda e, u: decay * e + (1.0 - decay) * u.to(e.dtype), state.ema, grads)
        if debias:
            out = tree.map(lambda e, u: (e / bias_correction(decay, count, e.dtype)).to(u.dtype), new, grads)
        else:
            out = tree.map(lambda e, u: e.to(u.dtype), new, grads)
        return out, EmaState(count=count, ema=new)

    return Transform(init, update)


def incremental_update(new: Params, old: Params, step_size: float | torch.Tensor) -> Params:
    """``step_size * new + (1 - step_size) * old`` leafwise, in ``old``'s dtypes (optax's name)."""
    return tree.map(lambda n, o: (step_size * n.to(o.dtype) + (1.0 - step_size) * o).to(o.dtype), new, old)


def ema_params(decay: float) -> Transform:
    """Passes updates through; keeps ``ema = decay * ema + (1 - decay) * (params + updates)``.

    Chain it last (``chain(adamw(...), ema_params(0.999))``) so ``updates``
    are the final ones and ``params + updates`` the new params. The EMA
    starts at the initial params (no bias correction needed) and is kept in
    float32 for low-precision params. Needs ``params`` in ``update``.
    """
    decay = _check_decay(decay)

    def init(params: Params) -> EmaParamsState:
        return EmaParamsState(ema=tree.map(lambda p: p.detach().to(accumulator_dtype(p), copy=True), params))

    def update(grads: Updates, state: EmaParamsState, params: Params | None = None) -> tuple[Updates, EmaParamsState]:
        if params is None:
            raise ValueError("ema_params needs params: call update(grads, state, params)")
        new_params = tree.map(lambda p, u: (p + u).to(p.dtype), params, grads)
        return grads, EmaParamsState(ema=incremental_update(new_params, state.ema, 1.0 - decay))

    return Transform(init, update)


def params_ema(opt_state: Any) -> Params:
    """The EMA params of the first :func:`ema_params` stage in ``opt_state`` (tree order)."""
    found = optree.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, EmaParamsState), namespace=tree.NAMESPACE
    )
    for s in found:
        if isinstance(s, EmaParamsState):
            return s.ema
    raise ValueError("params_ema: no ema_params stage in this optimizer state; chain ema_params(decay) last")
