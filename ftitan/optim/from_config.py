"""The optimizer a run's ``OptimConfig`` names: schedule, then AdamW or Muon+AdamW, behind clipping,
behind the non-finite guard."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ftitan.optim.adam import adamw
from ftitan.optim.clipping import clip_by_global_norm
from ftitan.optim.finite import apply_if_finite
from ftitan.optim.frozen import freeze
from ftitan.optim.muon import muon as muon_transform
from ftitan.optim.muon_adamw import muon_with_adamw
from ftitan.optim.schedules import linear_warmup, warmup_cosine, warmup_stable_decay
from ftitan.optim.transform import Transform, chain

if TYPE_CHECKING:
    from ftitan.config.schema import OptimConfig

__all__ = ["from_config", "guard_nonfinite"]


def from_config(o: OptimConfig, steps: int, params: Any, *, frozen: tuple[str, ...] = (), layout: Any = None,
                blocks: Mapping[str, tuple[int, int]] | None = None, muon: str = "distributed") -> Transform:  # fmt: skip
    """The optimizer ``o`` describes for a run of ``steps`` steps over ``params`` (shapes route Muon).

    ``frozen`` (a model's ``frozen`` globs) are left unchanged by the optimizer. The whole chain sits
    behind :func:`guard_nonfinite` (``o.nonfinite``), so its state is an ``ApplyIfFiniteState``.
    Muon: ``blocks`` as in :func:`ftitan.optim.muon` (per head). Under a parallel ``layout`` (DTensor params)
    AdamW runs on the local shards (``parallel.on_shards``: elementwise, the same numbers), and
    ``muon="distributed"`` orthogonalizes each matrix on one rank (``ftitan.flexshard.mesh``),
    ``"gather"`` on every rank (DTensor algebra gathers every matrix).
    """
    final = o.lr * o.final_lr_fraction
    if o.schedule == "cosine":
        lr: Any = warmup_cosine(o.lr, warmup=o.warmup, total=steps, final=final)
    elif o.schedule == "wsd":
        lr = warmup_stable_decay(o.lr, warmup=o.warmup, total=steps, final=final)
    else:
        lr = linear_warmup(o.lr, o.warmup)
    if o.name == "muon":
        impl: Any = muon_transform
        if layout is not None and muon == "distributed":
            from ftitan.flexshard.mesh import mesh_muon

            impl = functools.partial(mesh_muon, layout)
        inner = muon_with_adamw(params, lr=lr, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                                shape_scaling="match_rms_adamw", blocks=blocks, muon_impl=impl,
                                adamw_impl=adamw if layout is None else _sharded_adamw)  # fmt: skip
    else:
        inner = (adamw if layout is None else _sharded_adamw)(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    if frozen:
        inner = chain(inner, freeze(frozen, missing_ok=True))  # a pipeline stage may hold none
    opt = chain(clip_by_global_norm(o.clip), inner) if o.clip > 0 else inner
    return guard_nonfinite(opt, o.nonfinite, max_nonfinite=o.max_nonfinite)


def _sharded_adamw(*args: Any, **kwargs: Any) -> Transform:
    from ftitan.flexshard.mesh import sharded_adamw

    return sharded_adamw(*args, **kwargs)


def guard_nonfinite(opt: Transform, mode: str, *, max_nonfinite: int = 3) -> Transform:
    """``opt`` behind :func:`apply_if_finite`, as ``--optim.nonfinite`` says.

    ``"skip"``: a step whose gradients hold a NaN or an inf changes nothing (params, optimizer state);
    ``max_nonfinite`` such steps in a row halt the guard (``ApplyIfFiniteState.halted``: no update
    from then on), which a trainer reading the state turns into a stop. ``"stop"``: the first one
    halts it. ``"off"``: every update is applied; the guard only counts. Every mode has the same
    state (a checkpoint resumes under another mode).
    """
    if mode == "skip":
        return apply_if_finite(opt, max_nonfinite - 1, halt=True)
    if mode == "stop":
        return apply_if_finite(opt, 0, halt=True)
    if mode == "off":
        return apply_if_finite(opt, 0)  # more than 0 in a row: applied, i.e. always
    raise ValueError(f"--optim.nonfinite={mode!r}: expected 'skip', 'stop' or 'off'")
