"""FP8 training of linear layers: torchao's float8 recipes as a pure function (``ftitan.nn.float8``).

A model config with ``float8="tensorwise"`` (or ``"rowwise"``; ``ftitan.config.with_float8``,
``ftitan train --float8 ...``) runs the projections of its blocks (attention and dense MLP; not the output
head, the embeddings, routers or MoE experts, as torchao and TorchTitan leave them) through :func:`linear`:
each of the three GEMMs of a linear layer (forward ``x @ w.T``, input gradient ``g @ w``, weight gradient
``g.T @ x``) takes float8 operands with dynamic scales, accumulates in float32 and returns the input's dtype.

- **Recipes** (torchao's ``Float8LinearConfig.from_recipe_name``): ``tensorwise``: one scale per tensor,
  inputs and weights in e4m3, the output gradient in e5m2. ``rowwise``: one scale per row of each GEMM
  operand along its reduction axis, everything in e4m3, scales rounded down to powers of two.
- **Where.** Outside ``torch.func`` transforms torchao's own ``matmul_with_hp_or_float8_args`` runs: on
  CUDA real float8 GEMMs (``torch._scaled_mm``: compute capability 8.9+, e.g. H100/H200, L4), elsewhere
  torchao's emulation (the same casts, float32 GEMMs of the dequantized operands). Its derivative is an
  autograd Function without ``torch.func`` rules, so a train step differentiates it on the autograd path
  (``train.runtime.gradient_path``; ``ftitan train`` does). Under ``torch.func`` transforms and forward AD
  ftitan's own implementation of the recipe runs in plain ops (:func:`reference`: torchao's forward bit
  for bit, the casts differentiated as the identity), so ``grad``/``vmap``/``jvp`` and their compiled
  forms work on an FP8 model. Its gradients differ from torchao's by one thing: torchao's backward also
  casts the output gradient to float8 (per tensor or per row), which plain ops cannot do to a cotangent;
  ``train.runtime.gradient_path`` therefore sends a float8 train step down the autograd path.
- **Scale.** ``scale = finfo(fp8).max / max(amax, 1e-12)`` (in float64, then float32), ``data =
  clamp(t * scale) -> fp8``; a GEMM multiplies ``data / scale`` of its operands. The amax is of the
  tensor this process holds: under a parallel layout its rows of the batch and (tp) its shard of a
  weight (FSDP gathers a weight first). Rowwise scales, powers of two, give the same float8 values on
  any rows or shard (docs/gpus-and-precision.md, "Parallel layouts").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ftitan.kernels import op

__all__ = ["RECIPES", "check_config", "check_recipe", "fake_quantize", "linear", "reference"]

RECIPES = ("tensorwise", "rowwise")  # a model config's ``float8`` ("": off)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_EPS = 1e-12  # the smallest amax a scale is computed from (torchao's)


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """What a recipe chooses for the forward's operands (the backward's are torchao's business; the output
    gradient's type, e5m2 for tensorwise and e4m3 for rowwise, is torchao's too)."""

    axiswise: bool  # one scale per row along each GEMM's reduction axis, else one per tensor
    pow2: bool  # scales rounded down to a power of two


_RECIPES = {"tensorwise": _Recipe(axiswise=False, pow2=False), "rowwise": _Recipe(axiswise=True, pow2=True)}


def check_recipe(value: Any, owner: str) -> None:
    """Raise naming ``owner`` (e.g. ``"--float8"``) unless ``value`` is "" (off) or one of :data:`RECIPES`."""
    if value != "" and value not in RECIPES:
        raise ValueError(f"{owner}={value!r}: expected one of {RECIPES} (torchao's float8 training recipes: "
                         "'tensorwise' one scale per tensor, 'rowwise' one per row) or '' for none")  # fmt: skip


def fake_quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None, *,
                  pow2: bool = False) -> torch.Tensor:  # fmt: skip
    """``t`` cast to the float8 ``dtype`` with a dynamic scale and back, in float32: the value a float8
    GEMM multiplies. ``dim``: the scale is per slice along ``dim`` (the amax reduced over it), else one for
    the whole tensor; ``pow2``: scales rounded down to a power of two."""
    a = t.abs()
    amax = a.amax() if dim is None else a.amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=_EPS)).to(torch.float32)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fmax = torch.finfo(dtype).max
    data = (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)
    return data.to(torch.float32) / scale


def _axis(r: _Recipe, dim: int) -> int | None:
    return dim if r.axiswise else None


def _straight_through(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``q``'s value (exactly: ``t - t`` is 0) with ``t``'s derivative: the cast taken as the identity."""
    return q.detach() + (t - t.detach()).to(q.dtype)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, recipe: str) -> torch.Tensor:
    """ftitan's own implementation of the ``recipe``'s linear in plain ops (the path under ``torch.func``):
    torchao's forward bit for bit; its derivative passes through the casts (straight-through), so the
    backward GEMMs take the high-precision output gradient with the float8 values of ``x`` and ``w``
    (torchao's backward also casts that gradient to float8: a cotangent cannot be cast by plain ops)."""
    r = _RECIPES[recipe]
    xq = _straight_through(x, fake_quantize(x, E4M3, _axis(r, -1), pow2=r.pow2))
    wq = _straight_through(w, fake_quantize(w, E4M3, _axis(r, -1), pow2=r.pow2))
    y = (xq.reshape(-1, x.shape[-1]) @ wq.t()).reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)
    return y if b is None else y + b


def _import_torchao() -> None:
    """``import torchao``, quietly: without CUDA its CUDA extensions (MX and CUTLASS kernels, which the float8
    recipes do not use) fail to load against a CPU torch, a warning per file, and torch's pytree warns about
    two of its enums; both at import, neither about anything this module does."""
    import logging

    names = ("torch.utils._pytree",) + (() if torch.cuda.is_available() else ("torchao",))
    logs = [logging.getLogger(n) for n in names]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


_TORCHAO: dict[tuple[str, bool], tuple[Any, Any, Any]] = {}  # filled eagerly: dynamo reads it as constants


def _torchao(recipe: str, emulate: bool) -> tuple[Any, Any, Any]:
    """torchao's autograd Function, its ``LinearMMConfig`` and ``Float8LinearConfig`` for ``recipe`` (built
    once, outside compiled code: :func:`check_config` prepares them when a model config asks for ``recipe``)."""
    key = (recipe, emulate)
    if key not in _TORCHAO:
        _import_torchao()
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)

        def gemm(c: Any) -> Any:  # as torchao's Float8Linear builds it
            return ScaledMMConfig(emulate, c.use_fast_accum, False, cfg.pad_inner_dim)

        mm = LinearMMConfig(gemm(cfg.gemm_config_output), gemm(cfg.gemm_config_grad_input),
                            gemm(cfg.gemm_config_grad_weight))  # fmt: skip
        _TORCHAO[key] = (matmul_with_hp_or_float8_args, mm, cfg)
    return _TORCHAO[key]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, recipe: str) -> torch.Tensor:
    """``x @ w.T + b`` in float8 by ``recipe`` (see the module docstring): torchao's path where no
    ``torch.func`` transform is active (float8 GEMMs on CUDA, its emulation elsewhere), else :func:`reference`."""
    if not (op.no_transform() and op.plain(x, w)):
        return reference(x, w, b, recipe=recipe)
    fn, mm, cfg = _torchao(recipe, not x.is_cuda)
    y = fn.apply(x, w.t(), mm, cfg)
    return y if b is None else y + b


def check_config(cfg: Any, family: str, widths: dict[str, int]) -> None:
    """Validate a model config's ``float8`` field (``family`` names its class): a known recipe, not with
    ``attn_impl="batch_invariant"`` (whose GEMMs must not depend on the batch: a per-tensor scale does), and
    every projection width in ``widths`` (name -> size) a multiple of 16 (``torch._scaled_mm``'s rule)."""
    check_recipe(cfg.float8, f"{family}.Config.float8")
    if not cfg.float8:
        return
    for emulate in (True, False):  # torchao's objects for the recipe, built here rather than in compiled code
        _torchao(cfg.float8, emulate)
    if cfg.attn_impl == "batch_invariant":
        raise ValueError(f"{family}.Config: float8={cfg.float8!r} with attn_impl='batch_invariant': a float8 "
                         "scale is taken over the whole batch, so the log-probs could not be batch-invariant; "
                         "use float8=''")  # fmt: skip
    bad = {k: v for k, v in widths.items() if v % 16}
    if bad:
        raise ValueError(f"{family}.Config: float8={cfg.float8!r} needs every projection width to be a multiple "
                         f"of 16 (float8 GEMMs, torch._scaled_mm); not: {bad}")  # fmt: skip
