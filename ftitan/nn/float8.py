"""FP8 training of linear layers: torchao's float8 recipes as a pure function (``ftitan.nn.float8``).

A model config with ``float8="tensorwise"`` (or ``"rowwise"``; ``ftitan.config.with_float8``,
``ftitan train --float8 ...``) runs the projections of its blocks (attention, dense and shared-expert MLPs;
not the output head, the embeddings or routers, as torchao and TorchTitan leave them) through :func:`linear`:
each of the three GEMMs of a linear layer (forward ``x @ w.T``, input gradient ``g @ w``, weight gradient
``g.T @ x``) takes float8 operands with dynamic scales, accumulates in float32 and returns the input's dtype.
A MoE config with ``float8_experts=True`` runs its routed experts' grouped GEMMs through :func:`grouped_mm`
(torchao's rowwise MoE recipe; the section "MoE experts" below).

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
from ftitan.kernels.grouped_mm import grouped_mm as grouped_mm_

__all__ = ["GROUP_ROWS", "RECIPES", "check_config", "check_experts", "check_recipe", "fake_quantize",
           "grouped_mm", "grouped_reference", "linear", "pad_groups", "prepare", "reference"]

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
    return _cast(t, _scale(a.amax() if dim is None else a.amax(dim=dim, keepdim=True), dtype, pow2), dtype)


def _scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """The float32 scale that maps ``amax`` to the float8 ``dtype``'s largest value (rounded down to a power
    of two with ``pow2``)."""
    scale = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=_EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def _cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` scaled, saturated, cast to float8 and back (float32, divided by the scale again)."""
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


def prepare(recipe: str) -> None:
    """Build torchao's objects for ``recipe`` (both devices) outside compiled code, where :func:`linear` reads
    them: a model config with ``float8`` does it when it is made (:func:`check_config`); code that calls
    :func:`linear` itself inside ``torch.compile`` calls this first."""
    for emulate in (True, False):
        _torchao(recipe, emulate)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, recipe: str) -> torch.Tensor:
    """``x @ w.T + b`` in float8 by ``recipe`` (see the module docstring): torchao's path where no
    ``torch.func`` transform is active (float8 GEMMs on CUDA, its emulation elsewhere), else :func:`reference`.
    Under ``torch.compile`` after :func:`prepare` (a model config's own check does it)."""
    if not (op.no_transform() and op.plain(x, w)):
        return reference(x, w, b, recipe=recipe)
    if (recipe, not x.is_cuda) not in _TORCHAO and torch.compiler.is_compiling():
        raise RuntimeError(f"float8.linear(recipe={recipe!r}) inside torch.compile before float8.prepare"
                           f"({recipe!r}): torchao's objects cannot be built in compiled code; "
                           "call it first")  # fmt: skip
    fn, mm, cfg = _torchao(recipe, not x.is_cuda)
    y = fn.apply(x, w.t(), mm, cfg)
    return y if b is None else y + b


# ---------------------------------------------------------------- MoE experts: float8 grouped GEMMs
# torchao's rowwise MoE recipe (torchao.prototype.moe_training): e4m3 operands, power-of-two scales along each
# GEMM's reduction axis. On CUDA (compute capability 9.0+: torch._scaled_grouped_mm) torchao's own Function
# runs, on each expert's rows padded to GROUP_ROWS; elsewhere _GroupedRowwise emulates it (its Triton casts
# and the scaled grouped GEMM are CUDA-only), under torch.func grouped_reference (straight-through).

GROUP_ROWS = 16  # a float8 grouped GEMM on CUDA wants every expert's row count a multiple of this


def _rowwise(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The rowwise recipe's cast of ``t``: one power-of-two scale per slice along ``dim``, e4m3."""
    return fake_quantize(t, E4M3, dim, pow2=True)


def _groupwise(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``t`` (M, C), rows sorted by group, cast with one power-of-two scale per (group, column): the amax over
    the group's rows (rows past ``offs[-1]``, in no group, share one more scale: no GEMM reads them)."""
    group = torch.searchsorted(offs, torch.arange(t.shape[0], device=t.device, dtype=offs.dtype), right=True)
    a = t.abs().to(torch.float32)
    amax = a.new_zeros(offs.shape[0] + 1, t.shape[1]).scatter_reduce(0, group[:, None].expand_as(a), a, "amax")
    return _cast(t, _scale(amax, E4M3, pow2=True)[group], E4M3)


class _GroupedRowwise(torch.autograd.Function):
    """The float8 grouped GEMM of MoE experts by torchao's rowwise recipe, emulated: e4m3 operands with
    power-of-two scales, each GEMM's along its reduction axis (forward: ``x`` per row, ``w`` per expert and
    column; input gradient: ``g`` per row, ``w`` per expert and row; weight gradient: ``x`` and ``g`` per
    expert and column, over that expert's rows), float32 GEMMs of the dequantized operands."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grouped_mm_(_rowwise(x, -1), _rowwise(w, -2), offs).to(x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w, offs = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = grouped_mm_(_rowwise(g, -1), _rowwise(w, -1).transpose(-2, -1), offs).to(x.dtype)
        if ctx.needs_input_grad[1]:  # (K, M) @ (M, N) grouped along M: every expert's x.T @ g
            gw = torch._grouped_mm(_groupwise(x, offs).t(), _groupwise(g, offs), offs=offs).to(w.dtype)
        return gx, gw, None


def grouped_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm` in plain ops (the path under ``torch.func``): the forward's casts as the recipe's,
    differentiated as the identity (straight-through; the backward's own casts are not applied)."""
    xq = _straight_through(x, _rowwise(x, -1))
    wq = _straight_through(w, _rowwise(w, -2))
    return grouped_mm_(xq, wq, offs).to(x.dtype)


def pad_groups(x: torch.Tensor, offs: torch.Tensor, align: int = GROUP_ROWS) -> tuple[torch.Tensor, ...]:
    """``(x_padded, offs_padded, dest)``: every group's rows moved to a start that is a multiple of ``align``,
    zero rows between; ``x_padded[dest] == x`` for the rows of a group (rows past ``offs[-1]`` go to the last
    row, which no group reaches, as zeros). Static shapes, no host sync: ``M + E (align - 1)`` rows, rounded up, plus
    that one."""
    m, e = x.shape[0], offs.shape[0]
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    rows = torch.arange(m, device=x.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True).clamp(max=e - 1)
    size = -(-(m + e * (align - 1)) // align) * align
    inside = rows < offs[-1]
    dest = torch.where(inside, ends[group] - padded[group] + rows - (offs[group] - counts[group]), size).long()
    # rows in no group go in as zeros: whatever a GEMM leaves in such a row, no gradient flows back to them
    x_padded = x.new_zeros(size + 1, x.shape[1]).index_copy(0, dest, torch.where(inside[:, None], x, 0))
    return x_padded, ends.to(torch.int32), dest


_TORCHAO_GROUPED: list[Any] = []  # torchao's float8 grouped GEMM, imported where CUDA is (check_experts)


def _torchao_grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torchao's float8 grouped GEMM (``torch._scaled_grouped_mm``: CUDA, compute capability 9.0+) on the
    groups padded to :data:`GROUP_ROWS` rows; rows past ``offs[-1]`` come back zero."""
    x_padded, offs_padded, dest = pad_groups(x.contiguous(), offs)
    y = _TORCHAO_GROUPED[0](x_padded, w, offs_padded, out_dtype=torch.bfloat16,
                            pad_token_groups_for_grouped_mm=False)  # fmt: skip
    return torch.where((dest < x_padded.shape[0] - 1)[:, None], y[dest], 0).to(x.dtype)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``ftitan.kernels.grouped_mm`` (MoE experts: ``x`` (M, K) rows sorted by expert, ``w`` (E, K, N), ``offs``
    (E,) int32 row ends) with float8 operands by torchao's rowwise MoE recipe (:class:`_GroupedRowwise`):
    torchao's ``_scaled_grouped_mm`` path on CUDA, its emulation elsewhere, :func:`grouped_reference` under
    ``torch.func`` transforms."""
    if not (op.no_transform() and op.plain(x, w)):
        return grouped_reference(x, w, offs)
    if x.is_cuda and _TORCHAO_GROUPED:
        return _torchao_grouped(x, w, offs)
    return _GroupedRowwise.apply(x, w, offs)


def check_experts(cfg: Any, family: str, widths: dict[str, int]) -> None:
    """Validate ``float8_experts`` of a MoE model config: not batch-invariant, ``widths`` (the experts' GEMM
    widths) multiples of 16; imports torchao's grouped GEMM where CUDA is (outside compiled code)."""
    if not cfg.float8_experts:
        return
    _refuse(cfg, f"{family}.Config: float8_experts", "float8_experts=False", widths, "the experts' widths",
            "float8 grouped GEMMs", "an expert's float8 scales are taken over its rows, which depend on the batch")
    if torch.cuda.is_available() and not _TORCHAO_GROUPED:
        _import_torchao()
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

        _TORCHAO_GROUPED.append(_to_fp8_rowwise_then_scaled_grouped_mm)


def check_config(cfg: Any, family: str, widths: dict[str, int]) -> None:
    """Validate a model config's ``float8`` field (``family`` names its class): a known recipe, not with
    ``attn_impl="batch_invariant"`` (whose GEMMs must not depend on the batch: a per-tensor scale does), and
    every projection width in ``widths`` (name -> size) a multiple of 16 (``torch._scaled_mm``'s rule)."""
    check_recipe(cfg.float8, f"{family}.Config.float8")
    if not cfg.float8:
        return
    prepare(cfg.float8)  # torchao's objects for the recipe, built here rather than in compiled code
    _refuse(cfg, f"{family}.Config: float8={cfg.float8!r}", "float8=''", widths, "every projection width",
            "float8 GEMMs, torch._scaled_mm", "a float8 scale is taken over the whole batch, so the log-probs "
            "could not be batch-invariant")  # fmt: skip


def _refuse(cfg: Any, owner: str, off: str, widths: dict[str, int], what: str, gemms: str, why: str) -> None:
    """The rules every float8 field shares: not with ``attn_impl="batch_invariant"`` (``why``), and ``widths``
    multiples of 16 (``gemms``' rule); the errors name ``owner`` and the fix ``off``."""
    if cfg.attn_impl == "batch_invariant":
        raise ValueError(f"{owner} with attn_impl='batch_invariant': {why}; use {off}")
    bad = {k: v for k, v in widths.items() if v % 16}
    if bad:
        raise ValueError(f"{owner} needs {what} to be a multiple of 16 ({gemms}); not: {bad}")
