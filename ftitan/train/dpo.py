"""Direct Preference Optimization as a pure loss (DPO: Rafailov et al. 2023; IPO: Azar et al. 2023).

A preference pair is a prompt with a ``chosen`` and a ``rejected`` completion. DPO trains
the policy ``pi`` against a frozen reference ``ref`` on the implicit reward margin

    h = (log pi(chosen) - log pi(rejected)) - (log ref(chosen) - log ref(rejected))

where ``log pi(y)`` is the summed log-probability of the completion's tokens given the prompt
(:func:`completion_logprobs`). The reference log-probs are computed once per batch from the
frozen params (:func:`with_reference`) and travel in the batch, so the train step
differentiates the policy alone::

    loss_fn = dpo_loss_fn(model, beta=0.1)
    step = make_train_step(loss_fn, optimizer)
    batch = with_reference(model, ref_params, batch)   # adds "ref_chosen", "ref_rejected" (B,)
    state, metrics = step(state, batch)                # metrics["rewards/accuracy"], ...

The batch (``ftitan.data.preference_batches`` builds it) holds ``chosen_inputs``,
``chosen_targets``, ``rejected_inputs``, ``rejected_targets`` ``(B, T)`` int64 with
``IGNORE_INDEX`` wherever no log-prob is taken (the prompt, padding), and optionally
``chosen_positions`` / ``rejected_positions`` (and ``*_segments``) passed on to ``apply``.

Accumulation and data parallelism: the loss is a mean over pairs, so a micro-batch's weight
in the accumulated mean is its pair count. ``make_train_step``, ``optim.MultiSteps`` and
``ftitan.parallel``'s step read that weight from ``aux["n_tokens"]`` (the name comes from the
token-mean language-model loss), so ``dpo_loss_fn`` puts the pair count there; ``aux["n_pairs"]``
holds the same count under a name that says what it is. Both are integers and add up over
micro-batches; the float entries (rewards, accuracy) are averaged with the same weights, so
they are the full batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ftitan.kernels.autodiff import plain_reverse_mode
from ftitan.models.base import soft_cap
from ftitan.nn import invariant as nn_invariant
from ftitan.train.losses import IGNORE_INDEX, _acc_dtype

__all__ = ["LOSS_TYPES", "completion_logprobs", "dpo_loss", "dpo_loss_fn", "token_logprobs", "with_reference"]

LOSS_TYPES = ("sigmoid", "ipo")
SIDES = ("chosen", "rejected")
_APPLY_KEYS = ("positions", "segments")  # optional per-side batch entries passed to model.apply


# ---------------------------------------------------------------------------------------------- log-probs


def _chunk_token_logprobs(h: torch.Tensor, w32: torch.Tensor, t: torch.Tensor, ignore_index: int,
                          invariant: bool = False, cap: float | None = None) -> torch.Tensor:  # fmt: skip
    # h: (C, D); w32: (V, D) float32 (float64 for float64 params); t: (C,) -> (C,) log p(t), 0 where ignored
    if invariant:  # the generator's own head matmul, soft-cap and log-softmax (ftitan.infer.generate), bit for bit
        logp = nn_invariant.log_softmax(soft_cap(nn_invariant.linear(h.to(w32.dtype), w32), cap), dim=-1)
    else:
        logp = torch.log_softmax(soft_cap(h.to(w32.dtype) @ w32.T, cap), dim=-1)  # (C, V)
    valid = t != ignore_index
    picked = logp.gather(1, torch.where(valid, t, torch.zeros_like(t))[:, None]).squeeze(1)
    return torch.where(valid, picked, torch.zeros_like(picked))


class _TokenLogprobs(torch.autograd.Function):
    """``log softmax(h @ w.T)[i, t_i]`` per token; backward recomputes each ``(chunk, V)`` block.

    Unlike the fused cross-entropy, the incoming gradient differs per token (each row's
    log-prob is weighted by its pair's DPO coefficient), so the gradients cannot be formed
    in forward; only ``h``, ``w`` and the targets are saved, and backward walks the chunks
    again (one extra head matmul) so that at most one block of logits exists at a time.
    """

    @staticmethod
    def forward(h, w, targets, chunk_size: int, ignore_index: int, invariant: bool,  # type: ignore[override]
                cap: float | None):  # fmt: skip
        w32 = w.to(_acc_dtype(w))
        return torch.cat([
            _chunk_token_logprobs(h[s : s + chunk_size], w32, targets[s : s + chunk_size], ignore_index, invariant,
                                  cap)
            for s in range(0, h.shape[0], chunk_size)
        ])  # fmt: skip

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        h, w, targets, chunk_size, ignore_index, _, cap = inputs
        ctx.save_for_backward(h, w, targets)
        ctx.chunk_size, ctx.ignore_index, ctx.cap = chunk_size, ignore_index, cap

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        h, w, targets = ctx.saved_tensors
        w32 = w.to(_acc_dtype(w))
        grad_h, grad_w = [], torch.zeros_like(w32)
        for s in range(0, h.shape[0], ctx.chunk_size):
            hc, tc = h[s : s + ctx.chunk_size].to(w32.dtype), targets[s : s + ctx.chunk_size]
            valid = tc != ctx.ignore_index
            gc = g[s : s + ctx.chunk_size].to(w32.dtype)
            gc = torch.where(valid, gc, torch.zeros_like(gc))
            safe = torch.where(valid, tc, torch.zeros_like(tc))
            z = hc @ w32.T  # (C, V)
            th = None if ctx.cap is None else torch.tanh(z / ctx.cap)
            z = z if th is None else ctx.cap * th  # soft_cap's ops, tanh kept for the chain factor
            # d log p(t) / d logits = onehot(t) - softmax, scaled by each token's incoming gradient
            d = (-torch.softmax(z, dim=-1) * gc[:, None]).scatter_add(1, safe[:, None], gc[:, None])
            if th is not None:  # through the soft-cap: 1 - tanh^2
                d = d * (1 - th * th)
            grad_h.append((d @ w32).to(h.dtype))  # (C, D)
            grad_w = grad_w + d.T @ hc  # (V, D)
        return torch.cat(grad_h), grad_w.to(w.dtype), None, None, None, None, None


def token_logprobs(
    h: torch.Tensor,  # (N, D) final hidden states
    w: torch.Tensor,  # (V, D) output projection
    targets: torch.Tensor,  # (N,) int64, IGNORE_INDEX where no log-prob is taken
    *,
    chunk_size: int = 1024,
    fused: bool = True,
    invariant: bool = False,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # (N,) float32 (float64 for float64 params), 0 at ignored targets
    """``log p(targets[i])`` under ``softmax(h @ w.T)``, one ``(chunk_size, V)`` block of logits at a time.

    Logits and log-softmax are float32 (as in :func:`ftitan.train.chunked_cross_entropy`).
    ``fused=True`` uses a Function whose backward recomputes the blocks, so no block is kept
    for backward, wherever that is exact (plain reverse mode: autograd or one
    ``torch.func.grad`` level); under other transforms (``vmap``, ``jvp``, ``grad`` of ``grad``)
    and with ``fused=False`` it is the same computation in plain differentiable ops, which
    keeps every block for backward. ``invariant``: the head matmul and log-softmax of the
    batch-invariant mode (``ftitan.nn.invariant``), the ones ``ftitan.infer.generate`` scores its
    samples with, so both give the same bits (the gradient is the ordinary one). ``logit_softcap``:
    the logits are ``cap * tanh(h @ w.T / cap)`` (a model's ``Model.logit_softcap``; None: plain).
    """
    if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1]:
        raise ValueError(f"token_logprobs: expected h (N, D) and w (V, D), got {tuple(h.shape)} and {tuple(w.shape)}")
    if targets.shape != h.shape[:1]:
        raise ValueError(f"token_logprobs: targets {tuple(targets.shape)} must be (N,) = ({h.shape[0]},)")
    if chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size={chunk_size} must be >= 1")
    needs_grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    if fused and needs_grad and plain_reverse_mode():
        return _TokenLogprobs.apply(h, w, targets, chunk_size, IGNORE_INDEX, invariant, logit_softcap)
    w32 = w.to(_acc_dtype(w))
    return torch.cat([
        _chunk_token_logprobs(h[s : s + chunk_size], w32, targets[s : s + chunk_size], IGNORE_INDEX, invariant,
                              logit_softcap)
        for s in range(0, h.shape[0], chunk_size)
    ])  # fmt: skip


def require_whole_vocab(caller: str) -> None:
    """Raise naming ``caller`` when the current parallel layout splits the vocab: per-token log-probs (DPO,
    RL) need every logit of a token on one rank (the training loss is vocab-parallel; these are not yet)."""
    from ftitan.parallel import layout as parallel_layout  # here: ftitan.parallel imports ftitan.train

    layout = parallel_layout.current()
    if layout is not None and layout.axes_of("vocab"):
        raise ValueError(
            f"{caller}: the parallel layout splits the vocab over {layout.axes_of('vocab')}, and per-token "
            f"log-probs need every logit of a token on one rank; drop the 'vocab' rule (replicate the head)"
        )


def completion_logprobs(
    model: Any,
    params: Any,
    inputs: torch.Tensor,  # (B, T) int64
    targets: torch.Tensor,  # (B, T) int64, IGNORE_INDEX on the prompt and the padding
    *,
    positions: torch.Tensor | None = None,  # (B, T) | (T,) int; default arange(T)
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows
    chunk_size: int = 1024,
    fused: bool = True,
) -> torch.Tensor:  # (B,) float32
    """Summed log-probability of each row's non-ignored targets: ``log pi(completion | prompt)`` (DPO eq. 7).

    Runs ``model.apply(params, inputs, logits=False)`` and takes the head
    (``model.head(params)``, soft-capped by ``model.logit_softcap``) inside :func:`token_logprobs`, so
    all ``(B, T, V)`` logits never exist at once. A row with no target tokens gets 0.
    """
    if inputs.shape != targets.shape or inputs.dim() != 2:
        raise ValueError(f"completion_logprobs: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} "
                         f"must both be (B, T)")  # fmt: skip
    require_whole_vocab("completion_logprobs")
    extra = {k: v for k, v in (("positions", positions), ("segments", segments)) if v is not None}
    h, _ = model.apply(params, inputs, logits=False, **extra)  # (B, T, D)
    logp = token_logprobs(h.reshape(-1, h.shape[-1]), model.head(params), targets.reshape(-1),
                          chunk_size=chunk_size, fused=fused, logit_softcap=model.logit_softcap)  # fmt: skip
    return logp.reshape(targets.shape).sum(dim=1)  # (B,)


def _side(batch: dict[str, torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    for key in (f"{side}_inputs", f"{side}_targets"):
        if key not in batch:
            raise ValueError(f"dpo: the batch has no {key!r} (keys: {sorted(batch)}); build it with "
                             f"ftitan.data.preference_batches")  # fmt: skip
    extra = {k: batch[f"{side}_{k}"] for k in _APPLY_KEYS if f"{side}_{k}" in batch}
    return batch[f"{side}_inputs"], batch[f"{side}_targets"], extra


def _pair_logprobs(model: Any, params: Any, batch: dict[str, torch.Tensor], *, chunk_size: int,
                   fused: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(log pi(chosen), log pi(rejected))``, (B,) each: one forward over both halves when their shapes agree."""
    (ci, ct, ce), (ri, rt, re) = _side(batch, "chosen"), _side(batch, "rejected")
    kw: dict[str, Any] = dict(chunk_size=chunk_size, fused=fused)
    same = ci.shape == ri.shape and ce.keys() == re.keys() and all(ce[k].shape == re[k].shape for k in ce)
    if same and all(v.dim() == 2 for v in (*ce.values(), *re.values())):  # (T,) positions: one forward each
        extra = {k: torch.cat([ce[k], re[k]]) for k in ce}
        both = completion_logprobs(model, params, torch.cat([ci, ri]), torch.cat([ct, rt]), **extra, **kw)  # (2B,)
        return both[: ci.shape[0]], both[ci.shape[0] :]
    chosen = completion_logprobs(model, params, ci, ct, **ce, **kw)
    return chosen, completion_logprobs(model, params, ri, rt, **re, **kw)


def with_reference(model: Any, ref_params: Any, batch: dict[str, torch.Tensor], *,
                   chunk_size: int = 1024) -> dict[str, torch.Tensor]:  # fmt: skip
    """``batch`` plus ``ref_chosen`` and ``ref_rejected`` (B,) float32: the frozen reference's summed
    completion log-probs (:func:`completion_logprobs`), under ``torch.no_grad``. A new dict; ``batch``
    is not changed. Sums also for ``loss_type="ipo"``: :func:`dpo_loss_fn` averages both sides itself."""
    with torch.no_grad():
        ref_c, ref_r = _pair_logprobs(model, ref_params, batch, chunk_size=chunk_size, fused=True)
    return {**batch, "ref_chosen": ref_c.float(), "ref_rejected": ref_r.float()}


# ---------------------------------------------------------------------------------------------- the loss


def _check_hyper(beta: float | torch.Tensor, loss_type: str, label_smoothing: float, where: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"{where}: loss_type={loss_type!r} is unknown; use one of {', '.join(map(repr, LOSS_TYPES))}")
    if not isinstance(beta, torch.Tensor) and not beta > 0:
        raise ValueError(f"{where}: beta={beta} must be > 0 (the KL weight; DPO uses 0.1 to 0.5)")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"{where}: label_smoothing={label_smoothing} must be in [0, 0.5): it is the assumed "
                         f"probability that a preference label is flipped (conservative DPO)")  # fmt: skip
    if loss_type == "ipo" and label_smoothing:
        raise ValueError(f"{where}: label_smoothing={label_smoothing} applies to loss_type='sigmoid' only; "
                         f"IPO's squared loss has no label noise term, set label_smoothing=0")  # fmt: skip


def dpo_loss(
    pi_chosen: torch.Tensor,  # (P,) policy log-probs of the chosen completions
    pi_rejected: torch.Tensor,  # (P,)
    ref_chosen: torch.Tensor,  # (P,) reference log-probs (ignored when reference_free)
    ref_rejected: torch.Tensor,  # (P,)
    *,
    beta: float | torch.Tensor = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The preference loss, a mean over the ``P`` pairs, and its metrics.

    With ``h = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)``:

    - ``"sigmoid"``: DPO (Rafailov et al. 2023, eq. 7), ``-log sigmoid(beta h)``; with
      ``label_smoothing = eps`` the conservative DPO of Mitchell 2023,
      ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`` (labels flipped with probability eps).
    - ``"ipo"``: IPO (Azar et al. 2023, eq. 17), ``(h - 1 / (2 beta))^2``. The formula is applied to the
      log-probs given; Azar et al. use per-token-averaged log-probs, which is what :func:`dpo_loss_fn`
      passes for ``"ipo"``.

    ``reference_free=True`` takes ``ref_* = 0`` (the reference is the uniform policy).
    Metrics (detached floats): ``rewards/chosen`` and ``rewards/rejected`` (the mean implicit rewards
    ``beta (pi - ref)``), ``rewards/accuracy`` (fraction of pairs whose chosen reward is higher),
    ``rewards/margin`` (mean chosen minus rejected reward).
    """
    _check_hyper(beta, loss_type, label_smoothing, "dpo_loss")
    shapes = {tuple(x.shape) for x in (pi_chosen, pi_rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"dpo_loss: pi_chosen, pi_rejected, ref_chosen, ref_rejected must all be (P,), got "
                         f"{[tuple(x.shape) for x in (pi_chosen, pi_rejected, ref_chosen, ref_rejected)]}")  # fmt: skip
    if reference_free:
        ref_chosen, ref_rejected = torch.zeros_like(pi_chosen), torch.zeros_like(pi_rejected)
    h = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)  # (P,)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        losses = (h - 1 / (2 * beta)) ** 2
    r_chosen = (beta * (pi_chosen - ref_chosen)).detach()  # (P,)
    r_rejected = (beta * (pi_rejected - ref_rejected)).detach()
    metrics = {
        "rewards/chosen": r_chosen.mean(),
        "rewards/rejected": r_rejected.mean(),
        "rewards/accuracy": (r_chosen > r_rejected).to(r_chosen.dtype).mean(),
        "rewards/margin": (r_chosen - r_rejected).mean(),
    }
    return losses.mean(), metrics


def dpo_loss_fn(
    model: Any,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    chunk_size: int = 1024,
    fused: bool = True,
) -> Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """``loss_fn(params, batch) -> (loss, aux)`` for ``make_train_step``: :func:`dpo_loss` of a ``Model``.

    ``batch``: see the module docstring; ``ref_chosen`` / ``ref_rejected`` (B,) come from
    :func:`with_reference` (not needed with ``reference_free=True``). Both completions of a
    pair go through one forward when their shapes agree. For ``loss_type="ipo"`` the policy
    and reference log-probs are divided by each completion's token count (Azar et al. 2023);
    for ``"sigmoid"`` they are sums (Rafailov et al. 2023).

    ``aux``: the metrics of :func:`dpo_loss`, ``logps/chosen`` and ``logps/rejected`` (mean policy
    log-probs, as fed to the loss), and ``n_pairs`` = ``n_tokens`` = the number of pairs, the weight
    of this micro-batch in an accumulated mean over pairs (see the module docstring). A MoE
    model's balancing loss is not added.
    """
    _check_hyper(beta, loss_type, label_smoothing, "dpo_loss_fn")

    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        pi_c, pi_r = _pair_logprobs(model, params, batch, chunk_size=chunk_size, fused=fused)  # (B,) each
        if reference_free:
            ref_c = ref_r = torch.zeros_like(pi_c)
        elif "ref_chosen" not in batch or "ref_rejected" not in batch:
            raise ValueError("dpo_loss_fn: the batch has no 'ref_chosen'/'ref_rejected'; add them with "
                             "with_reference(model, ref_params, batch), or pass reference_free=True")  # fmt: skip
        else:
            ref_c, ref_r = batch["ref_chosen"].to(pi_c.dtype), batch["ref_rejected"].to(pi_c.dtype)
        if loss_type == "ipo":
            n_c = (batch["chosen_targets"] != IGNORE_INDEX).sum(dim=1).clamp(min=1).to(pi_c.dtype)  # (B,)
            n_r = (batch["rejected_targets"] != IGNORE_INDEX).sum(dim=1).clamp(min=1).to(pi_c.dtype)
            pi_c, pi_r, ref_c, ref_r = pi_c / n_c, pi_r / n_r, ref_c / n_c, ref_r / n_r
        loss, metrics = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=beta, loss_type=loss_type,
                                 label_smoothing=label_smoothing, reference_free=reference_free)  # fmt: skip
        def count() -> torch.Tensor:
            return torch.full((), pi_c.shape[0], dtype=torch.int64, device=pi_c.device)

        aux = {**metrics, "logps/chosen": pi_c.detach().mean(), "logps/rejected": pi_r.detach().mean(),
               "n_pairs": count(), "n_tokens": count()}  # fmt: skip
        return loss, aux

    return loss_fn
