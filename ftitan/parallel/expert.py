"""Expert parallelism: routed experts split over ``ep``, token rows sent to them by all-to-all.

The MoE layer (``ftitan.nn.moe``) is route -> dispatch -> experts ->
combine; this module is its parallel seam, a no-op without a current layout
(single-process code runs exactly ``nn.moe``):

- :func:`experts_forward` (the ``experts_fn`` of ``nn.moe.moe``): with
  ``ep > 1`` and the experts' weights split over it (rule ``("experts",
  ("ep",))``: rank ``r`` holds experts ``[r E/ep, (r+1) E/ep)``), each rank
  first tells every other rank how many rows it sends to each of its experts
  (an all-to-all of the per-expert counts; the split sizes become Python
  ints, so this runs eagerly), then sends the rows (already sorted by
  expert, so one contiguous block per destination), regroups what it
  received by local expert, runs its experts with the grouped GEMM and sends
  the outputs back by the reverse all-to-all, in the order ``combine``
  expects. The all-to-alls are differentiable (backward is the reverse
  exchange), so expert weights get the gradients of every rank's tokens
  without an ep reduction (``parallel.shard`` leaves ep out of theirs).
- :func:`moe`: the MoE feed-forward under a layout: tensor parallel like an
  MLP (experts' hidden width split over ``tp``: input through
  ``column_input``, partial outputs through ``row_output``; the router,
  replicated over tp, sums its gradient over tp), the router (stored split
  over ep with the experts) all-gathered over ep, experts through
  :func:`experts_forward`.
- :func:`global_stats` / :func:`moe_aux`: router statistics of the global
  batch, so the balancing loss, its gradients and the load metrics (and the
  DeepSeek-V3 bias update that reads them) equal a single-process run.

Why the statistics are summed with :func:`~ftitan.parallel.collectives.psum`
(backward all-reduces the cotangent too). The parallel loss of rank ``r`` is
``w_r (CE_r + c LB(S))`` with ``w_r = n_r / (N tp)`` (``make_parallel_loss``)
and ``S = sum_r' s_r'`` the stats of the global batch, which every rank
holds after the sum. The ``w_r`` of all ranks sum to 1, so the summed loss is
``CE + c LB(S)``, and the gradient reaching rank ``r'``'s own probability
sums must be ``sum_r w_r c dLB/dS = c dLB/dS``: the cotangents of every
rank, summed. An identity backward (``all_reduce``) would give rank ``r'``
only ``w_r' c dLB/dS``, the balancing gradient scaled by its share of the
tokens. (Expert counts and row counts are piecewise constant: no gradient.)
The sum runs over the data axes only; tp ranks route the same tokens, and
each holds ``1/tp`` of the cotangent, which the tp seams above sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ftitan.nn import moe as moe_
from ftitan.nn.moe import MoEConfig, MoEStats
from ftitan.parallel import activations as par
from ftitan.parallel import collectives as C
from ftitan.parallel.layout import Layout, current

__all__ = ["experts_forward", "global_stats", "moe", "moe_aux", "regroup_by_expert"]


def experts_forward(
    x: torch.Tensor,  # (M, D) rows sorted by expert (all E experts)
    offs: torch.Tensor,  # (E,) int32 cumulative row ends
    w1: torch.Tensor,  # (E_local, F, D) gate; E_local = E / ep under expert parallelism
    w2: torch.Tensor,  # (E_local, D, F) down
    w3: torch.Tensor,  # (E_local, F, D) up
) -> torch.Tensor:  # (M, D), rows in x's order
    """``nn.moe.experts_forward``, with the rows sent to the ep rank that holds their expert and back.

    Without a layout, with ``ep == 1``, or when the rules keep the experts
    whole (``w1`` has all ``E`` of them; ep is then one more data axis), the
    experts run locally.
    """
    layout = current()
    group = None if layout is None else layout.group("ep")
    n_experts, n_local = offs.shape[0], w1.shape[0]
    if group is None or n_local == n_experts:
        return moe_.experts_forward(x, offs, w1, w2, w3)
    if n_local * group.size() != n_experts:
        raise ValueError(
            f"expert parallel: this rank holds {n_local} of {n_experts} experts, but ep={group.size()} needs "
            f"{n_experts} / {group.size()}; split the experts over ep alone (rule ('experts', ('ep',))) or keep "
            f"them whole (rule ('experts', ()))"
        )
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "expert parallel (ep > 1): the token all-to-all's split sizes depend on the routing, so the step "
            "cannot be compiled with fullgraph=True; run the parallel step eagerly (make_train_step(compile=False))"
        )
    return _experts_over_ep(x, offs, w1, w2, w3, group)


def _exchange_counts(offs: torch.Tensor, group: Any) -> tuple[torch.Tensor, list[int], list[int]]:
    """``(recv (ep, E_local) rows per (source rank, local expert), rows sent to each rank, rows received
    from each rank)``: the all-to-all of the per-expert counts that sizes the token all-to-all."""
    ep = group.size()
    counts = torch.diff(offs.long(), prepend=torch.zeros(1, dtype=torch.long, device=offs.device))  # (E,)
    n_local = counts.numel() // ep
    splits = [n_local] * ep
    recv = C.all_to_all(counts, group, out_splits=splits, in_splits=splits).view(ep, n_local)
    return recv, counts.view(ep, n_local).sum(1).tolist(), recv.sum(1).tolist()


def _experts_over_ep(
    x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, group: Any
) -> torch.Tensor:  # (M, D)
    recv, send_splits, recv_splits = _exchange_counts(offs, group)
    xs = C.all_to_all(x, group, out_splits=recv_splits, in_splits=send_splits)  # (M_recv, D): by source, expert
    order, offs_local = regroup_by_expert(recv)
    y = _local_experts(xs[order], offs_local, w1, w2, w3)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return C.all_to_all(y[inverse], group, out_splits=send_splits, in_splits=recv_splits)


def regroup_by_expert(recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (ep, E_local) int
    """``(order (M_recv,), offs (E_local,) int32)``: received rows come grouped by source rank, then by
    local expert; ``rows[order]`` groups them by local expert (stable: source order kept within one),
    with cumulative row ends ``offs``, as the grouped GEMM wants."""
    ep, n_local = recv.shape
    expert_of_row = torch.repeat_interleave(torch.arange(n_local, device=recv.device).repeat(ep), recv.reshape(-1))
    order = torch.argsort(expert_of_row, stable=True)
    return order, torch.cumsum(recv.sum(0), 0).to(torch.int32)


def _local_experts(
    x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:  # (M, D)
    if x.shape[0]:
        return moe_.experts_forward(x, offs, w1, w2, w3)
    # no rows for this rank's experts: one zero row (output and weight gradients exactly 0) keeps x and the
    # weights in the graph, so their backward collectives run on this rank as on the others; the grouped
    # GEMM's backward also refuses 0 rows
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return moe_.experts_forward(padded, torch.ones_like(offs), w1, w2, w3)[:0]


def global_stats(stats: Sequence[MoEStats]) -> list[MoEStats]:
    """Each layer's router statistics summed over the data axes (those of the global batch), in one
    :func:`~ftitan.parallel.collectives.psum` per axis; as given without a layout. See the module doc."""
    layout = current()
    axes = () if layout is None else layout.data_axes()
    if not axes or not stats:
        return list(stats)
    e = stats[0].counts.numel()
    packed = torch.stack([torch.cat([s.counts, s.prob_sum, s.n_tokens.reshape(1)]) for s in stats])  # (L, 2E+1)
    for a in axes:
        packed = C.psum(packed, layout.group(a))
    counts, probs, rows = packed.split((e, e, 1), dim=-1)
    return [MoEStats(c.detach(), p, n.detach().reshape(())) for c, p, n in zip(counts, probs, rows, strict=True)]


def moe_aux(stats: Sequence[MoEStats], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """``nn.moe.moe_aux`` of the global batch's statistics (:func:`global_stats`)."""
    return moe_.moe_aux(global_stats(stats), cfg)


def moe(
    x: torch.Tensor,  # (B, T_local, D) normed residual stream
    p: Mapping[str, Any],
    cfg: MoEConfig,
) -> tuple[torch.Tensor, MoEStats]:  # (B, T_local, D), this rank's stats
    """``nn.moe.moe`` under the current layout (exactly it without one): tensor parallel like an MLP,
    routed experts over ep (:func:`experts_forward`)."""
    layout = current()
    if layout is None:
        return moe_.moe(x, p, cfg)
    if layout.tp > 1 and "tp" not in layout.axes_of("mlp"):
        raise NotImplementedError(
            f"MoE under tp={layout.tp}: the experts' hidden width ('mlp') must be split over tp; "
            f"the rules give {layout.axes_of('mlp')}"
        )
    x = par.column_input(x)  # (B, T, D): every tp rank routes the same tokens
    y, stats = moe_.moe(x, _router_for_compute(p, cfg.n_experts, layout), cfg, experts_fn=experts_forward)
    return par.row_output(y), stats


def _router_for_compute(p: Mapping[str, Any], n_experts: int, layout: Layout) -> dict[str, Any]:
    """``p`` with the router (and balancing bias) of all ``E`` experts: every rank scores its tokens
    against all of them. Stored split over ep with the experts (rule ``experts``), they are all-gathered
    over ep here (FSDP-like: backward reduce-scatters, summing every ep rank's tokens' gradient; the bias
    steers selection only and gets none). The router is replicated over tp, but its cotangents come from
    tp-split experts (partial sums), so its gradient is summed over tp."""
    out = dict(p)
    for name in ("router", "router_bias"):
        w = p.get(name)
        if w is None or w.shape[0] == n_experts:
            continue
        group = layout.group("ep")
        if group is None or w.shape[0] * group.size() != n_experts:
            raise ValueError(
                f"MoE {name}: this rank holds {w.shape[0]} of its {n_experts} expert rows; expected all of them, "
                f"or {n_experts} / ep split over ep (rule ('experts', ('ep',)))"
            )
        out[name] = C.all_gather(w if name == "router" else w.detach(), group, dim=0)
    out["router"] = par.tp_shared(out["router"], "mlp")
    return out
