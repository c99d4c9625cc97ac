"""Activation seams: where model code meets the mesh. Each is a no-op without a current layout.

Model code stays single-device code on local tensors; these few calls say
what crosses ranks, by logical axis, and the rules decide whether anything
moves:

- :func:`shard_as` takes this rank's block of a replicated activation.
- :func:`column_input` / :func:`row_output`: the residual stream entering
  column-parallel linears (``wq``, ``w1``: output dim split over ``tp``) and
  the partial sums leaving row-parallel ones (``wo``, ``w2``). Without
  sequence parallelism they are Megatron's ``f`` (identity, gradient
  all-reduced) and ``g`` (all-reduce); with it (rule ``norm_seq`` includes
  ``tp``) an all-gather and a reduce-scatter along the sequence, so norms
  run on ``1/tp`` of the tokens.
- :func:`tp_shared` marks a weight replicated over ``tp`` that each rank
  applies to different data (QK-norm scales on its own heads; norm scales on
  its own tokens under sequence parallelism): its gradient is summed.
- :func:`embed`: vocab-parallel lookup when ``vocab`` is split.
- :func:`gather_vocab`: the full output head, for logits (the training loss is vocab-parallel,
  :mod:`ftitan.parallel.loss`).
- :func:`attention`: causal attention over the whole sequence when it is
  split over ``cp`` (load-balanced head-tail chunks, K/V all-gathered).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ftitan import nn
from ftitan.nn.attention import AttentionImpl
from ftitan.parallel import collectives as C
from ftitan.parallel.dims import DATA_AXES
from ftitan.parallel.layout import Layout, current

__all__ = [
    "attention",
    "column_input",
    "cp_positions",
    "embed",
    "gather_vocab",
    "local_positions",
    "residual_split",
    "row_output",
    "shard_as",
    "split_sequence",
    "tp_shared",
]


def cp_positions(seq_len: int, cp: int, rank: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions held by context-parallel rank ``rank`` of ``cp``: chunks ``rank`` and ``2 cp - 1 - rank``
    of ``2 cp`` equal chunks (head-tail load balancing: every rank gets the same causal work)."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallel: sequence length {seq_len} must be a multiple of 2 * cp = {2 * cp}")
    c = seq_len // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([head, tail]) if cp > 1 else torch.arange(seq_len, device=device)


def split_sequence(x: torch.Tensor, layout: Layout | None = None, *, dim: int = 1) -> torch.Tensor:
    """This rank's head-tail chunks of a sequence replicated over ``cp`` (see :func:`cp_positions`)."""
    layout = current() if layout is None else layout
    if layout is None or layout.sizes["cp"] == 1:
        return x
    cp, t = layout.sizes["cp"], x.shape[dim]
    order = torch.cat([cp_positions(t, cp, r, device=x.device) for r in range(cp)])
    return C.split(x.index_select(dim, order), layout.group("cp"), dim=dim)


def shard_as(x: torch.Tensor, axes: Sequence[str | None]) -> torch.Tensor:
    """This rank's block of ``x`` (replicated on every rank) for logical ``axes``; backward all-gathers.

    A dim whose mesh axes include ``cp`` is split into head-tail chunks.
    """
    layout = current()
    if layout is None:
        return x
    if len(axes) != x.dim():
        raise ValueError(f"shard_as: {len(axes)} logical axes {tuple(axes)} for a tensor of shape {tuple(x.shape)}")
    for dim, logical in enumerate(axes):
        if logical is None:
            continue
        for a in layout.axes_of(logical):
            x = split_sequence(x, layout, dim=dim) if a == "cp" else C.split(x, layout.group(a), dim=dim)
    return x


def column_input(x: torch.Tensor) -> torch.Tensor:  # (B, T_local, D) -> (B, T, D), T over cp only
    """The residual stream entering tp-split linears: all-gather over ``tp`` along the sequence
    under sequence parallelism, else identity with the gradient summed over ``tp``."""
    layout = current()
    if layout is None or layout.tp == 1:
        return x
    if layout.sequence_parallel:
        return C.all_gather(x, layout.group("tp"), dim=1)
    return C.grad_all_reduce(x, layout.group("tp"))


def row_output(y: torch.Tensor) -> torch.Tensor:  # (B, T, D) partial sums -> residual stream layout
    """Partial sums leaving tp-split linears: reduce-scatter over ``tp`` along the sequence under
    sequence parallelism, else all-reduce."""
    layout = current()
    if layout is None or layout.tp == 1:
        return y
    if layout.sequence_parallel:
        return C.reduce_scatter(y, layout.group("tp"), dim=1)
    return C.all_reduce(y, layout.group("tp"))


def residual_split(x: torch.Tensor) -> torch.Tensor:  # (B, T, D) replicated over tp -> residual stream layout
    """A tp-replicated activation put into the residual-stream layout (split along the sequence
    under sequence parallelism)."""
    layout = current()
    if layout is None or not layout.sequence_parallel:
        return x
    return C.split(x, layout.group("tp"), dim=1)


def tp_shared(w: torch.Tensor, logical: str) -> torch.Tensor:
    """A weight replicated over the tensor-parallel axes that the rules give ``logical`` (e.g. ``"heads"``
    for QK-norm scales, ``"norm_seq"`` for norm scales under sequence parallelism): each rank applies it to
    its own part of that axis, so its gradient is summed over them (data axes are summed elsewhere)."""
    layout = current()
    if layout is None:
        return w
    for a in layout.axes_of(logical):
        if a not in DATA_AXES:
            w = C.grad_all_reduce(w, layout.group(a))
    return w


def embed(tokens: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (B, T) int, (V_local, D) -> (B, T, D)
    """Embedding lookup; vocab-parallel when ``vocab`` is split (each rank looks up its rows, partial sums
    combined as a row-parallel output), and put in the residual-stream layout."""
    layout = current()
    if layout is None:
        return nn.embed(tokens, w)
    axes = layout.axes_of("vocab")
    if not axes:
        return residual_split(nn.embed(tokens, w))
    if axes != ("tp",):
        raise NotImplementedError(f"embed: vocab split over {axes}; only ('tp',) is supported")
    v_local = w.shape[0]
    start = layout.coords["tp"] * v_local
    local = tokens - start
    inside = (local >= 0) & (local < v_local)
    h = nn.embed(torch.where(inside, local, torch.zeros_like(local)), w) * inside.unsqueeze(-1).to(w.dtype)
    return row_output(h)


def gather_vocab(w: torch.Tensor) -> torch.Tensor:  # (V_local, D) -> (V, D)
    """The full output head from vocab-split shards (all-gather), for ``apply(..., logits=True)``; the
    training loss never needs it (``ftitan.train.losses.cross_entropy`` is vocab-parallel)."""
    layout = current()
    if layout is None:
        return w
    for a in reversed(layout.axes_of("vocab")):
        w = C.all_gather(w, layout.group(a), dim=0)
    return w


def attention(
    q: torch.Tensor,  # (B, T, H, Dh)  T: this rank's tokens
    k: torch.Tensor,  # (B, T, KV, Dh)
    v: torch.Tensor,  # (B, T, KV, Dv)
    *,
    impl: AttentionImpl = "sdpa",
    causal: bool = True,
    scale: float | None = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of this rank's tokens (packed rows)
    window: int | None = None,  # sliding window: each query sees its `window` most recent keys (nn.attention)
    kernels: str = "torch",  # the model config's (nn.attention's)
) -> torch.Tensor:  # (B, T, H, Dv)
    """``nn.attention``; under context parallelism each rank's queries attend over the all-gathered
    keys/values of every cp rank, masked by true positions (head-tail chunks, :func:`cp_positions`).
    With ``segments`` (and ``causal``) a query sees only the earlier keys of its own document
    (``nn.document_mask``; under cp the segments are all-gathered with the keys). ``window``: sliding-window
    attention (``nn.attention``'s ``window``), under cp on the true positions of queries and keys."""
    layout = current()
    if segments is not None and not causal:
        raise ValueError("attention: segments (packed documents) come with causal=True")
    if layout is None or layout.sizes["cp"] == 1:
        # segments as such: FlexAttention builds its block mask from them (the others materialize it)
        return nn.attention(q, k, v, impl=impl, causal=causal, scale=scale, window=window, segments=segments,
                            kernels=kernels)  # fmt: skip
    if window is not None and (not causal or not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"attention: window={window!r} under context parallelism needs causal=True and an int >= 1")
    cp, group = layout.sizes["cp"], layout.group("cp")
    t_local = q.shape[1]
    t = t_local * cp
    k, v = C.all_gather(k, group, dim=1), C.all_gather(v, group, dim=1)  # rank order: (B, T, KV, D)
    mask = None
    if causal:
        q_pos = cp_positions(t, cp, layout.coords["cp"], device=q.device)
        k_pos = torch.cat([cp_positions(t, cp, r, device=q.device) for r in range(cp)])
        mask = k_pos[None, :] <= q_pos[:, None]  # (T_local, T)
        if window is not None:  # the window's most recent keys, by true position
            mask = mask & (k_pos[None, :] > q_pos[:, None] - window)
        if segments is not None:  # the keys' document ids, in the same rank order as the keys
            k_seg = C.all_gather(segments, group, dim=1)  # (B, T)
            mask = mask[None] & (segments[:, :, None] == k_seg[:, None, :])  # (B, T_local, T)
    return nn.attention(q, k, v, impl=impl, causal=False, scale=scale, mask=mask, kernels=kernels)


def local_positions(t_local: int, *, device: torch.device | str | None = None) -> torch.Tensor:  # (T_local,)
    """Default positions of a rank's ``t_local`` tokens: ``arange``, or its head-tail chunks under cp."""
    layout = current()
    if layout is None or layout.sizes["cp"] == 1:
        return torch.arange(t_local, device=device)
    cp = layout.sizes["cp"]
    return cp_positions(t_local * cp, cp, layout.coords["cp"], device=device)
