"""Optimizers as pure ``(init, update)`` transforms, optax-style.

Build an optimizer by chaining small pieces; every named optimizer is such
a chain::

    import ftitan.optim as fo
    opt = fo.chain(
        fo.clip_by_global_norm(1.0),
        fo.muon_with_adamw(params, lr=fo.warmup_cosine(3e-3, warmup=100, total=2_000)),
    )
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = fo.apply_updates(params, updates)
    fo.current_lr(state)  # the lr of that update, a 0-d tensor

Updates are added to params (the lr scale is negative). Step counts,
learning rates and injected hyperparameters (``inject_hyperparams``) live in
the state as 0-d tensors, so a compiled step (``torch.compile(fullgraph=True)``)
does not recompile as they change. See docs/optim.md for every idiom.
"""

from ftitan.optim.adam import ScaleByAdamState, adam, adamw, scale_by_adam
from ftitan.optim.clipping import clip_by_global_norm
from ftitan.optim.ema import EmaParamsState, EmaState, ema, ema_params, incremental_update, params_ema
from ftitan.optim.finite import ApplyIfFiniteState, apply_if_finite, find_finite_guard
from ftitan.optim.frozen import freeze, selective_transform
from ftitan.optim.from_config import from_config, guard_nonfinite
from ftitan.optim.hyperparams import InjectHyperparamsState, inject_hyperparams, set_hyperparams
from ftitan.optim.learning_rate import (
    ScaleByLearningRateState,
    current_lr,
    find_lr,
    learning_rates,
    scale_by_learning_rate,
)
from ftitan.optim.masking import MaskedState, masked
from ftitan.optim.multi_steps import MultiSteps, MultiStepsState, update_weighted_mean
from ftitan.optim.multi_transform import Labels, MultiTransformState, multi_transform
from ftitan.optim.muon import MuonState, NesterovStyle, ShapeScaling, muon, muon_shape_scale, scale_by_muon
from ftitan.optim.muon_adamw import muon_label, muon_labels, muon_with_adamw
from ftitan.optim.newton_schulz import newton_schulz
from ftitan.optim.registry import MATRIX_ONLY, OPTIMIZERS
from ftitan.optim.schedules import (
    Schedule,
    constant,
    cosine_decay,
    exponential_decay,
    join_schedules,
    linear,
    linear_warmup,
    piecewise_constant,
    polynomial,
    warmup_cosine,
    warmup_stable_decay,
)
from ftitan.optim.sgd import TraceState, sgd, trace
from ftitan.optim.transform import EmptyState, Transform, apply_updates, chain, identity, scale, set_to_zero
from ftitan.optim.weight_decay import add_decayed_weights

__all__ = [
    "from_config",
    "MATRIX_ONLY",
    "OPTIMIZERS",
    "ApplyIfFiniteState",
    "EmaParamsState",
    "EmaState",
    "EmptyState",
    "InjectHyperparamsState",
    "Labels",
    "MaskedState",
    "MultiSteps",
    "MultiStepsState",
    "MultiTransformState",
    "MuonState",
    "NesterovStyle",
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "Schedule",
    "ShapeScaling",
    "TraceState",
    "Transform",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine_decay",
    "current_lr",
    "ema",
    "ema_params",
    "exponential_decay",
    "find_finite_guard",
    "find_lr",
    "freeze",
    "guard_nonfinite",
    "identity",
    "incremental_update",
    "inject_hyperparams",
    "join_schedules",
    "learning_rates",
    "linear",
    "linear_warmup",
    "masked",
    "multi_transform",
    "muon",
    "muon_label",
    "muon_labels",
    "muon_shape_scale",
    "muon_with_adamw",
    "newton_schulz",
    "params_ema",
    "piecewise_constant",
    "polynomial",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_muon",
    "selective_transform",
    "set_hyperparams",
    "set_to_zero",
    "sgd",
    "trace",
    "update_weighted_mean",
    "warmup_cosine",
    "warmup_stable_decay",
]
