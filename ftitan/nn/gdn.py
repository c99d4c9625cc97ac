"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta
Rule") as pure functions: the gated delta rule in a chunked form for training and prefill and a
recurrent form for decode, the short causal depthwise convolution in front of it, and the gated
RMSNorm behind it.

Per head the state ``S`` (Dk, Dv) evolves over the tokens as

    S  <- exp(g_t) S                            (gated decay, g_t <= 0)
    u_t = beta_t (v_t - S^T k_t)                (delta rule: write the part S does not predict)
    S  <- S + k_t u_t^T
    o_t = S^T q_t

with ``q`` and ``k`` L2-normalized and ``q`` scaled by ``Dk ** -0.5``. The chunked form computes the
same thing ``chunk`` tokens at a time: inside a chunk the writes ``u`` solve a unit lower-triangular
system (the WY representation of the products of ``I - beta k k^T``), so a chunk costs a few matmuls
and one triangular solve, and only the state crosses chunk boundaries. :func:`chunked_delta_rule` and
:func:`recurrent_delta_rule` agree to float32 rounding (tests: 1..300 tokens, <= 1e-5).

Tokens with ``g = 0`` and ``beta = 0`` leave the state exactly as it was: padding rows of a batch
(``valid`` below) and the padding to a whole number of chunks use that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "causal_conv",
    "chunked_delta_rule",
    "delta_rule",
    "gated_rms_norm",
    "l2_normalize",
    "recurrent_delta_rule",
]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the form the reference kernels use)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _compute(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 inputs, float64 kept (finite-difference checks)."""
    return torch.promote_types(dtype, torch.float32)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
             ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """float32, heads first ``(B, H, T, ...)``; q and k L2-normalized, q scaled by ``Dk ** -0.5``; k heads
    repeated to the v heads (each k head serves ``Hv / Hk`` consecutive v heads)."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).to(_compute(x.dtype)).contiguous() for x in (q, k, v, g, beta))
    q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_delta_rule(
    q: torch.Tensor,  # (B, T, Hk, Dk)
    k: torch.Tensor,  # (B, T, Hk, Dk)
    v: torch.Tensor,  # (B, T, Hv, Dv)
    g: torch.Tensor,  # (B, T, Hv) log decay, <= 0
    beta: torch.Tensor,  # (B, T, Hv) write strength in [0, 1]
    state: torch.Tensor | None = None,  # (B, Hv, Dk, Dv) float32; None: zeros
    *,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows: the state restarts at each
) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T, Hv, Dv) in v's dtype, final state (B, Hv, Dk, Dv) float32
    """The gated delta rule one token at a time (decode; the reference of the chunked form)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    s = q.new_zeros(b, h, dk, v.shape[-1]) if state is None else state.to(q.dtype)
    out = []
    for i in range(t):
        if segments is not None and i:  # a new document starts from an empty state
            s = s * (segments[:, i] == segments[:, i - 1]).to(s.dtype)[:, None, None, None]
        s = s * g[:, :, i, None, None].exp()
        u = beta[:, :, i, None] * (v[:, :, i] - torch.einsum("bhkv,bhk->bhv", s, k[:, :, i]))
        s = s + k[:, :, i, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, i]))
    o = torch.stack(out, dim=2) if out else v.new_zeros(b, h, 0, v.shape[-1])
    return o.transpose(1, 2).to(dtype), s


def chunked_delta_rule(
    q: torch.Tensor,  # (B, T, Hk, Dk)
    k: torch.Tensor,  # (B, T, Hk, Dk)
    v: torch.Tensor,  # (B, T, Hv, Dv)
    g: torch.Tensor,  # (B, T, Hv) log decay, <= 0
    beta: torch.Tensor,  # (B, T, Hv)
    state: torch.Tensor | None = None,  # (B, Hv, Dk, Dv) float32; None: zeros
    *,
    chunk: int = 64,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows: the state restarts at each
    kernels: str = "torch",  # "triton"/"helion": ftitan.kernels.gdn's chunk kernel where it runs (CUDA)
) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T, Hv, Dv) in v's dtype, final state (B, Hv, Dk, Dv) float32
    """The gated delta rule ``chunk`` tokens at a time (training, prefill); see the module docstring.

    Within a chunk, with ``c`` the cumulative log decay from the chunk's start and ``S0`` the state
    entering it, the writes are ``u = U - W S0`` where ``(I + A) U = beta v``, ``(I + A) W = beta
    exp(c) k`` and ``A[i, j] = beta_i exp(c_i - c_j) k_i . k_j`` for ``j < i``; the outputs are
    ``exp(c) q S0 + (exp(c_i - c_j) q_i . k_j)_{j <= i} u`` and the state leaving it
    ``exp(c_last) S0 + sum_j exp(c_last - c_j) k_j u_j^T``. With ``segments`` every term that would
    cross a document boundary is masked out (pairs in different documents, reads and carries of ``S0``
    by tokens of a document that starts inside the chunk), which is the recurrence restarted from zeros
    at each document (``state`` belongs to the first document).
    """
    if kernels != "torch":  # imported here: ftitan.kernels.gdn imports this module for its reference
        from ftitan.kernels.gdn import chunk_delta_rule

        return chunk_delta_rule(q, k, v, g, beta, state, chunk=chunk, segments=segments)
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk  # padded tokens: g = beta = 0 and k = 0, so they change nothing
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    c = g.cumsum(-1)  # (B, H, N, C) log decay from the chunk's start through each token
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(c_i - c_j) for j <= i (<= 1), 0 above the diagonal (masked before exp: no overflow)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    enter, leave = c.exp(), (c[..., -1:] - c).exp()  # decay from the chunk's start, to its end
    if segments is not None:
        seg = torch.cat([segments, segments[:, -1:].expand(b, pad)], dim=1).reshape(b, 1, n, chunk)
        before = torch.cat([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], dim=2)  # the token before each chunk
        decay = decay * (seg[..., :, None] == seg[..., None, :])
        # the entering state is read only by its own document's tokens (the last token's factor also carries it
        # to the chunk's end or not); writes reach the chunk's end only from the last document's tokens
        enter = enter * (seg == before)
        leave = leave * (seg == seg[..., -1:])
    kb = k * beta[..., None]
    # A below the diagonal; the solve reads the strict lower triangle only (unit diagonal: I + A)
    system = (kb @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta[..., None], kb * enter[..., None]], dim=-1)
    uw = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :dv], uw[..., dv:]
    scores = (q @ k.transpose(-1, -2)) * decay  # (B, H, N, C, C)
    q_in = q * enter[..., None]  # reads of the entering state
    k_out = k * leave[..., None]  # writes carried to the chunk's end
    s = q.new_zeros(b, h, dk, dv) if state is None else state.to(q.dtype)
    out = []
    for i in range(n):  # only the state crosses chunks
        ui = u[:, :, i] - w[:, :, i] @ s
        out.append(q_in[:, :, i] @ s + scores[:, :, i] @ ui)
        s = s * enter[:, :, i, -1, None, None] + k_out[:, :, i].transpose(-1, -2) @ ui
    o = torch.stack(out, dim=2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return o.transpose(1, 2).to(dtype), s


def delta_rule(
    q: torch.Tensor,  # (B, T, Hk, Dk)
    k: torch.Tensor,
    v: torch.Tensor,  # (B, T, Hv, Dv)
    g: torch.Tensor,  # (B, T, Hv)
    beta: torch.Tensor,  # (B, T, Hv)
    state: torch.Tensor | None = None,  # (B, Hv, Dk, Dv)
    *,
    chunk: int = 64,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows
    kernels: str = "torch",  # the model's kernels choice, for the chunked form
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`recurrent_delta_rule` for one token (decode), :func:`chunked_delta_rule` otherwise."""
    if q.shape[1] == 1:
        return recurrent_delta_rule(q, k, v, g, beta, state)
    return chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk, segments=segments, kernels=kernels)


def causal_conv(
    x: torch.Tensor,  # (B, T, C)
    w: torch.Tensor,  # (C, K) depthwise taps, the last one on the current token
    state: torch.Tensor | None = None,  # (B, K - 1, C): the K - 1 inputs before x; None: zeros
    *,
    stop: torch.Tensor | None = None,  # (B,) int: the new state ends after token stop[b] - 1; default T
    segments: torch.Tensor | None = None,  # (B, T) int document ids: no tap reaches into another document
) -> tuple[torch.Tensor, torch.Tensor]:  # silu(conv) (B, T, C), new state (B, K - 1, C)
    """Causal depthwise convolution followed by SiLU: ``y_t = silu(sum_j w[:, j] x_{t - K + 1 + j})``.

    The returned state holds the ``K - 1`` inputs before position ``stop`` (the row's last real token
    + 1; right-padded prompts stop early), from ``state`` where the row has fewer tokens."""
    kernel = w.shape[-1]
    b, t, ch = x.shape
    past = x.new_zeros(b, kernel - 1, ch) if state is None else state.to(x.dtype)
    xp = torch.cat([past, x], dim=1)  # (B, K - 1 + T, C)
    w = w.to(x.dtype)
    if segments is None:
        y = sum(xp[:, j : j + t] * w[:, j] for j in range(kernel))
    else:  # the state (if any) belongs to the first document
        sp = torch.cat([segments[:, :1].expand(b, kernel - 1), segments], dim=1)
        y = sum(xp[:, j : j + t] * w[:, j] * (sp[:, j : j + t] == segments)[..., None].to(x.dtype)
                for j in range(kernel))  # fmt: skip
    if stop is None:
        new = xp[:, t:]
    else:
        index = stop.to(torch.long)[:, None] + torch.arange(kernel - 1, device=x.device)  # (B, K - 1)
        new = xp.gather(1, index[:, :, None].expand(b, kernel - 1, ch))
    return F.silu(y), new


def gated_rms_norm(
    x: torch.Tensor,  # (..., Dv)
    z: torch.Tensor,  # (..., Dv) gate
    w: torch.Tensor,  # (Dv,)
    eps: float,
) -> torch.Tensor:  # (..., Dv) in x's dtype
    """``w * rms_norm(x) * silu(z)``: the output norm of a Gated DeltaNet head (statistics in float32)."""
    f = _compute(x.dtype)
    xf = x.to(f)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((w.to(x.dtype) * normed).to(f) * F.silu(z.to(f))).to(x.dtype)
