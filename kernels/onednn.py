"""oneDNN's GEMMs for the linear layers on the CPU (``ftitan.kernels.onednn``).

A model whose ``kernels`` is not "torch" runs its projections (attention,
MLP, the output head) through :func:`linear` on the CPU. Torch's ``aten::mm``
calls MKL's fp32 ``sgemm``; oneDNN's matmul (the primitive behind
``torch.ops.mkldnn._linear_pointwise``, which inductor uses for frozen
inference weights) ran the model's shapes 10-25% faster on an AMD EPYC with
AVX512 (docs/kernels.md). Both are float32 GEMMs accumulating in float32;
they differ only in summation order, so the values agree to float32 rounding,
not bit for bit.

- **Forward** ``x @ w.T`` and the input gradient ``g @ w`` (``w.T`` passed as
  the weight: oneDNN reads the transposed view without a copy) run in oneDNN;
  the weight gradient ``g.T @ x`` stays an ``aten::mm``, which was as fast or
  faster for that layout.
- **The op.** ``ftitan_kernels::onednn_linear`` (``ftitan.kernels.op.define``),
  an opaque node to ``torch.compile(fullgraph=True)``: inductor's own lowering
  of ``_linear_pointwise`` takes constant (frozen) weights only.
- **Derivative.** A ``torch.autograd.Function`` with ``setup_context``; under
  ``torch.func`` transforms or forward AD :func:`usable` is False and the
  plain ``F.linear`` runs (``ftitan.kernels.op``), so ``vmap``/``grad``/``jvp``
  see plain ops and a train step that wants oneDNN differentiates with
  ``grad_impl="autograd"`` (``ftitan train`` does for ``--kernels`` other than
  "torch"). A double backward (``create_graph=True``) runs plain ops.
- **Where.** float32 CPU tensors (plain, not DTensors) with a 2-D weight, and a
  GEMM big enough that oneDNN's ~20 us more per call does not dominate
  (:data:`MIN_WEIGHT` or :data:`MIN_FLOP`); elsewhere ``F.linear``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ftitan.kernels import op

__all__ = ["MIN_FLOP", "MIN_WEIGHT", "available", "gemm_nt", "linear", "usable"]

MIN_WEIGHT = 1 << 18  # in * out elements: from here oneDNN won at every row count measured (1 to 1024 rows)
MIN_FLOP = 1 << 25  # or 2 * rows * in * out: a small weight with enough rows (e.g. 256 x 512 x 128) wins too


_AVAILABLE = torch.backends.mkldnn.is_available()  # read once: dynamo refuses to trace torch.backends


def available() -> bool:
    """Whether this torch has oneDNN (``torch.backends.mkldnn``) to run :func:`linear` with."""
    return _AVAILABLE


def _onednn_linear_impl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _onednn_linear_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


_linear_op = op.define("onednn_linear", "(Tensor x, Tensor w) -> Tensor", _onednn_linear_impl, _onednn_linear_fake,
                       keys=("CPU",))  # fmt: skip


def gemm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in oneDNN, without a derivative: for code that forms its gradients itself (the fused
    cross-entropy's forward). ``w`` may be a transposed view (``g @ m`` is ``gemm_nt(g, m.t())``)."""
    return _linear_op(x, w)


def usable(x: torch.Tensor, w: torch.Tensor, *, dtype: torch.dtype | None = None) -> bool:
    """True where :func:`linear` runs oneDNN for ``x @ w.T``: see the module docstring's "Where". ``dtype``:
    the one the GEMM runs in when the caller casts ``x`` and ``w`` to it first (default theirs)."""
    if not (available() and op.no_transform()):
        return False
    if not (op.plain(x, w) and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1]):
        return False
    if not all(t.device.type == "cpu" and (dtype or t.dtype) == torch.float32 for t in (x, w)):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return w.numel() >= MIN_WEIGHT or 2 * rows * w.numel() >= MIN_FLOP


class _Linear(torch.autograd.Function):
    """``x @ w.T`` and the input gradient in oneDNN, the weight gradient in ``aten::mm``."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _linear_op(x, w)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            # create_graph=True: plain ops, whose own derivatives autograd knows
            gx = g @ w if torch.is_grad_enabled() else _linear_op(g, w.t())
        if ctx.needs_input_grad[1]:
            gw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return gx, gw


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` (``F.linear``), the GEMMs in oneDNN where :func:`usable` holds."""
    if not usable(x, w):
        return F.linear(x, w, b)
    y = _Linear.apply(x, w)
    return y if b is None else y + b
