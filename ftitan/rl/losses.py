"""Policy-gradient losses of GRPO (Shao et al. 2024, DeepSeekMath) and DAPO (Yu et al. 2025) as pure functions.

A step of group-relative RL: ``G`` completions per prompt are sampled and scored (``ftitan.rl.rollout``),
each sample's advantage is its reward against its group's (:func:`group_advantages`), and the policy is
trained on the clipped surrogate of PPO (Schulman et al. 2017) over the completion tokens::

    adv = group_advantages(ro.rewards, group_size=8)                      # (N,)
    keep = keep_informative_groups(ro.rewards, 8).repeat_interleave(8)     # DAPO dynamic sampling
    batch = {**ro.batch, "advantages": adv}                                # + "old_logp" when reused
    step = make_train_step(grpo_loss_fn(model, clip_high=0.28), optimizer)
    state, metrics = step(state, {k: v[keep] for k, v in batch.items()})  # metrics["clip_fraction"], ...

Every per-token quantity is ``(B, T)`` and aligned with ``targets``: position ``t`` holds the
log-prob of ``targets[:, t]``; ``mask`` is 1 on the completion tokens (``targets != IGNORE_INDEX``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ftitan.models.base import soft_cap
from ftitan.nn import invariant as nn_invariant
from ftitan.train.dpo import require_whole_vocab, token_logprobs
from ftitan.train.losses import IGNORE_INDEX, _acc_dtype

__all__ = [
    "LOSS_AGGS",
    "group_advantages",
    "grpo_loss_fn",
    "keep_informative_groups",
    "overlong_penalty",
    "policy_loss",
    "token_entropy",
    "token_logprobs_and_entropy",
]

LOSS_AGGS = ("token-mean", "seq-mean-token-mean")
SCALES = ("std", "none")


# ---------------------------------------------------------------------------------------------- rewards


def _groups(rewards: torch.Tensor, group_size: int, where: str) -> torch.Tensor:
    if rewards.dim() != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"{where}: rewards {tuple(rewards.shape)} must be (N,) with N a multiple of "
                         f"group_size={group_size} >= 1 (N = prompts * group_size, prompt-major)")  # fmt: skip
    return rewards.reshape(-1, group_size)  # (P, G)


def group_advantages(
    rewards: torch.Tensor,  # (N,) N = P * G, prompt-major: G consecutive samples per prompt
    group_size: int,
    *,
    scale: str = "std",
    eps: float = 1e-6,
) -> torch.Tensor:  # (N,) float (float64 for float64 rewards)
    """Group-relative advantages (GRPO outcome supervision: Shao et al. 2024, sec. 4.1.2).

    ``scale="std"``: ``(r - mean_group) / (std_group + eps)``, with the *sample* (unbiased,
    ``G - 1`` denominator) standard deviation, as ``torch.Tensor.std`` computes it and GRPO
    implementations use; needs ``group_size >= 2``. ``scale="none"``: ``r - mean_group``
    (Dr. GRPO: Liu et al. 2025, which drops the std normalization). A group whose rewards are
    all equal gets advantage 0 either way.
    """
    if scale not in SCALES:
        raise ValueError(f"group_advantages: scale={scale!r} is unknown; use 'std' (GRPO) or 'none' (Dr. GRPO)")
    if scale == "std" and group_size < 2:
        raise ValueError(f"group_advantages: scale='std' needs group_size >= 2 (sample std of a group), "
                         f"got {group_size}; use scale='none' or a larger group")  # fmt: skip
    r = _groups(rewards, group_size, "group_advantages")
    r = r.to(torch.promote_types(r.dtype, torch.float32))
    adv = r - r.mean(dim=1, keepdim=True)
    if scale == "std":
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def keep_informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:  # (P,) bool
    """DAPO dynamic sampling (Yu et al. 2025, eq. 11): False for a group whose rewards are all equal.

    Such a group (all correct or all wrong) has zero advantages and so no policy gradient; DAPO
    drops it and samples more prompts. ``.repeat_interleave(group_size)`` gives the (N,) sample mask.
    """
    r = _groups(rewards, group_size, "keep_informative_groups")
    return (r != r[:, :1]).any(dim=1)


def overlong_penalty(
    lengths: torch.Tensor,  # (N,) int completion lengths
    *,
    max_len: int,
    cache: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # (N,) reward to add
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the task reward.

    ``0`` for ``|y| <= max_len - cache``; ``((max_len - cache) - |y|) / cache`` in between (linear
    from 0 down to -1 at ``max_len``); ``-1`` beyond ``max_len``.
    """
    if not 0 < cache <= max_len:
        raise ValueError(f"overlong_penalty: cache={cache} must be in (0, max_len={max_len}]; "
                         f"DAPO uses max_len=20480, cache=4096")  # fmt: skip
    n = lengths.to(dtype)
    return ((max_len - cache - n) / cache).clamp(min=-1.0, max=0.0)


# ---------------------------------------------------------------------------------------------- log-probs


def token_entropy(
    h: torch.Tensor,  # (N, D) final hidden states
    w: torch.Tensor,  # (V, D) output projection
    targets: torch.Tensor,  # (N,) int64, IGNORE_INDEX where none is wanted
    *,
    chunk_size: int = 1024,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # (N,) float32 (float64 for float64 params), 0 at ignored targets; detached
    """Entropy ``-sum_v p_v log p_v`` of ``softmax(h @ w.T)`` per row, one ``(chunk_size, V)`` block at a time
    (the logits soft-capped by ``logit_softcap``, ``ftitan.models.base.soft_cap``, when given).

    A metric: computed on detached inputs, so no block is kept for backward.
    """
    h, w32 = h.detach(), w.detach().to(_acc_dtype(w))
    out = []
    for s in range(0, h.shape[0], chunk_size):
        logp = torch.log_softmax(soft_cap(h[s : s + chunk_size].to(w32.dtype) @ w32.T, logit_softcap), dim=-1)
        ent = -(logp.exp() * logp).sum(dim=-1)
        out.append(torch.where(targets[s : s + chunk_size] != IGNORE_INDEX, ent, torch.zeros_like(ent)))
    return torch.cat(out)


def token_logprobs_and_entropy(
    model: Any,
    params: Any,
    inputs: torch.Tensor,  # (B, T) int64
    targets: torch.Tensor,  # (B, T) int64, IGNORE_INDEX off the completion
    *,
    positions: torch.Tensor | None = None,  # (B, T) | (T,); default arange(T)
    chunk_size: int = 1024,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T) log p(target), (B, T) entropy; 0 where ignored
    """Per-token log-probs of ``targets`` (differentiable) and the policy's entropy (detached) there.

    ``model.apply(params, inputs, logits=False)`` then ``model.head(params)`` (soft-capped by the model's
    ``logit_softcap``) in float32 blocks of ``chunk_size`` rows (:func:`ftitan.train.dpo.token_logprobs`
    for the log-probs, whose fused backward recomputes the blocks; :func:`token_entropy`), so the
    ``(B, T, V)`` logits never exist.
    A model in the batch-invariant mode (``ftitan.config.batch_invariant``) gives the log-probs
    ``ftitan.infer.generate(..., logprobs=True)`` gave its samples, bit for bit.
    """
    if inputs.shape != targets.shape or inputs.dim() != 2:
        raise ValueError(f"token_logprobs_and_entropy: inputs {tuple(inputs.shape)} and targets "
                         f"{tuple(targets.shape)} must both be (B, T)")  # fmt: skip
    require_whole_vocab("token_logprobs_and_entropy")
    extra = {} if positions is None else {"positions": positions}
    h, _ = model.apply(params, inputs, logits=False, **extra)  # (B, T, D)
    h, w, t = h.reshape(-1, h.shape[-1]), model.head(params), targets.reshape(-1)
    cap = model.logit_softcap
    logp = token_logprobs(h, w, t, chunk_size=chunk_size, fused=fused, invariant=nn_invariant.enabled(model.config),
                          logit_softcap=cap)  # fmt: skip
    entropy = token_entropy(h, w, t, chunk_size=chunk_size, logit_softcap=cap)
    return logp.reshape(targets.shape), entropy.reshape(targets.shape)


# ---------------------------------------------------------------------------------------------- the loss


def _aggregate(x: torch.Tensor, mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    # x, mask: (B, T); token-mean over the batch, or token-mean per row then mean over non-empty rows
    if loss_agg == "token-mean":
        return (x * mask).sum() / mask.sum().clamp(min=1)
    per_row = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (B,)
    return per_row.sum() / (mask.sum(dim=1) > 0).sum().clamp(min=1)


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman 2020's unbiased, non-negative KL estimator: ``exp(d) - d - 1``, ``d = log q/p`` with samples of p."""
    return torch.exp(log_ratio) - log_ratio - 1


def _check_hyper(clip_low: float, clip_high: float, loss_agg: str, tis_cap: float | None, where: str) -> None:
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"{where}: loss_agg={loss_agg!r} is unknown; use 'token-mean' (DAPO) or "
                         f"'seq-mean-token-mean' (GRPO)")  # fmt: skip
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"{where}: clip_low={clip_low} must be in [0, 1) and clip_high={clip_high} >= 0 "
                         f"(PPO: 0.2 both; DAPO clip-higher: clip_high=0.28)")  # fmt: skip
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"{where}: tis_cap={tis_cap} must be > 0 (e.g. 2.0) or None for no correction")


def policy_loss(
    logp: torch.Tensor,  # (B, T) trainer log-probs of the sampled tokens, differentiable
    old_logp: torch.Tensor,  # (B, T) the same under the params that made the rollout (trainer side)
    advantages: torch.Tensor,  # (B,) one per sequence
    mask: torch.Tensor,  # (B, T) bool/float, 1 on completion tokens
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: str = "token-mean",
    ref_logp: torch.Tensor | None = None,  # (B, T) frozen reference, for the KL penalty
    kl_coef: float = 0.0,
    gen_logp: torch.Tensor | None = None,  # (B, T) the generator's (inference engine's) log-probs
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate loss of GRPO/DAPO and its metrics.

    Per token, with ``ratio = exp(logp - old_logp)`` and ``A`` the sequence's advantage (PPO:
    Schulman et al. 2017; DAPO's clip-higher decouples the bounds)::

        l = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) * w + kl_coef * k3

    - ``w = min(exp(old_logp - gen_logp), tis_cap)`` (detached), truncated importance sampling for
      the generator/trainer mismatch (Yao et al. 2025, "Your efficient RL framework secretly brings you
      off-policy RL training"); 1 when ``tis_cap`` is None. It weights the policy-gradient term only.
    - ``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1``: GRPO's per-token KL to the reference
      (Shao et al. 2024, eq. 4; Schulman 2020), needs ``ref_logp`` when ``kl_coef > 0``.

    ``loss_agg="token-mean"`` averages ``l`` over every completion token of the batch (DAPO, eq. 12);
    ``"seq-mean-token-mean"`` over each sequence's tokens, then over the sequences that have any
    (GRPO, eq. 3). Metrics (detached) are averaged the same way, so accumulated micro-batches give the
    full batch's: ``clip_fraction`` (tokens whose clipped term is taken, i.e. no gradient:
    ``A > 0, ratio > 1 + clip_high`` or ``A < 0, ratio < 1 - clip_low``), ``approx_kl`` (k3 of
    KL(old || new)), ``kl`` (k3 to the reference, when ``ref_logp`` is given), ``mismatch_kl`` (k3 of
    KL(generator || trainer) from ``gen_logp`` and ``old_logp``) and ``tis_weight`` (mean ``w``),
    when ``gen_logp`` is given.
    """
    _check_hyper(clip_low, clip_high, loss_agg, tis_cap, "policy_loss")
    shapes = [tuple(x.shape) for x in (logp, old_logp, mask, ref_logp, gen_logp) if x is not None]
    if len(set(shapes)) != 1 or logp.dim() != 2 or advantages.shape != logp.shape[:1]:
        raise ValueError(f"policy_loss: logp, old_logp, mask (and ref_logp, gen_logp) must be one (B, T) shape "
                         f"and advantages (B,); got {shapes} and {tuple(advantages.shape)}")  # fmt: skip
    if kl_coef and ref_logp is None:
        raise ValueError(f"policy_loss: kl_coef={kl_coef} needs ref_logp, the reference's (B, T) log-probs")
    if tis_cap is not None and gen_logp is None:
        raise ValueError(f"policy_loss: tis_cap={tis_cap} needs gen_logp, the generator's (B, T) log-probs")
    mask = mask.to(logp.dtype)
    old_logp = old_logp.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None]  # (B, 1)
    ratio = torch.exp(logp - old_logp)
    unclipped, clipped = ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    metrics: dict[str, torch.Tensor] = {}
    if gen_logp is not None:
        trainer_vs_gen = old_logp - gen_logp.to(logp.dtype)  # log p_trainer / p_generator on generator samples
        metrics["mismatch_kl"] = _aggregate(_k3(trainer_vs_gen), mask, loss_agg)
        if tis_cap is not None:
            w = torch.exp(trainer_vs_gen).clamp(max=tis_cap).detach()
            per_token = per_token * w
            metrics["tis_weight"] = _aggregate(w, mask, loss_agg)
    if ref_logp is not None:
        kl = _k3(ref_logp.to(logp.dtype) - logp)
        per_token = per_token + kl_coef * kl
        metrics["kl"] = _aggregate(kl.detach(), mask, loss_agg)
    r = ratio.detach()
    active = ((adv > 0) & (r > 1 + clip_high)) | ((adv < 0) & (r < 1 - clip_low))
    metrics["clip_fraction"] = _aggregate(active.to(logp.dtype), mask, loss_agg)
    metrics["approx_kl"] = _aggregate(_k3(logp.detach() - old_logp), mask, loss_agg)
    return _aggregate(per_token, mask, loss_agg), {k: v.detach() for k, v in metrics.items()}


def grpo_loss_fn(
    model: Any,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: str = "token-mean",
    kl_coef: float = 0.0,
    tis_cap: float | None = None,
    chunk_size: int = 1024,
    fused: bool = True,
) -> Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """``loss_fn(params, batch) -> (loss, aux)`` for ``make_train_step``: :func:`policy_loss` of a ``Model``.

    ``batch``: ``inputs``, ``targets`` (B, T) int64 with ``IGNORE_INDEX`` off the completion tokens,
    ``advantages`` (B,); optional ``old_logp`` (B, T) (absent: the current log-probs, detached, i.e.
    one update per rollout, ratio 1), ``ref_logp`` (B, T) (needed when ``kl_coef > 0``),
    ``gen_logp`` (B, T) (needed when ``tis_cap`` is set) and ``positions``.

    ``aux``: :func:`policy_loss`'s metrics, ``entropy`` (of the policy at the completion tokens,
    averaged like the loss) and ``n_tokens``, this micro-batch's weight in ``make_train_step``'s
    accumulated mean (``_accumulate`` weights each micro-batch's mean by ``aux["n_tokens"]``): the
    completion-token count for ``"token-mean"``, and the number of sequences with a completion token
    for ``"seq-mean-token-mean"`` (the mean is over those sequences). With that weight, ``accum_steps=k``
    equals one step on the whole batch. A MoE model's balancing loss is not added.
    """
    _check_hyper(clip_low, clip_high, loss_agg, tis_cap, "grpo_loss_fn")

    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for key in ("inputs", "targets", "advantages", *(("ref_logp",) if kl_coef else ()),
                    *(("gen_logp",) if tis_cap is not None else ())):  # fmt: skip
            if key not in batch:
                raise ValueError(f"grpo_loss_fn: the batch has no {key!r} (keys: {sorted(batch)})")
        targets = batch["targets"]
        logp, entropy = token_logprobs_and_entropy(model, params, batch["inputs"], targets,
                                                   positions=batch.get("positions"), chunk_size=chunk_size,
                                                   fused=fused)  # fmt: skip
        mask = targets != IGNORE_INDEX
        loss, metrics = policy_loss(
            logp, batch.get("old_logp", logp.detach()), batch["advantages"], mask,
            clip_low=clip_low, clip_high=clip_high, loss_agg=loss_agg, ref_logp=batch.get("ref_logp"),
            kl_coef=kl_coef, gen_logp=batch.get("gen_logp"), tis_cap=tis_cap,
        )  # fmt: skip
        n = mask.sum() if loss_agg == "token-mean" else mask.any(dim=1).sum()
        return loss, {**metrics, "entropy": _aggregate(entropy, mask.to(entropy.dtype), loss_agg), "n_tokens": n}

    return loss_fn
