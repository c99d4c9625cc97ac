"""Shared fixtures: small llama-shaped parameter trees and gradient streams."""

from __future__ import annotations

from typing import Any

import torch

from ftitan import tree


def llama_params(dtype: torch.dtype = torch.float32, *, seed: int = 0, experts: int = 3) -> dict[str, Any]:
    """A 2-layer llama-like tree (linear weights stored (out, in)); layer 1 has MoE experts."""
    g = torch.Generator().manual_seed(seed)
    V, D, H, F = 24, 16, 12, 20  # vocab, model dim, heads * head_dim, mlp hidden

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    def attn() -> dict[str, torch.Tensor]:
        return {"wq": t(H, D), "wk": t(H, D), "wv": t(H, D), "wo": t(D, H)}

    return {
        "embed": t(V, D),
        "layers": {
            "0": {
                "attn_norm": t(D),
                "attn": attn(),
                "mlp_norm": t(D),
                "mlp": {"w1": t(F, D), "w2": t(D, F), "w3": t(F, D)},
            },
            "1": {
                "attn_norm": t(D),
                "attn": attn(),
                "mlp_norm": t(D),
                "moe": {"router": t(experts, D), "w1": t(experts, F, D), "w2": t(experts, D, F), "bias": t(experts)},
            },
        },
        "norm": t(D),
        "head": t(V, D),
    }


def matrices_only(params: Any) -> dict[str, torch.Tensor]:
    """The ndim >= 2 leaves of ``params`` as a flat ``{path: leaf}`` dict."""
    ps, ls, _ = tree.flatten_with_paths(params)
    return {p: x for p, x in zip(ps, ls, strict=True) if x.ndim >= 2}


def grad_stream(params: Any, steps: int, *, seed: int = 1, scale: float = 1.0) -> list[Any]:
    """``steps`` random gradient trees shaped like ``params`` (fixed, param-independent)."""
    g = torch.Generator().manual_seed(seed)

    def one(x: torch.Tensor) -> torch.Tensor:
        return (scale * torch.randn(x.shape, generator=g, dtype=torch.float64)).to(x.dtype)

    return [tree.map(one, params) for _ in range(steps)]


def run(opt: Any, params: Any, grads: list[Any]) -> tuple[Any, Any]:
    """Applies ``opt`` over the gradient stream; returns ``(params, state)``."""
    from ftitan.optim import apply_updates

    state = opt.init(params)
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = apply_updates(params, updates)
    return params, state


def max_abs_diff(a: Any, b: Any) -> float:
    pairs = zip(tree.leaves(a), tree.leaves(b), strict=True)
    return max((x.double() - y.double()).abs().max().item() for x, y in pairs)
