"""DeepSeek-V4's mixture of experts: sqrt-softplus scores, hash-routed first layers, clamped SwiGLU.

- **scores**: ``sqrt(softplus(router(x)))`` per expert (float32).
- **selection**: learned layers take the ``top_k`` of ``scores + router_bias``
  (the aux-loss-free balancing bias of DeepSeek-V3, state moved by
  ``nn.moe.update_router_bias``); the first ``n_hash_layers`` layers look
  the experts up in a fixed token-id table instead (``hash_table`` (V, k):
  "Hash-MoE", DeepSeek-V4 sec. 2.1), so their selection does not learn.
- **weights**: the chosen scores, normalized to sum to 1, times
  ``routed_scale``.
- **experts**: SwiGLU with the gate clamped to ``<= limit`` and the up
  projection to ``[-limit, limit]`` before the product, as three grouped
  matmuls over the dispatched rows (``nn.moe.dispatch`` / ``combine``);
  plus one shared expert (the same clamped SwiGLU) every token passes
  through.

The hash table is stored as float32 expert ids (exact below 2**24) so it can
live in the params tree with the weights (differentiation and optimizers
handle floating leaves only); ``Model.frozen`` keeps it out of training.

Params (``hash_moe_params``)::

    {"router": (E, D),
     "router_bias": (E,) | "hash_table": (V, k),
     "experts": {"w1": (E, F, D), "w2": (E, D, F), "w3": (E, F, D)},
     "shared": {"w1": (F, D), "w2": (D, F), "w3": (F, D)}}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ftitan.kernels.grouped_mm import grouped_mm
from ftitan.nn import moe as moe_
from ftitan.nn.linear import linear
from ftitan.nn.param import Param, truncated_normal_init, zeros_init

__all__ = ["clamped_swiglu", "hash_moe", "hash_moe_params", "route"]


def hash_moe_params(
    dim: int, n_experts: int, expert_dim: int, *, top_k: int, vocab_size: int, hashed: bool, std: float,
    out_std: float,
) -> dict[str, Any]:  # fmt: skip
    """Spec tree of one layer; ``hashed``: a token-id table instead of the balancing bias."""
    e, f = n_experts, expert_dim
    ex_in, ex_out = truncated_normal_init(std), truncated_normal_init(out_std)
    specs: dict[str, Any] = {
        "router": Param(shape=(e, dim), axes=("experts", "embed"), init=truncated_normal_init(std)),
        "experts": {
            "w1": Param(shape=(e, f, dim), axes=("experts", "mlp", "embed"), init=ex_in),
            "w2": Param(shape=(e, dim, f), axes=("experts", "embed", "mlp"), init=ex_out),
            "w3": Param(shape=(e, f, dim), axes=("experts", "mlp", "embed"), init=ex_in),
        },
        "shared": {
            "w1": Param(shape=(f, dim), axes=("mlp", "embed"), init=ex_in),
            "w2": Param(shape=(dim, f), axes=("embed", "mlp"), init=ex_out),
            "w3": Param(shape=(f, dim), axes=("mlp", "embed"), init=ex_in),
        },
    }
    if hashed:  # expert ids drawn per token by ``deepseek_v4.init``; zeros here
        specs["hash_table"] = Param(shape=(vocab_size, top_k), axes=(None, None), init=zeros_init)
    else:
        specs["router_bias"] = Param(shape=(e,), axes=("experts",), init=zeros_init)
    return specs


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    gate = gate.clamp(max=limit)
    return F.silu(gate) * up.clamp(min=-limit, max=limit)


def route(
    x: torch.Tensor,  # (N, D)
    p: Mapping[str, torch.Tensor],
    tokens: torch.Tensor | None,  # (N,) int token ids (hash layers)
    *,
    top_k: int,
    routed_scale: float,
) -> moe_.Routing:
    """Expert choice and weights of each row (see the module docstring)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    scores = F.softplus(linear(x.to(acc), p["router"].to(acc))).sqrt()  # (N, E)
    if "hash_table" in p:
        if tokens is None:
            raise ValueError("hash_moe: a hash-routed layer needs the token ids (tokens=)")
        # round, not truncate: a table entry nudged below its id (a finite-difference step, a cast) keeps it
        experts = p["hash_table"][tokens].round().long()  # (N, k)
    else:
        experts = (scores + p["router_bias"].to(acc)).topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * routed_scale
    return moe_.Routing(weights.to(x.dtype), experts, scores / scores.sum(-1, keepdim=True))


def _experts(x: torch.Tensor, offs: torch.Tensor, ex: Mapping[str, torch.Tensor], limit: float) -> torch.Tensor:
    gate = grouped_mm(x, ex["w1"].transpose(-2, -1), offs)
    up = grouped_mm(x, ex["w3"].transpose(-2, -1), offs)
    return grouped_mm(clamped_swiglu(gate, up, limit), ex["w2"].transpose(-2, -1), offs)


def hash_moe(
    x: torch.Tensor,  # (B, T, D) normed
    p: Mapping[str, Any],
    tokens: torch.Tensor | None,  # (B, T) int token ids (hash layers)
    *,
    top_k: int,
    routed_scale: float,
    limit: float,
) -> tuple[torch.Tensor, moe_.MoEStats]:  # (B, T, D), this layer's routing statistics
    """The layer's output: routed experts plus the shared expert. The expert width may be a tensor-parallel
    slice (the output then being partial sums)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    routing = route(x2, p, None if tokens is None else tokens.reshape(-1), top_k=top_k, routed_scale=routed_scale)
    d = moe_.dispatch(x2, routing, p["router"].shape[0])
    out = moe_.combine(_experts(d.x, d.offs, p["experts"], limit), d, routing)
    sh = p["shared"]
    if "w13" in sh:  # gate and up stacked (ftitan.infer.fuse_projections)
        gate, up = linear(x2, sh["w13"]).chunk(2, dim=-1)
    else:
        gate, up = linear(x2, sh["w1"]), linear(x2, sh["w3"])
    out = out + linear(clamped_swiglu(gate, up, limit), sh["w2"])
    n = torch.tensor(float(x2.shape[0]), device=x.device)
    return out.view(shape), moe_.MoEStats(d.counts, routing.probs.sum(0), n)
