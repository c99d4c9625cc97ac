"""Mixture-of-experts feed-forward: route -> dispatch -> experts -> combine.

One layer serves every MoE family (Qwen3-MoE, DeepSeek-V3, Kimi K2):

- **route** (:func:`route`): a linear router (computed in fp32) scores the
  experts, ``softmax`` (Qwen3-MoE; Switch Transformer, Fedus et al. 2021)
  or ``sigmoid`` (DeepSeek-V3). Optionally a balancing bias is added to the
  scores *for selection only* (DeepSeek-V3's auxiliary-loss-free balancing,
  Wang et al. 2024), experts are first narrowed to the best ``topk_groups``
  of ``n_groups`` groups (group score: sum of its two best scores), then the
  ``top_k`` experts are taken; their weights are the unbiased scores,
  renormalized to sum to 1 if ``norm_topk``, times ``routed_scale``.
- **dispatch** (:func:`dispatch`): the ``N * top_k`` (token, expert) pairs
  are sorted by expert (stable), giving one contiguous row block per expert
  and ``offs``, the cumulative row ends.
- **experts** (:func:`experts_forward`): every expert's SwiGLU on its block
  in three grouped matmuls (``ftitan.kernels.grouped_mm``) over the experts'
  stacked 3D weights: no Python loop over experts.
- **combine** (:func:`combine`): rows go back to token order, are weighted
  by their routing weights and summed over the ``top_k`` choices; shared
  experts (a plain SwiGLU every token passes through) are added.

These are separate pure functions so expert parallelism can put an
all-to-all between dispatch and experts and between experts and combine:
``moe(..., experts_fn=ftitan.parallel.expert.experts_forward)`` does (see
``ftitan.parallel.expert``; this module does not depend on a mesh).
:func:`moe` composes them and returns per-layer :class:`MoEStats`;
:func:`moe_aux` turns the stats of all layers into the model's aux dict
(load-balancing loss, tokens per expert). :func:`update_router_bias` is the
pure state update of the balancing bias, outside the gradient.

Params (``moe_params``)::

    {"router": (E, D),
     "router_bias": (E,),                               # score_bias only; state, not trained
     "experts": {"w1": (E, F, D), "w2": (E, D, F), "w3": (E, F, D)},
     "shared": {"w1": (S, D), "w2": (D, S), "w3": (S, D)}}   # S = n_shared_experts * F
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import attrs
import torch

from ftitan.kernels import permute
from ftitan.kernels.grouped_mm import grouped_mm
from ftitan.nn import float8 as float8_
from ftitan.nn import invariant as invariant_
from ftitan.nn.linear import linear
from ftitan.nn.mlp import swiglu, swiglu_params
from ftitan.nn.param import Param, truncated_normal_init, zeros_init

__all__ = [
    "SCORE_FUNCS",
    "Dispatch",
    "ExpertsFn",
    "MoEConfig",
    "MoEStats",
    "Routing",
    "combine",
    "dispatch",
    "experts_forward",
    "experts_forward_invariant",
    "experts_reference",
    "load_balancing_loss",
    "moe",
    "moe_aux",
    "moe_params",
    "route",
    "update_router_bias",
]

SCORE_FUNCS = ("softmax", "sigmoid")


def _positive_int(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"MoEConfig.{attr.name}={value!r}: must be a positive int")


@attrs.frozen(kw_only=True)
class MoEConfig:
    """One MoE feed-forward layer's routing and expert shapes."""

    n_experts: int = attrs.field(validator=_positive_int)  # E: routed experts
    top_k: int = attrs.field(validator=_positive_int)  # experts each token is sent to
    expert_dim: int = attrs.field(validator=_positive_int)  # F: SwiGLU hidden width of one routed expert
    n_shared_experts: int = 0  # shared experts every token passes through, fused into one SwiGLU of width n*F
    score_func: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3) over router logits
    norm_topk: bool = True  # renormalize the top_k weights to sum to 1
    n_groups: int = attrs.field(default=1, validator=_positive_int)  # expert groups for group-limited routing
    topk_groups: int = attrs.field(default=1, validator=_positive_int)  # groups a token may choose from
    routed_scale: float = 1.0  # multiplies the routed weights (DeepSeek-V3's routed_scaling_factor)
    score_bias: bool = False  # aux-loss-free balancing bias, added to scores for expert selection only
    aux_loss_coef: float = 0.0  # weight of the Switch load-balancing loss added to the training loss
    bias_update_rate: float = 0.001  # step of the balancing-bias update (DeepSeek-V3's gamma)
    batch_invariant: bool = False  # routing, experts and combination with batch-invariant reductions (nn.invariant)
    kernels: str = "torch"  # "triton": dispatch/combine by ftitan.kernels.permute (Triton on CUDA, its reference elsewhere)
    float8: str = ""  # the model's float8 recipe (nn.float8): the shared experts' projections, like a dense MLP's
    float8_experts: bool = False  # the routed experts' grouped GEMMs in float8 (nn.float8.grouped_mm, rowwise)

    def __attrs_post_init__(self) -> None:
        if self.top_k > self.n_experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEConfig.score_func={self.score_func!r}: expected one of {SCORE_FUNCS}")
        if self.n_experts % self.n_groups:
            raise ValueError(
                f"MoEConfig: n_experts={self.n_experts} is not divisible by n_groups={self.n_groups}; "
                f"groups must be equal-sized"
            )
        if self.topk_groups > self.n_groups:
            raise ValueError(f"MoEConfig: topk_groups={self.topk_groups} exceeds n_groups={self.n_groups}")
        if self.float8_experts and self.batch_invariant:  # the invariant experts have no float8 path
            raise ValueError("MoEConfig: float8_experts=True with batch_invariant=True: an expert's float8 scales "
                             "are taken over its rows, which depend on the batch; use float8_experts=False")
        per_group = self.n_experts // self.n_groups
        if self.n_groups > 1 and (per_group < 2 or self.top_k > self.topk_groups * per_group):
            raise ValueError(
                f"MoEConfig: group-limited routing needs >= 2 experts per group and top_k <= "
                f"topk_groups * experts_per_group; got {per_group} per group, top_k={self.top_k}, "
                f"topk_groups={self.topk_groups}"
            )
        if self.n_shared_experts < 0 or self.aux_loss_coef < 0 or self.bias_update_rate < 0:
            raise ValueError("MoEConfig: n_shared_experts, aux_loss_coef and bias_update_rate must be >= 0")


def moe_params(dim: int, cfg: MoEConfig, *, std: float = 0.02, out_std: float | None = None) -> dict[str, Any]:
    """Spec tree of one MoE layer (see the module docstring); ``out_std`` is for the down projections."""
    e, f = cfg.n_experts, cfg.expert_dim
    out_std = std if out_std is None else out_std
    specs: dict[str, Any] = {
        "router": Param(shape=(e, dim), axes=("experts", "embed"), init=truncated_normal_init(std)),
        "experts": {
            "w1": Param(shape=(e, f, dim), axes=("experts", "mlp", "embed"), init=truncated_normal_init(std)),
            "w2": Param(shape=(e, dim, f), axes=("experts", "embed", "mlp"), init=truncated_normal_init(out_std)),
            "w3": Param(shape=(e, f, dim), axes=("experts", "mlp", "embed"), init=truncated_normal_init(std)),
        },
    }
    if cfg.score_bias:
        specs["router_bias"] = Param(shape=(e,), axes=("experts",), init=zeros_init)
    if cfg.n_shared_experts:
        specs["shared"] = swiglu_params(dim, cfg.n_shared_experts * f, std=std, out_std=out_std)
    return specs


class Routing(NamedTuple):
    weights: torch.Tensor  # (N, k) x.dtype: weight of each chosen expert's output
    experts: torch.Tensor  # (N, k) int64: chosen expert ids
    probs: torch.Tensor  # (N, E) fp32: normalized router probabilities (for the balancing loss)


class Dispatch(NamedTuple):
    x: torch.Tensor  # (N*k, D): token rows sorted by expert
    offs: torch.Tensor  # (E,) int32: cumulative row ends per expert
    order: torch.Tensor | None  # (N*k,) int64: sorted row i holds flat (token, choice) pair order[i]
    counts: torch.Tensor  # (E,) fp32: rows per expert
    pos: torch.Tensor | None = None  # (N, k) int64: sorted row of each (token, choice) (kernels="triton")


class MoEStats(NamedTuple):
    counts: torch.Tensor  # (E,) fp32: (token, expert) assignments per expert
    prob_sum: torch.Tensor  # (E,) fp32: router probability mass per expert, summed over tokens
    n_tokens: torch.Tensor  # () fp32: tokens routed


def _group_limit(choice: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:  # (N, E) -> (N, E)
    n = choice.shape[0]
    grouped = choice.view(n, cfg.n_groups, cfg.n_experts // cfg.n_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
    # out of place (here and below): under vmap an in-place write into a fresh unbatched tensor has no rule
    keep = torch.zeros_like(group_scores).scatter(1, group_scores.topk(cfg.topk_groups, dim=-1).indices, 1.0)
    return grouped.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).view(n, cfg.n_experts)


def route(x: torch.Tensor, p: Mapping[str, torch.Tensor], cfg: MoEConfig) -> Routing:
    """Choose ``top_k`` experts per row of ``x`` (N, D) and their weights (see module docstring)."""
    # fp32 logits, scores and top-k under bf16 compute (the router weight is cast back up, so the matmul sums
    # exact products): bf16 scores keep 8 significant bits, so near-equal experts would tie and flip with
    # rounding, and the balancing bias's 1e-3 steps would vanish when added to them. fp64 stays fp64.
    acc = torch.promote_types(x.dtype, torch.float32)
    inv = cfg.batch_invariant
    logits = linear(x.to(acc), p["router"].to(acc), invariant=inv)  # (N, E)

    def total(w: torch.Tensor) -> torch.Tensor:  # (N, n) -> (N, 1)
        return invariant_.tree_sum(w, keepdim=True) if inv else w.sum(-1, keepdim=True)

    if cfg.score_func == "softmax":
        scores = probs = invariant_.softmax(logits, dim=-1) if inv else torch.softmax(logits, dim=-1)
    else:
        scores = invariant_.sigmoid(logits) if inv else torch.sigmoid(logits)
        probs = scores / total(scores)
    choice = scores + p["router_bias"].to(acc) if cfg.score_bias else scores
    if cfg.n_groups > 1:
        choice = _group_limit(choice, cfg)
    experts = choice.topk(cfg.top_k, dim=-1).indices  # (N, k)
    weights = scores.gather(1, experts)  # unbiased scores: the bias steers selection only
    if cfg.norm_topk:
        weights = weights / (total(weights) + 1e-20)
    if cfg.routed_scale != 1.0:
        weights = weights * cfg.routed_scale
    return Routing(weights.to(x.dtype), experts, probs)


def dispatch(x: torch.Tensor, routing: Routing, n_experts: int, *, kernels: str = "torch") -> Dispatch:
    """Copy each token once per chosen expert and sort the rows by expert (stable). ``kernels="triton"``:
    by ``ftitan.kernels.permute`` (the same rows; :func:`combine` then uses its combine)."""
    if kernels != "torch":
        perm = permute.sort_by_expert(routing.experts, n_experts)
        return Dispatch(permute.dispatch(x, perm.pos, perm.pos.numel()), perm.offs, None, perm.counts, perm.pos)
    flat = routing.experts.reshape(-1)  # (N*k,)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.float32, device=x.device).index_add(
        0, flat, torch.ones_like(flat, dtype=torch.float32)
    )
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return Dispatch(x[order // routing.experts.shape[1]], offs, order, counts)


def experts_forward(
    x: torch.Tensor,  # (M, D) rows sorted by expert
    offs: torch.Tensor,  # (E,) int32 cumulative row ends
    w1: torch.Tensor,  # (E, F, D) gate
    w2: torch.Tensor,  # (E, D, F) down
    w3: torch.Tensor,  # (E, F, D) up
    *,
    float8: bool = False,
) -> torch.Tensor:  # (M, D)
    """Each expert's SwiGLU on its own row block, as three grouped matmuls (``float8``: float8 grouped GEMMs,
    ``nn.float8.grouped_mm``)."""
    mm = float8_.grouped_mm if float8 else grouped_mm
    return _swiglu_experts(x, offs, w1, w2, w3, mm=mm, sigmoid=torch.sigmoid)


def _swiglu_experts(x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, *,
                    mm: Callable[..., torch.Tensor], sigmoid: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    gate = mm(x, w1.transpose(-2, -1), offs)
    up = mm(x, w3.transpose(-2, -1), offs)
    return mm(gate * sigmoid(gate) * up, w2.transpose(-2, -1), offs)


def experts_forward_invariant(
    x: torch.Tensor,  # (M, D) rows sorted by expert
    offs: torch.Tensor,  # (E,) int32 cumulative row ends
    w1: torch.Tensor,  # (E, F, D) gate
    w2: torch.Tensor,  # (E, D, F) down
    w3: torch.Tensor,  # (E, F, D) up
    *,
    float8: bool = False,  # refused with batch invariance by the model configs
) -> torch.Tensor:  # (M, D)
    """:func:`experts_forward` with each row's GEMMs independent of how many rows its expert got
    (``nn.invariant.grouped_mm``: fixed-shape row tiles): the batch-invariant mode's experts."""
    return _swiglu_experts(x, offs, w1, w2, w3, mm=invariant_.grouped_mm, sigmoid=invariant_.sigmoid)


class ExpertsFn(Protocol):
    """The experts seam of :func:`moe`: ``(x (M, D) rows sorted by expert, offs (E,) int32, w1, w2, w3, *,
    float8) -> (M, D)``; ``moe`` passes ``float8=cfg.float8_experts`` (the float8 grouped GEMMs)."""

    def __call__(self, x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                 *, float8: bool = False) -> torch.Tensor: ...  # fmt: skip


def experts_reference(x: torch.Tensor, routing: Routing, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor):
    """Naive per-expert loop over unsorted tokens (eager; the reference for tests): ``(N, D)``."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, choice = torch.where(routing.experts == e)
        if token.numel():
            y = swiglu(x[token], w1[e], w2[e], w3[e])
            out = out.index_add(0, token, y * routing.weights[token, choice, None])
    return out


def combine(y: torch.Tensor, d: Dispatch, routing: Routing, *, invariant: bool = False) -> torch.Tensor:
    """Back to token order, weight by the routing weights, sum over the ``top_k`` choices: (N*k, D) -> (N, D).
    ``invariant``: the sum as a fixed-order tree (``nn.invariant.tree_sum``)."""
    if d.pos is not None and not invariant:  # kernels="triton": one pass, fp32 accumulation
        return permute.combine(y, d.pos, routing.weights)
    if d.pos is not None:
        d = d._replace(order=torch.argsort(d.pos.reshape(-1)))
    n, k = routing.experts.shape
    inverse = torch.empty_like(d.order).scatter(0, d.order, torch.arange(d.order.numel(), device=d.order.device))
    per_choice = y[inverse].view(n, k, -1)  # gather, not scatter-add: deterministic on every backend
    weighted = per_choice * routing.weights.unsqueeze(-1)
    return invariant_.tree_sum(weighted, dim=1) if invariant else weighted.sum(1)


def moe(
    x: torch.Tensor,  # (B, T, D) | (N, D)
    p: Mapping[str, Any],
    cfg: MoEConfig,
    *,
    experts_fn: ExpertsFn | None = None,
) -> tuple[torch.Tensor, MoEStats]:  # same shape as x; stats
    """The MoE feed-forward of ``x``, and this layer's routing statistics.

    ``experts_fn`` computes the experts on the dispatched rows (signature of
    :func:`experts_forward`, the default; :func:`experts_forward_invariant` when
    ``cfg.batch_invariant``); ``ftitan.parallel.expert.experts_forward`` puts the
    expert-parallel all-to-alls around it.
    """
    inv = cfg.batch_invariant
    if experts_fn is None:
        experts_fn = experts_forward_invariant if inv else experts_forward
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    routing = route(x2, p, cfg)
    d = dispatch(x2, routing, cfg.n_experts, kernels=cfg.kernels)
    ex = p["experts"]
    y = experts_fn(d.x, d.offs, ex["w1"], ex["w2"], ex["w3"], float8=cfg.float8_experts)
    out = combine(y, d, routing, invariant=inv)
    if cfg.n_shared_experts:
        out = out + swiglu(x2, **p["shared"], invariant=inv, kernels=cfg.kernels, float8=cfg.float8)
    n = torch.tensor(float(x2.shape[0]), device=x.device)
    return out.view(shape), MoEStats(d.counts, routing.probs.sum(0), n)


def load_balancing_loss(stats: Sequence[MoEStats]) -> torch.Tensor:
    """Switch Transformer's balancing loss over all MoE layers: ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of rows (tokens x layers) routed to expert ``e``
    (counting every top-k choice, so ``sum_e f_e = k``) and ``P_e`` the mean
    router probability of ``e``, both pooled over the layers first, as
    ``transformers``' ``load_balancing_loss_func`` does. Minimal (= k) when
    routing is uniform.
    """
    counts = torch.stack([s.counts for s in stats]).sum(0)
    probs = torch.stack([s.prob_sum for s in stats]).sum(0)
    rows = torch.stack([s.n_tokens for s in stats]).sum()
    return counts.numel() * torch.sum((counts / rows) * (probs / rows))


def moe_aux(stats: Sequence[MoEStats], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """A model's aux dict from its MoE layers' stats (see ``ftitan.models.base.ApplyAuxFn``).

    - ``"loss"``: ``aux_loss_coef * moe.aux_loss`` (added to the training loss)
    - ``"moe.aux_loss"``: :func:`load_balancing_loss` (a metric when the coef is 0)
    - ``"moe.tokens_per_expert"``: ``(L_moe, E)`` assignments per layer and expert
    - ``"moe.max_load"``: the most loaded expert's count over the mean count,
      worst layer (1.0 is perfectly balanced; ``E / k`` is full collapse)
    """
    tokens = torch.stack([s.counts for s in stats])  # (L, E)
    lb = load_balancing_loss(stats)
    max_load = (tokens.amax(-1) / tokens.mean(-1).clamp(min=1e-9)).amax()
    return {"loss": cfg.aux_loss_coef * lb, "moe.aux_loss": lb, "moe.tokens_per_expert": tokens, "moe.max_load": max_load}


def update_router_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2): ``bias + rate * sign(mean_load - load)``.

    Overloaded experts become less likely to be chosen, underloaded ones more;
    the bias only affects selection, never the weights, so it needs no gradient.
    """
    load = tokens_per_expert.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)
