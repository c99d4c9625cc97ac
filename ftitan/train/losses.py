"""Losses: a chunked linear cross-entropy and the next-token loss of a model.

``chunked_cross_entropy`` fuses the output projection with the softmax
cross-entropy and walks the tokens in chunks, so at most one chunk of logits
``(chunk, V)`` exists at a time, forward *and* backward: the gradients with
respect to the hidden states and the head weight are formed chunk by chunk
during the forward pass and scaled by the incoming gradient in backward
(the approach of fused linear-cross-entropy kernels such as Liger's,
Hsu et al. 2024). Without it, autograd would keep every chunk's softmax for
backward and the memory saving would be lost.

It is a ``torch.autograd.Function`` with ``setup_context``, so
``torch.func.grad`` and ``torch.compile(fullgraph=True)`` both see through it.

Gradients formed in forward have no derivative of their own, so the fused
Function is exact only for first derivatives under plain reverse mode. It is
used where that holds (plain autograd, or one ``torch.func.grad`` level over
tensors no outer autograd tracks); under every other transform (``vmap``,
``jvp``, ``linearize``, ``grad`` of ``grad``, ``jacrev``) the loss is the
same chunked sum in plain differentiable ops, which every transform can
handle (:func:`_plain_chunked_total`). The choice is made in Python and is a
compile-time constant under dynamo (``ftitan.kernels.autodiff``), so the
compiled train step keeps the fused Function. Plain
``torch.autograd.grad(..., create_graph=True)`` cannot be seen from forward:
the fused backward raises there instead of returning a wrong second
derivative; pass ``fused=False`` (or use ``torch.func``) for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ftitan.kernels import onednn, op
from ftitan.kernels.autodiff import plain_reverse_mode

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy", "cross_entropy", "next_token_loss"]

IGNORE_INDEX = -100


def _acc_dtype(w: torch.Tensor) -> torch.dtype:
    """Logits are float32 for bf16/fp32 params; float64 params keep float64 (finite-difference checks)."""
    return torch.promote_types(w.dtype, torch.float32)


def _chunk_logprobs(h: torch.Tensor, w32: torch.Tensor, t: torch.Tensor, ignore_index: int, cap: float | None,
                    onednn_gemms: bool = False):  # fmt: skip
    # h: (C, D) any float dtype; w32: (V, D) float32 (float64 for float64 params); t: (C,)
    # one fused log_softmax pass over the (C, V) block; the block is reused in place after
    z = onednn.gemm_nt(h.to(w32.dtype), w32) if onednn_gemms else h.to(w32.dtype) @ w32.T  # (C, V)
    th = None
    if cap is not None:  # soft_cap's ops, with tanh(z / cap) kept for the fused gradient's chain factor
        th = torch.tanh(z / cap)
        z = cap * th
    logp = torch.log_softmax(z, dim=-1)  # (C, V)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    nll = -logp.gather(1, safe_t[:, None]).squeeze(1)  # (C,)
    loss = torch.where(valid, nll, torch.zeros_like(nll)).sum()
    return loss, logp, safe_t, valid, th


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum over valid tokens of ``CE(soft_cap(h @ w.T), t)``, gradients formed in forward."""

    @staticmethod
    def forward(h, w, targets, chunk_size: int, ignore_index: int, cap: float | None,
                onednn_gemms: bool = False):  # type: ignore[override]  # fmt: skip
        from ftitan.train import regional

        backend = regional.current_backend()
        args = (h, w, targets, chunk_size, ignore_index, cap, onednn_gemms)
        # regional compile in one process: the head and its loss are one more region, compiled once (parallel
        # runs keep it eager: their loss may see DTensors, whose compile the region does not promise)
        if backend is not None and not torch.distributed.is_initialized():
            return regional.compiled(_fused_forward, backend)(*args)
        return _fused_forward(*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        _total, grad_h, grad_w = output
        ctx.mark_non_differentiable(grad_h, grad_w)
        ctx.save_for_backward(grad_h, grad_w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _gh: Any, _gw: Any):  # type: ignore[override]
        if torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active():
            # create_graph=True under plain autograd: the saved gradients are constants, so a
            # second derivative through them would be silently wrong
            raise RuntimeError(
                "chunked_cross_entropy: double backward (autograd.grad(..., create_graph=True)) through the "
                "fused loss, whose gradients are formed in forward and have no derivative; pass fused=False "
                "(next_token_loss(model, fused=False)) or differentiate with torch.func (grad of grad, jvp of "
                "grad), which selects the plain path itself"
            )
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * g.to(grad_h.dtype), grad_w * g.to(grad_w.dtype), None, None, None, None, None


def _fused_forward(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk_size: int, ignore_index: int,
                   cap: float | None, onednn_gemms: bool = False) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``_LinearCrossEntropy``'s forward: the loss and both gradients, chunk by chunk; ``onednn_gemms``: the
    logits and ``grad_h`` GEMMs by ``ftitan.kernels.onednn``'s ``gemm_nt``, ``grad_w``'s by its ``gemm_tn`` (each in
    the library ``ftitan.kernels.onednn`` picks for the shape)."""
    w32 = w.to(_acc_dtype(w))
    total = torch.zeros((), dtype=w32.dtype, device=h.device)
    grad_h = torch.empty_like(h)
    grad_w = None
    for start in range(0, h.shape[0], chunk_size):
        hc, tc = h[start : start + chunk_size], targets[start : start + chunk_size]
        loss, logp, safe_t, valid, th = _chunk_logprobs(hc, w32, tc, ignore_index, cap, onednn_gemms)
        total = total + loss
        # d loss / d logits = softmax - onehot, computed in place over the logits block;
        # ignored rows are zeroed on the small (C, D) side instead of the (C, V) block
        dlogits = logp.exp_()
        rows = torch.arange(dlogits.shape[0], device=dlogits.device)
        dlogits.index_put_((rows, safe_t), torch.full_like(rows, -1, dtype=dlogits.dtype), accumulate=True)
        if th is not None:  # through the soft-cap: d cap tanh(z / cap) / dz = 1 - tanh^2, in place
            dlogits.mul_(th.square_().neg_().add_(1))
        keep = valid[:, None].to(w32.dtype)  # (C, 1)
        dh = onednn.gemm_nt(dlogits, w32.t()) if onednn_gemms else dlogits @ w32
        grad_h[start : start + chunk_size] = (dh * keep).to(h.dtype)
        hk = hc.to(w32.dtype) * keep
        contrib = onednn.gemm_tn(dlogits, hk) if onednn_gemms else dlogits.T @ hk  # (V, D)
        grad_w = contrib if grad_w is None else grad_w + contrib
    return total, grad_h, grad_w.to(w.dtype)


def _plain_chunked_total(
    h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk_size: int, ignore_index: int, cap: float | None
) -> torch.Tensor:  # () float32 (float64 for float64 params)
    """The fused Function's loss in plain ops: differentiable to any order, under any transform."""
    w32 = w.to(_acc_dtype(w))
    return sum(
        _chunk_logprobs(h[s : s + chunk_size], w32, targets[s : s + chunk_size], ignore_index, cap)[0]
        for s in range(0, h.shape[0], chunk_size)
    )


def _fused_is_exact(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether gradients formed in forward are exact here: plain reverse mode, and under one
    ``torch.func.grad`` level, no outer autograd tracking the unwrapped tensors (it would
    differentiate the returned gradients and see the saved ones as constants)."""
    if not plain_reverse_mode():
        return False
    if not torch._C._are_functorch_transforms_active():
        return True
    # plain_reverse_mode: the one interpreter is grad at level 1; _unwrap_for_grad traces in dynamo
    return not any(torch._C._functorch._unwrap_for_grad(x, 1).requires_grad for x in (h, w))


def _triton_lce() -> Any:
    from ftitan.kernels import linear_cross_entropy  # (imports triton)

    return linear_cross_entropy


def chunked_cross_entropy(
    h: torch.Tensor,  # (N, D) final hidden states
    w: torch.Tensor,  # (V, D) output projection
    targets: torch.Tensor,  # (N,) int64, IGNORE_INDEX where no loss
    *,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    fused: bool = True,
    logit_softcap: float | None = None,
    kernels: str = "torch",
) -> torch.Tensor:
    """Cross-entropy of ``h @ w.T`` against ``targets`` without materializing all logits.

    Logits are computed in float32 (float64 for float64 params) one ``(chunk_size, V)`` block at a time:
    under mixed precision (``ftitan.train.MixedPrecision``) the bfloat16 ``h`` and ``w`` are upcast
    before the head matmul, so the logits are the exact products of the compute-dtype values summed in
    float32, and the log-softmax and the loss are float32; the gradients come back in ``h``'s and
    ``w``'s dtypes.
    ``reduction="mean"`` divides by the number of non-ignored targets (at
    least 1), ``"sum"`` does not. When no gradient is needed (evaluation),
    only the loss is computed.

    ``fused=True`` (default) forms the gradients in forward (see the module
    docstring) wherever that is exact and falls back to plain ops elsewhere
    (``vmap``, ``jvp``, higher derivatives); ``fused=False`` always takes
    the plain path, e.g. for ``torch.autograd.grad(..., create_graph=True)``.
    Both give the same loss and first derivatives to float32 rounding.

    ``logit_softcap``: the logits are ``cap * tanh(h @ w.T / cap)`` (``ftitan.models.base.soft_cap``,
    a model's ``Model.logit_softcap``), applied to each block before its log-softmax; None: plain logits.

    ``kernels="triton"`` (a model config's ``kernels``): with ``fused``, the Triton kernel
    ``ftitan.kernels.linear_cross_entropy`` (``(BLOCK_N, BLOCK_V)`` tiles, forward and backward) wherever
    ``ftitan.kernels.op.use_kernel`` holds (CUDA, no ``torch.func`` transform); elsewhere the paths above,
    the fused one with its GEMMs in MKL or oneDNN on the CPU, the fastest per shape (``ftitan.kernels.onednn``).
    """
    if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1]:
        raise ValueError(f"chunked_cross_entropy: expected h (N, D) and w (V, D), got {tuple(h.shape)} and {tuple(w.shape)}")
    if targets.shape != h.shape[:1]:
        raise ValueError(f"chunked_cross_entropy: targets {tuple(targets.shape)} must be (N,) = ({h.shape[0]},)")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction={reduction!r}; use 'mean' or 'sum'")
    if chunk_size < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_size={chunk_size} must be >= 1")
    if logit_softcap is not None and not 0 < logit_softcap < math.inf:
        raise ValueError(f"chunked_cross_entropy: logit_softcap={logit_softcap!r} must be a finite number > 0 or None")
    if fused and kernels != "torch" and op.use_kernel(h, w) and _triton_lce().supported(h, w):
        total = _triton_lce().linear_cross_entropy(h, w, targets, ignore_index=ignore_index, softcap=logit_softcap)
    elif fused and torch.is_grad_enabled() and (h.requires_grad or w.requires_grad) and _fused_is_exact(h, w):
        gemms = kernels != "torch" and onednn.usable(h, w, dtype=_acc_dtype(w))
        total, _, _ = _LinearCrossEntropy.apply(h, w, targets, chunk_size, ignore_index, logit_softcap, gemms)
    else:
        total = _plain_chunked_total(h, w, targets, chunk_size, ignore_index, logit_softcap)
    if reduction == "sum":
        return total
    count = (targets != ignore_index).sum().clamp(min=1)
    return total / count


def cross_entropy(
    h: torch.Tensor,  # (N, D) final hidden states
    w: torch.Tensor,  # (V, D) output projection, or this rank's vocab slice under tensor parallelism
    targets: torch.Tensor,  # (N,) int64, IGNORE_INDEX where no loss
    *,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    fused: bool = True,
    logit_softcap: float | None = None,
    kernels: str = "torch",
) -> torch.Tensor:
    """:func:`chunked_cross_entropy`; vocab-parallel (``ftitan.parallel.loss``) when the current parallel
    layout splits the vocab, so that no rank gathers the head or holds all logits."""
    # imported here: ftitan.parallel imports ftitan.train
    from ftitan.parallel import layout as parallel_layout
    from ftitan.parallel import loss as parallel_loss

    layout = parallel_layout.current()
    if layout is not None and layout.axes_of("vocab"):
        return parallel_loss.vocab_parallel_cross_entropy(
            h, w, targets, layout, chunk_size=chunk_size, ignore_index=ignore_index, reduction=reduction,
            logit_softcap=logit_softcap,
        )
    return chunked_cross_entropy(
        h, w, targets, chunk_size=chunk_size, ignore_index=ignore_index, reduction=reduction, fused=fused,
        logit_softcap=logit_softcap, kernels=kernels,
    )


def next_token_loss(
    model: Any, *, chunk_size: int = 1024, fused: bool = True
) -> Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """``loss_fn(params, batch) -> (loss, aux)`` for a ``Model``.

    ``batch`` is ``{"inputs": (B, T) int64, "targets": (B, T) int64}`` with
    ``IGNORE_INDEX`` where no loss is taken (padding, prompts); packed rows
    (``ftitan.data.pack_documents``) also carry ``"positions"`` and
    ``"segments"`` (B, T), passed to ``apply`` so that no token attends to
    another document. The loss is the mean over every target token of the
    batch, whichever row or document holds it. The model runs
    with ``logits=False`` and the head is applied inside the chunked loss, soft-capped by the
    model's ``logit_softcap`` (None for most families) as ``apply(..., logits=True)`` is.
    ``aux["n_tokens"]`` counts the tokens that carry loss. For a model with
    ``apply_with_aux`` (MoE), its ``aux["loss"]`` (the weighted balancing
    loss) is added to the loss, ``aux["ce_loss"]`` is the cross-entropy
    alone, and the model's other aux entries (router load) are passed on.

    Works under every ``torch.func`` transform (``vmap(grad(loss_fn))`` for
    per-example gradients, ``jvp`` of ``grad`` for Hessian-vector
    products): the fused cross-entropy and SDPA step aside where they are not
    exact (see :func:`chunked_cross_entropy`); ``fused=False`` forces the
    plain cross-entropy (for ``torch.autograd.grad(..., create_graph=True)``).
    """

    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs, targets = batch["inputs"], batch["targets"]
        packed = {k: batch[k] for k in ("positions", "segments") if k in batch}  # packed rows' documents
        if model.apply_with_aux is None:
            (h, _), model_aux = model.apply(params, inputs, logits=False, **packed), {}  # h: (B, T, D)
        else:
            h, _, model_aux = model.apply_with_aux(params, inputs, logits=False, **packed)
        loss = cross_entropy(
            h.reshape(-1, h.shape[-1]), model.head(params), targets.reshape(-1), chunk_size=chunk_size, fused=fused,
            logit_softcap=model.logit_softcap, kernels=getattr(model.config, "kernels", "torch"),
        )
        aux = {"n_tokens": (targets != IGNORE_INDEX).sum()}
        if "loss" in model_aux:
            aux["ce_loss"] = loss.detach()
            loss = loss + model_aux["loss"]
        aux.update({k: v.detach() for k, v in model_aux.items() if k != "loss"})
        return loss, aux

    return loss_fn
