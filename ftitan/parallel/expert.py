"""Expert parallelism: routed experts split over ``ep``, token rows sent to them by all-to-all.

Two exchanges (:func:`exchange` picks one; ``"padded"`` is the default):

- ``"padded"`` (:func:`_moe_padded`): no host synchronization, so the step
  compiles with ``fullgraph=True``. Each rank sends *every* ep rank a buffer
  of a static size: its ``N`` token rows (each token at most once per
  destination, however many of its ``k`` experts live there) with, packed
  into extra columns of the same buffer, the token's ``k`` routing weights
  and the ids of its chosen experts local to that destination (bit-cast
  integers; ``0`` = not for this rank). That is exact and dropless with a
  bound that needs no agreement: a rank can never send a destination more
  than ``N`` distinct tokens. Per MoE layer there is exactly one token
  all-to-all per direction (dispatch, combine) and no count exchange at all.
  The receiver sorts the ``(token, choice)`` pairs addressed to its experts
  on the device (``ftitan.kernels.permute``: histogram, cumsum, stable
  argsort), runs its experts with the grouped GEMM on the sorted block
  (padding rows past the last expert's block are never read), combines each
  token's local choices weighted (pairs for other ranks add exactly zero),
  and sends each source its tokens' partial sums (one ``(N, D)`` block per
  rank); the source adds the ``ep`` partials. The price: ``(ep - 1) N``
  rows sent per direction instead of about ``(ep - 1) / ep * N k``, i.e.
  ``ep / k`` times the bytes of the ``"sync"`` exchange (equal for ``ep =
  k``, e.g. ep=2 with top-2; DeepSeek-V3's ep=8, top-8), and a sorted
  buffer of ``ep N min(k, E/ep)`` rows. A capacity below ``N`` would need
  the counts before the exchange, i.e. a host sync (or token dropping).
  Overlap: the dispatch all-to-all is issued, the shared expert (where the
  family has one inside the MoE layer) is computed, and only then is the
  exchange waited on (``_all_to_all_start`` / ``_wait``).
- ``"sync"`` (the previous exchange; :func:`experts_forward`): exact row
  counts, so minimal bytes, but a host sync per layer (below), so the step
  runs eagerly.

The MoE layer (``ftitan.nn.moe``) is route -> dispatch -> experts ->
combine; this module is its parallel seam, a no-op without a current layout
(single-process code runs exactly ``nn.moe``):

- :func:`experts_forward` (the ``experts_fn`` of ``nn.moe.moe``, ``"sync"``): with
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
  over ep with the experts) all-gathered over ep, experts through the
  :func:`exchange` in force (``"padded"``: :func:`_moe_padded`; ``"sync"``:
  ``nn.moe.moe`` with :func:`experts_forward`).
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

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ftitan.kernels import permute
from ftitan.nn import moe as moe_
from ftitan.nn.mlp import swiglu
from ftitan.nn.moe import MoEConfig, MoEStats
from ftitan.parallel import activations as par
from ftitan.parallel import collectives as C
from ftitan.parallel.layout import Layout, current

__all__ = ["EXCHANGES", "exchange", "experts_forward", "global_stats", "moe", "moe_aux", "regroup_by_expert"]

EXCHANGES = ("padded", "sync")  # the token exchanges of expert parallelism (see the module doc)
_exchange = "padded"


@contextlib.contextmanager
def exchange(kind: str) -> Iterator[None]:
    """Use the ``kind`` token exchange (one of :data:`EXCHANGES`) for MoE layers traced in the block
    (a compiled step reads it when it compiles, and is guarded on it)."""
    global _exchange
    if kind not in EXCHANGES:
        raise ValueError(f"parallel.expert.exchange({kind!r}): expected one of {EXCHANGES}")
    before, _exchange = _exchange, kind
    try:
        yield
    finally:
        _exchange = before


def current_exchange() -> str:
    """The token exchange MoE layers use now (:func:`exchange`)."""
    return _exchange


def experts_forward(
    x: torch.Tensor,  # (M, D) rows sorted by expert (all E experts)
    offs: torch.Tensor,  # (E,) int32 cumulative row ends
    w1: torch.Tensor,  # (E_local, F, D) gate; E_local = E / ep under expert parallelism
    w2: torch.Tensor,  # (E_local, D, F) down
    w3: torch.Tensor,  # (E_local, F, D) up
    *,
    float8: bool = False,  # the experts' GEMMs in float8 (nn.float8.grouped_mm)
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
        return moe_.experts_forward(x, offs, w1, w2, w3, float8=float8)
    _check_split(n_experts, n_local, group.size())
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "expert parallel (ep > 1) with the 'sync' exchange: the token all-to-all's split sizes depend on the "
            "routing (a host sync), so the step cannot be compiled with fullgraph=True; use the default 'padded' "
            "exchange (parallel.expert.exchange('padded')) or run the step eagerly (make_train_step(compile=False))"
        )
    return _experts_over_ep(x, offs, w1, w2, w3, group, float8)


def _check_split(n_experts: int, n_local: int, ep: int) -> None:
    if n_local * ep != n_experts:
        raise ValueError(
            f"expert parallel: this rank holds {n_local} of {n_experts} experts, but ep={ep} needs "
            f"{n_experts} / {ep}; split the experts over ep alone (rule ('experts', ('ep',))) or keep "
            f"them whole (rule ('experts', ()))"
        )


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
    x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, group: Any,
    float8: bool,
) -> torch.Tensor:  # (M, D)
    recv, send_splits, recv_splits = _exchange_counts(offs, group)
    xs = C.all_to_all(x, group, out_splits=recv_splits, in_splits=send_splits)  # (M_recv, D): by source, expert
    order, offs_local = regroup_by_expert(recv)
    y = _local_experts(xs[order], offs_local, w1, w2, w3, float8)
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
    x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, float8: bool = False
) -> torch.Tensor:  # (M, D)
    if x.shape[0]:
        return moe_.experts_forward(x, offs, w1, w2, w3, float8=float8)
    # no rows for this rank's experts: one zero row (output and weight gradients exactly 0) keeps x and the
    # weights in the graph, so their backward collectives run on this rank as on the others; the grouped
    # GEMM's backward also refuses 0 rows
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return moe_.experts_forward(padded, torch.ones_like(offs), w1, w2, w3, float8=float8)[:0]


_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # ids bit-cast into the rows' dtype


def _moe_padded(
    x: torch.Tensor,  # (B, T, D) | (N, D)
    p: Mapping[str, Any],  # the router of all E experts; this rank's E_local routed experts
    cfg: MoEConfig,
    group: Any,  # the ep mesh axis
) -> tuple[torch.Tensor, MoEStats]:  # same shape as x; this rank's stats
    """``nn.moe.moe`` over ep with the fixed-size exchange (module doc: ``"padded"``)."""
    shape, ep = x.shape, group.size()
    x2 = x.reshape(-1, shape[-1])  # (N, D)
    n, d = x2.shape
    routing = moe_.route(x2, p, cfg)
    sent = _all_to_all_start(_send_buffer(x2, routing, p["experts"]["w1"].shape[0], ep), group)
    shared = (swiglu(x2, **p["shared"], invariant=cfg.batch_invariant, kernels=cfg.kernels, float8=cfg.float8)
              if cfg.n_shared_experts else None)  # overlaps the exchange  # fmt: skip
    recv = _wait(sent, group)  # (ep N, D + 2k): every source's tokens, weights, local expert ids
    partial = _local_routed(recv, p["experts"], cfg)  # (ep N, D): each source token's local choices
    out = _wait(_all_to_all_start(partial, group), group).view(ep, n, d).sum(0)  # the ep ranks' partial sums
    if shared is not None:
        out = out + shared
    counts = torch.zeros(cfg.n_experts, dtype=torch.float32, device=x.device).index_add(
        0, routing.experts.reshape(-1), torch.ones(routing.experts.numel(), device=x.device)
    )
    return out.view(shape), MoEStats(counts, routing.probs.sum(0), torch.tensor(float(n), device=x.device))


def _send_buffer(x: torch.Tensor, routing: moe_.Routing, n_local: int, ep: int) -> torch.Tensor:
    """``(ep N, D + 2k)``: for each destination rank its block of every token row, the ``k`` routing
    weights and the ``k`` chosen experts' ids local to it plus one (``0``: on another rank), bit-cast."""
    n, k = routing.experts.shape
    owner = routing.experts // n_local  # (N, k) rank holding each choice
    ranks = torch.arange(ep, device=x.device).view(ep, 1, 1)
    ids = torch.where(owner == ranks, routing.experts % n_local + 1, 0)  # (ep, N, k)
    meta = ids.to(_INT_OF_SIZE[x.element_size()]).view(x.dtype)  # bits, not values: exact for any E
    rows = torch.cat([x, routing.weights.to(x.dtype)], dim=-1).expand(ep, n, -1)
    return torch.cat([rows, meta], dim=-1).reshape(ep * n, -1)


def _local_routed(recv: torch.Tensor, experts: Mapping[str, torch.Tensor], cfg: MoEConfig) -> torch.Tensor:
    """This rank's experts on the received rows: ``(ep N, D)``, each row the weighted sum of its token's
    choices among the local experts (zero where none is local)."""
    k, n_local = cfg.top_k, experts["w1"].shape[0]
    d = recv.shape[1] - 2 * k
    xr, wr = recv[:, :d], recv[:, d : d + k]
    ids = recv[:, d + k :].detach().contiguous().view(_INT_OF_SIZE[recv.element_size()]).long() - 1  # -1: not here
    perm = permute.sort_by_expert(ids, n_local)  # on device: histogram, cumsum, stable argsort
    n_rows = recv.shape[0] * min(k, n_local)  # static bound: a token has <= min(k, E_local) local choices
    kernel = cfg.kernels != "torch"
    rows = (permute.dispatch if kernel else permute.dispatch_reference)(xr, perm.pos, n_rows)
    # rows past offs[-1] (padding) belong to no expert: the grouped GEMM leaves them unset, combine never reads them
    y = moe_.experts_forward(rows, perm.offs, experts["w1"], experts["w2"], experts["w3"], float8=cfg.float8_experts)
    return (permute.combine if kernel else permute.combine_reference)(y, perm.pos, wr)


class _A2AStart(torch.autograd.Function):
    """Issue the equal-split all-to-all of ``x`` (``ep`` row blocks) and return its pending output; only
    :func:`_wait` makes it valid. Backward waits on the reverse exchange that ``_Wait``'s backward issued."""

    @staticmethod
    def forward(x: torch.Tensor, group: tuple[str, int]) -> torch.Tensor:  # type: ignore[override]
        return _issue(x, group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        with torch.no_grad():
            return torch.ops._c10d_functional.wait_tensor(g), None


class _Wait(torch.autograd.Function):
    """Wait for a pending exchange; backward issues the reverse exchange (same equal splits)."""

    @staticmethod
    def forward(x: torch.Tensor, group: tuple[str, int]) -> torch.Tensor:  # type: ignore[override]
        with torch.no_grad():
            return torch.ops._c10d_functional.wait_tensor(x).view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return _issue(g, ctx.group), None


def _issue(x: torch.Tensor, group: tuple[str, int]) -> torch.Tensor:
    name, ep = group
    splits = [x.shape[0] // ep] * ep
    C.record("all_to_all", (ep - 1) * splits[0] * (x[0].numel() * x.element_size() if x.shape[0] else 0))
    with torch.no_grad():
        return torch.ops._c10d_functional.all_to_all_single(x.contiguous(), splits, splits, name)


def _all_to_all_start(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Start sending row block ``j`` of ``x`` (``ep`` equal blocks) to ep rank ``j``; pass the result to
    :func:`_wait` after the work it should overlap (a functional collective: eager, autograd, compile)."""
    return _A2AStart.apply(x, _group_key(group))


def _wait(pending: torch.Tensor, group: Any) -> torch.Tensor:
    """The exchange :func:`_all_to_all_start` issued, complete (differentiable: see ``_Wait``)."""
    return _Wait.apply(pending, _group_key(group))


def _group_key(group: Any) -> tuple[str, int]:
    """``(process group name, size)`` of the ep mesh axis: what the functional ops take (plain constants
    inside the traced autograd.Functions)."""
    return group.get_group().group_name, group.size()


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
    p = _router_for_compute(p, cfg.n_experts, layout)
    group, n_local = layout.group("ep"), p["experts"]["w1"].shape[0]
    if _exchange == "padded" and group is not None and n_local != cfg.n_experts:
        _check_split(cfg.n_experts, n_local, group.size())
        y, stats = _moe_padded(x, p, cfg, group)
    else:
        y, stats = moe_.moe(x, p, cfg, experts_fn=experts_forward)
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
