"""Mixed precision as a pure policy: which dtype params are stored, computed and reduced in.

A :class:`MixedPrecision` is three dtypes (the shape of jmp's ``Policy``,
DeepMind 2020, with FSDP2's ``reduce_dtype`` added):

- ``param_dtype``: the stored ("master") params and, through them, the
  optimizer state (float32 by default). Nothing in the step casts them: a
  step reads and writes masters only.
- ``compute_dtype``: what the forward and backward run in. The step casts
  the masters to it *inside* the differentiated function, so the gradient
  flows back through the cast and arrives in the master dtype, and under
  ``torch.compile`` the cast fuses into the first kernel that reads it.
  FSDP all-gathers run in it too (the local shard is cast before the
  gather: half the bytes of float32 for bfloat16). FSDP2 calls this dtype
  ``param_dtype``; here ``param_dtype`` is jmp's (the stored one).
- ``reduce_dtype``: the gradient reductions across data-parallel ranks
  (FSDP's reduce-scatter, DDP's all-reduce), ``ftitan.parallel.make_train_step``.

What stays float32 whatever ``compute_dtype`` says (the model code takes
care of it, a policy need not): the logits, log-softmax and loss of
``chunked_cross_entropy`` (the head matmul runs on float32 copies of its
operands); RMSNorm statistics (the normalized value goes back to the
compute dtype); attention softmax on the math path; MoE router logits,
scores, top-k selection and the balancing statistics; RoPE angles. Leaves
that ``keep`` selects (glob patterns over dotted paths; :meth:`for_model`
adds ``model.frozen``, e.g. DeepSeek-V3's ``router_bias``, whose steps of
1e-3 would round away in bfloat16) and integer leaves are never cast.

>>> import torch
>>> from ftitan.train.precision import MixedPrecision
>>> p = MixedPrecision.from_names("fp32", "bf16", "fp32")
>>> p.compute_dtype, p.names
(torch.bfloat16, {'param': 'fp32', 'compute': 'bf16', 'reduce': 'fp32'})
>>> MixedPrecision.parse("param=fp32,compute=bf16,reduce=fp32") == p
True
>>> p.cast_to_compute({"w": torch.ones(2), "step": torch.zeros((), dtype=torch.int64)})["w"].dtype
torch.bfloat16
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from ftitan import tree as T

__all__ = ["DTYPES", "MixedPrecision", "apply_precision", "dtype_name", "dtype_of"]

# the names a policy accepts (CLI flags, configs), short first; the short name is what dtype_name gives
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

LossFn = Callable[[Any, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    """``"fp32" | "bf16" | "fp16"`` (or ``"float32"``, ...; or a floating ``torch.dtype``) as a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        if not name.is_floating_point:
            raise ValueError(f"mixed precision: {name} is not a floating dtype; use one of fp32, bf16, fp16")
        return name
    if isinstance(name, str) and name.lower() in DTYPES:
        return DTYPES[name.lower()]
    raise ValueError(f"mixed precision: unknown dtype {name!r}; use one of fp32, bf16, fp16")


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a policy dtype: ``torch.bfloat16 -> "bf16"``."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).removeprefix("torch.")


def _globs(value: str | Iterable[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@attrs.frozen
class MixedPrecision:
    """Stored, compute and reduction dtypes of a train step (see the module docstring).

    ``MixedPrecision()`` is full float32, and a step given it (or no policy)
    computes exactly what it did without one. ``keep``: glob patterns of
    leaves never cast (state such as ``model.frozen``; :meth:`for_model`).
    """

    param_dtype: torch.dtype = attrs.field(default=torch.float32, converter=dtype_of)  # stored params, opt state
    compute_dtype: torch.dtype = attrs.field(default=torch.float32, converter=dtype_of)  # forward/backward, gathers
    reduce_dtype: torch.dtype = attrs.field(default=torch.float32, converter=dtype_of)  # data-parallel grad sums
    keep: tuple[str, ...] = attrs.field(default=(), converter=_globs, kw_only=True)  # leaves never cast

    @classmethod
    def from_names(
        cls, param: str = "fp32", compute: str = "fp32", reduce: str = "fp32", *, keep: Iterable[str] = ()
    ) -> MixedPrecision:
        """From dtype names (``"fp32" | "bf16" | "fp16"``), e.g. ``from_names("fp32", "bf16", "fp32")``."""
        return cls(param, compute, reduce, keep=tuple(keep))

    @classmethod
    def parse(cls, spec: str) -> MixedPrecision:
        """From ``"param=fp32,compute=bf16,reduce=fp32"`` (jmp's ``get_policy`` form; omitted keys are
        fp32), or one name for the compute dtype alone (``"bf16"``: float32 params and reductions)."""
        spec = spec.strip()
        if "=" not in spec:
            return cls(compute_dtype=spec)
        fields = {}
        for part in filter(None, (s.strip() for s in spec.split(","))):
            key, _, value = (s.strip() for s in part.partition("="))
            if key not in ("param", "compute", "reduce"):
                raise ValueError(f"MixedPrecision.parse({spec!r}): unknown key {key!r}; use param, compute, reduce")
            fields[key] = value
        return cls.from_names(**fields)

    @property
    def names(self) -> dict[str, str]:
        """``{"param": "fp32", "compute": "bf16", "reduce": "fp32"}``: the policy as config values."""
        return {k: dtype_name(getattr(self, f"{k}_dtype")) for k in ("param", "compute", "reduce")}

    @property
    def is_full(self) -> bool:
        """Whether every dtype is float32: the step is then the one without a policy."""
        return self.param_dtype == self.compute_dtype == self.reduce_dtype == torch.float32

    def for_model(self, model: Any) -> MixedPrecision:
        """This policy with ``model.frozen`` (state leaves, e.g. DeepSeek-V3's ``router_bias``) kept uncast."""
        extra = tuple(g for g in getattr(model, "frozen", ()) if g not in self.keep)
        return attrs.evolve(self, keep=self.keep + extra)

    def keeps(self, path: str) -> bool:
        """Whether the leaf at ``path`` is kept in its stored dtype."""
        return any(T.match(path, g) for g in self.keep)

    def compute_of(self, path: str, x: Any) -> Any:
        """One leaf in the compute dtype: floating tensors not kept; everything else as it is."""
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.compute_dtype:
            if not (self.keep and self.keeps(path)):
                return x.to(self.compute_dtype)
        return x

    def cast_to_compute(self, params: Any) -> Any:
        """``params`` with every floating leaf (``keep`` aside) in ``compute_dtype``; differentiable."""
        return T.map_with_path(self.compute_of, params)

    def cast_to_param(self, params: Any) -> Any:
        """``params`` with every floating leaf (``keep`` aside) in ``param_dtype``: masters from an init or
        checkpoint in another dtype."""
        def one(path: str, x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and not (self.keep and self.keeps(path)):
                return x.to(self.param_dtype)
            return x

        return T.map_with_path(one, params)

    def cast_loss(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` run on the params cast to ``compute_dtype``, its loss returned in float32 (float64
        stays float64). The batch is not cast: float batch leaves (loss weights, advantages) keep their
        dtype. Differentiate the result (``make_train_step(..., precision=p)`` does): gradients come back
        in the masters' dtype through the cast. The identity when nothing would be cast."""
        if self.compute_dtype == self.param_dtype and self.compute_dtype == torch.float32:
            return loss_fn  # nothing to cast, loss already float32: today's step exactly

        def loss_in_compute_dtype(params: Any, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss, aux = loss_fn(self.cast_to_compute(params), batch)
            return loss.to(torch.promote_types(loss.dtype, torch.float32)), aux

        return loss_in_compute_dtype


def apply_precision(loss_fn: LossFn, policy: MixedPrecision | None) -> LossFn:
    """``policy.cast_loss(loss_fn)`` (``loss_fn`` itself for ``None``): compose a policy into a loss
    function by hand, e.g. to differentiate it with ``torch.func`` outside ``make_train_step``."""
    return loss_fn if policy is None else policy.cast_loss(loss_fn)
