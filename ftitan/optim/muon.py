"""Muon: momentum, then Newton-Schulz orthogonalization of each matrix update.

Muon: Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural
networks" (https://kellerjordan.github.io/posts/muon/).
Moonlight: Liu et al. 2025, "Muon is Scalable for LLM Training"
(arXiv:2502.16982): decoupled weight decay and the ``match_rms_adamw``
update scale that lets Muon reuse AdamW's learning rate and decay.

The arithmetic follows torch.optim.Muon: ``B = lerp(B, g, 1 - mu)``;
Nesterov input ``lerp(g, B, mu)``; ``O = NS(input)``;
``p <- p * (1 - lr * wd) - lr * scale(shape) * O``. Tensors of shape
(..., m, n) are batches of (m, n) matrices (stacked MoE experts (E, m, n)
are E matrices), and all matrices of one shape, across leaves, are
orthogonalized in a single batched Newton-Schulz call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple

import torch

from ftitan import tree
from ftitan.optim.adam import bias_correction
from ftitan.optim.learning_rate import scale_by_learning_rate
from ftitan.optim.newton_schulz import DEFAULT_COEFFICIENTS, newton_schulz
from ftitan.optim.schedules import Schedule
from ftitan.optim.transform import Params, Transform, Updates, accumulator_dtype, chain, state_device
from ftitan.optim.weight_decay import add_decayed_weights

__all__ = [
    "Blocks",
    "MuonState",
    "NesterovStyle",
    "ShapeScaling",
    "as_matrices",
    "block_of",
    "check_arguments",
    "from_matrices",
    "init_state",
    "momentum_step",
    "muon",
    "muon_chain",
    "muon_shape_scale",
    "newton_schulz_input",
    "orthogonalize",
    "scale_by_muon",
    "scaled_update",
]

ShapeScaling = Literal["original", "match_rms_adamw"]
NesterovStyle = Literal["torch", "optax"]
# glob of leaf paths -> (dim, block_size): those leaves are orthogonalized per block of block_size rows
# (dim -2) or columns (dim -1) of each matrix, e.g. one attention head's rows of a q projection
Blocks = Mapping[str, tuple[int, int]]


class MuonState(NamedTuple):
    momentum: Params  # momentum buffers, float32 (float64 for float64 params)
    count: torch.Tensor | None = None  # () int64 updates so far; only with nesterov_style="optax"


def newton_schulz_input(
    g: torch.Tensor,
    buf: torch.Tensor,
    momentum: float,
    nesterov: bool,
    style: NesterovStyle,
    count: torch.Tensor | None,
) -> torch.Tensor:
    """What Newton-Schulz orthogonalizes, from the gradient and the updated buffer.

    ``"torch"`` (torch.optim.Muon, Jordan's reference): ``lerp(g, B, mu)``
    with Nesterov, else ``B``, uncorrected. ``"optax"`` (optax.contrib.muon)
    bias-corrects like Adam: ``mu * B / (1 - mu^(t+1)) + (1 - mu) * g / (1 - mu^t)``
    with Nesterov, else ``B / (1 - mu^t)``. Without Nesterov the two differ
    by a scalar per matrix, which the normalization in Newton-Schulz removes
    (up to its ``eps``); with it, the mix of ``g`` and ``B`` differs early on.
    """
    if style == "torch":
        return torch.lerp(g, buf, momentum) if nesterov else buf
    assert count is not None
    bc = lambda t: bias_correction(momentum, t, buf.dtype)  # noqa: E731  (1 - mu^t, Adam's)
    if not nesterov:
        return buf / bc(count)
    return momentum * (buf / bc(count + 1)) + (1.0 - momentum) * (g / bc(count))


def momentum_step(
    gs: Sequence[torch.Tensor],
    bufs: Sequence[torch.Tensor],
    momentum: float,
    nesterov: bool,
    style: NesterovStyle,
    count: torch.Tensor | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Muon's elementwise half, leaf by leaf: ``(new buffers, Newton-Schulz inputs)`` from the gradients
    and the buffers (``B = lerp(B, g, 1 - mu)``, then :func:`newton_schulz_input`), in the buffers' dtype.
    Elementwise, so it runs as well on any part of a leaf (a rank's shard) as on the whole."""
    new_bufs, inputs = [], []
    for g, buf in zip(gs, bufs, strict=True):
        g32 = g.to(buf.dtype)
        buf = torch.lerp(buf, g32, 1.0 - momentum)
        new_bufs.append(buf)
        inputs.append(newton_schulz_input(g32, buf, momentum, nesterov, style, count))
    return new_bufs, inputs


def scaled_update(
    ortho: torch.Tensor,
    dtype: torch.dtype,
    shape: Sequence[int],
    block: tuple[int, int] | None,
    shape_scaling: ShapeScaling,
) -> torch.Tensor:
    """The update of one leaf from its orthogonalized matrices ``ortho`` (:func:`as_matrices` of it): cast
    to ``dtype`` (before scaling: scaling in bf16 would round a second time), times each matrix's
    :func:`muon_shape_scale`, back in ``shape``."""
    scale = muon_shape_scale(ortho.shape[-2], ortho.shape[-1], shape_scaling)
    return from_matrices(ortho.to(dtype) * scale, shape, block)


def muon_shape_scale(rows: int, cols: int, shape_scaling: ShapeScaling = "original") -> float:
    """Update scale of a (rows, cols) matrix: the factor torch.optim.Muon applies to its lr.

    ``"original"`` (Jordan 2024): ``sqrt(max(1, rows / cols))``;
    ``"match_rms_adamw"`` (Liu et al. 2025): ``0.2 * sqrt(max(rows, cols))``,
    giving the update the RMS (~0.2) of a typical AdamW update.
    """
    if shape_scaling == "original":
        return math.sqrt(max(1, rows / cols))
    if shape_scaling == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"shape_scaling={shape_scaling!r}: expected 'original' or 'match_rms_adamw'")


def block_of(path: str, blocks: Blocks | None) -> tuple[int, int] | None:
    """The ``(dim, block_size)`` of the first pattern of ``blocks`` that matches ``path``, or None."""
    return next((b for pattern, b in (blocks or {}).items() if tree.match(path, pattern)), None)


def _block_dim(shape: Sequence[int], block: tuple[int, int], path: str) -> int:
    dim, size = block
    d = dim % len(shape)
    if d < len(shape) - 2 or size < 1 or shape[d] % size:
        raise ValueError(f"{path}: blocks {block} must split one of the two matrix dims of shape {tuple(shape)} "
                         f"(dim -2 or -1) into whole blocks")  # fmt: skip
    return d


def as_matrices(x: torch.Tensor, block: tuple[int, int] | None = None, path: str = "<leaf>") -> torch.Tensor:
    """``x`` (..., m, n) as the batch of matrices Muon orthogonalizes: (-1, m, n), or with ``block = (dim,
    size)`` each matrix cut into blocks of ``size`` rows (dim -2: (-1, size, n)) or columns (dim -1: (-1, m,
    size)), block by block."""
    m, n = x.shape[-2], x.shape[-1]
    if block is None:
        return x.reshape(-1, m, n)
    size = block[1]
    if _block_dim(x.shape, block, path) == x.ndim - 2:
        return x.reshape(-1, size, n)
    return x.reshape(-1, m, n // size, size).permute(0, 2, 1, 3).reshape(-1, m, size)


def from_matrices(y: torch.Tensor, shape: Sequence[int], block: tuple[int, int] | None = None) -> torch.Tensor:
    """:func:`as_matrices`' inverse: the batch back in a tensor of ``shape``."""
    if block is None or _block_dim(shape, block, "<leaf>") == len(shape) - 2:
        return y.reshape(shape)
    m, n = shape[-2], shape[-1]
    return y.reshape(-1, n // block[1], m, block[1]).permute(0, 2, 1, 3).reshape(shape)


def orthogonalize(
    mats: Sequence[torch.Tensor],  # each (batch, m, n)
    *,
    steps: int = 5,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """Newton-Schulz of every matrix of ``mats``, those of one shape (across entries) in one batched call;
    each result in ``dtype`` and its entry's shape. Empty entries (no matrices) come back empty."""
    groups: dict[tuple[int, int, torch.dtype], list[int]] = {}
    for i, x in enumerate(mats):
        if x.shape[0]:
            groups.setdefault((x.shape[-2], x.shape[-1], x.dtype), []).append(i)
    out = [x.to(dtype) for x in mats]  # the empty ones stay so
    for idx in groups.values():
        stacked = [mats[i] for i in idx]
        ortho = newton_schulz(torch.cat(stacked) if len(stacked) > 1 else stacked[0], steps=steps,
                              coefficients=coefficients, eps=eps, dtype=dtype)  # fmt: skip
        pieces = torch.split(ortho, [s.shape[0] for s in stacked]) if len(stacked) > 1 else (ortho,)
        for i, piece in zip(idx, pieces, strict=True):
            out[i] = piece
    return out


def init_state(params: Params, nesterov_style: NesterovStyle, *, fix: str = "multi_transform / muon_with_adamw"
               ) -> MuonState:  # fmt: skip
    """Muon's state for ``params`` (whole leaves, or any rank's parts of them: the same ndim): zero momentum
    in the accumulator dtype, and a step count for ``nesterov_style="optax"``. A leaf with ndim < 2 is
    refused, naming ``fix`` (how to route vectors to AdamW)."""

    def zeros(path: str, p: torch.Tensor) -> torch.Tensor:
        if p.ndim < 2:
            raise ValueError(f"{path}: Muon needs matrices (ndim >= 2), got shape {tuple(p.shape)}; route vectors "
                             f"to AdamW with {fix}")  # fmt: skip
        return torch.zeros_like(p, dtype=accumulator_dtype(p))

    momentum_bufs = tree.map_with_path(zeros, params)
    if nesterov_style == "torch":
        return MuonState(momentum=momentum_bufs)
    return MuonState(momentum=momentum_bufs, count=torch.zeros((), dtype=torch.int64, device=state_device(params)))


def muon_chain(scale: Transform, lr: float | torch.Tensor | Schedule, weight_decay: float | torch.Tensor,
               elementwise: Callable[[Transform], Transform] = lambda t: t) -> Transform:  # fmt: skip
    """Muon from its scaling stage (a ``scale_by_muon``): ``chain(scale, add_decayed_weights,
    scale_by_learning_rate)``, so every Muon has the same state. ``elementwise`` wraps the two elementwise
    stages (e.g. ``parallel.on_shards``: run them on local shards)."""
    return chain(scale, elementwise(add_decayed_weights(weight_decay)), elementwise(scale_by_learning_rate(lr)))


def check_arguments(momentum: float, nesterov_style: str, shape_scaling: str) -> None:
    """Refuse bad Muon hyperparameters when the transform is built, not at its first step."""
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"momentum={momentum!r}: expected a float in [0, 1)")
    if nesterov_style not in ("torch", "optax"):
        raise ValueError(f"nesterov_style={nesterov_style!r}: expected 'torch' (torch.optim.Muon) or 'optax'")
    muon_shape_scale(1, 1, shape_scaling)  # type: ignore[arg-type]


def scale_by_muon(
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_dtype: torch.dtype = torch.bfloat16,
    shape_scaling: ShapeScaling = "original",
    *,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    eps: float = 1e-7,
    nesterov_style: NesterovStyle = "torch",
    blocks: Blocks | None = None,
) -> Transform:
    """Momentum then orthogonalization, scaled by :func:`muon_shape_scale`, as the update.

    Every leaf must have ndim >= 2 (route vectors elsewhere with
    :func:`ftitan.optim.multi_transform`, e.g. :func:`muon_with_adamw`).
    Same-shape matrices, from any leaves, share one batched Newton-Schulz
    call. Updates come back in the gradient dtype. ``eps`` clamps the
    Frobenius norm Newton-Schulz divides by. ``nesterov_style`` picks the
    momentum convention: ``"torch"`` (default; torch.optim.Muon's
    uncorrected ``lerp(g, B, mu)``) or ``"optax"`` (optax.contrib.muon's
    bias-corrected mix; the state then also counts steps), see
    ``newton_schulz_input``. ``blocks`` (glob -> ``(dim, size)``) orthogonalizes the matching leaves
    per block of ``size`` rows (dim -2) or columns (dim -1), each block scaled by its own shape: per-head
    Muon on attention projections (3-D expert stacks are per expert already).
    """
    check_arguments(momentum, nesterov_style, shape_scaling)

    def init(params: Params) -> MuonState:
        return init_state(params, nesterov_style)

    def update(grads: Updates, state: MuonState, params: Params | None = None) -> tuple[Updates, MuonState]:
        del params
        paths, gs, treedef = tree.flatten_with_paths(grads)
        for path, g in zip(paths, gs, strict=True):
            if g.ndim < 2:
                raise ValueError(f"{path}: Muon needs matrices (ndim >= 2), got shape {tuple(g.shape)}")
        count = None if state.count is None else state.count + 1
        new_bufs, inputs = momentum_step(gs, tree.leaves(state.momentum), momentum, nesterov, nesterov_style, count)

        # matrices (or blocks) of one shape, across leaves, orthogonalized in one call
        kinds = [block_of(path, blocks) for path in paths]
        mats = [as_matrices(x, b, path) for path, x, b in zip(paths, inputs, kinds, strict=True)]
        ortho = orthogonalize(mats, steps=ns_steps, coefficients=coefficients, eps=eps, dtype=ns_dtype)
        outputs = [scaled_update(o, g.dtype, g.shape, b, shape_scaling)
                   for o, g, b in zip(ortho, gs, kinds, strict=True)]  # fmt: skip
        new_state = MuonState(momentum=tree.unflatten(tree.structure(state.momentum), new_bufs), count=count)
        return tree.unflatten(treedef, outputs), new_state

    return Transform(init, update)


def muon(
    lr: float | torch.Tensor | Schedule,
    weight_decay: float | torch.Tensor = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_dtype: torch.dtype = torch.bfloat16,
    shape_scaling: ShapeScaling = "original",
    *,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    eps: float = 1e-7,
    nesterov_style: NesterovStyle = "torch",
    blocks: Blocks | None = None,
) -> Transform:
    """Muon with decoupled weight decay, torch.optim.Muon's semantics (Jordan 2024; Liu 2025).

    ``chain(scale_by_muon, add_decayed_weights, scale_by_learning_rate)``:
    ``p <- p - lr * (scale * O + wd * p) = p * (1 - lr * wd) - lr * scale * O``.
    For matrices only; see :func:`ftitan.optim.muon_with_adamw` for a model.
    """
    return muon_chain(
        scale_by_muon(
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            shape_scaling=shape_scaling,
            coefficients=coefficients,
            eps=eps,
            nesterov_style=nesterov_style,
            blocks=blocks,
        ),
        lr,
        weight_decay,
    )
