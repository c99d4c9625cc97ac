"""The optimizer a run's ``OptimConfig`` names: schedule, then AdamW or Muon+AdamW, behind clipping."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ftitan.optim.adam import adamw
from ftitan.optim.clipping import clip_by_global_norm
from ftitan.optim.frozen import freeze
from ftitan.optim.muon_adamw import muon_with_adamw
from ftitan.optim.schedules import linear_warmup, warmup_cosine, warmup_stable_decay
from ftitan.optim.transform import Transform, chain

if TYPE_CHECKING:
    from ftitan.config.schema import OptimConfig

__all__ = ["from_config"]


def from_config(o: OptimConfig, steps: int, params: Any, *, frozen: tuple[str, ...] = ()) -> Transform:
    """The optimizer ``o`` describes for a run of ``steps`` steps over ``params`` (shapes route Muon).

    ``frozen`` (a model's ``frozen`` globs) are left unchanged by the optimizer.
    """
    final = o.lr * o.final_lr_fraction
    if o.schedule == "cosine":
        lr: Any = warmup_cosine(o.lr, warmup=o.warmup, total=steps, final=final)
    elif o.schedule == "wsd":
        lr = warmup_stable_decay(o.lr, warmup=o.warmup, total=steps, final=final)
    else:
        lr = linear_warmup(o.lr, o.warmup)
    if o.name == "muon":
        inner = muon_with_adamw(params, lr=lr, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                                shape_scaling="match_rms_adamw")  # fmt: skip
    else:
        inner = adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    if frozen:
        inner = chain(inner, freeze(frozen, missing_ok=True))  # a pipeline stage may hold none
    return chain(clip_by_global_norm(o.clip), inner) if o.clip > 0 else inner
