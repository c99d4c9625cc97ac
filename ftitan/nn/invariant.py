"""Batch-invariant ops: a row's result does not depend on the other rows, the padding, or how many keys follow.

The same token gives the same bits in a training forward over padded rows, in a
batched prefill and in a one-token decode step against a KV cache, whatever the
batch size (He & Thinking Machines 2025, "Defeating Nondeterminism in LLM
Inference"). Float addition is not associative, so every reduction here has an
order fixed by the data of one row alone:

- **sums** (:func:`tree_sum`): adjacent pairs, then pairs of pairs, ... from
  index 0, zero-padded at the end. Appending zeros never changes a value
  (``x + 0 == x``), so a row reduced over ``n`` or over ``n + pad`` entries,
  masked ones contributing exact zeros, gives the same bits.
- **matmuls** (:func:`linear`, :func:`grouped_mm`): batched GEMMs over row
  tiles (``torch.bmm``, rows zero-padded), at least two tiles of a multiple of
  ``TILE`` rows. A BLAS picks its kernel, blocking and K-split from the shape
  and the threads, so a plain ``mm`` over ``M`` rows sums each row in an order
  that depends on ``M`` (this CPU: ``x[:m] @ w.T`` differs from ``(x @ w.T)[:m]``
  for small ``m``, and a threaded GEMM with ``K >= 1024`` splits the sum over
  threads); each tile of a batched GEMM runs on one thread, in one order for
  every row, whatever the tile's rows (checked by ``tests/nn/test_invariant.py``
  on the machine that runs it).
- **attention** (:func:`attention`): ``q k^T`` in one batched GEMM (its sums
  over the head dim have one order whatever the query and key counts, multiples
  of ``TILE`` and ``KEY_BLOCK``), ``p v`` per ``KEY_BLOCK`` keys aligned from key
  0; the softmax max is exact in any order and its sum and the blocks' partial
  ``p v`` are :func:`tree_sum`'d. A query over ``T`` keys (prefill, training) and over
  ``S >= T`` cache slots (decode, the rest masked) gives the same bits, provided
  the row's first key is at index 0 (``ftitan.infer.KVCache`` rotates
  left-padded rows so).
- **softmax / log-softmax / RMSNorm**: :func:`tree_sum` with an exact max.
- **elementwise**: an element must not depend on where it sits in the tensor either,
  nor on whether inductor compiled the op. ATen's CPU loops compute full vectors with
  one formula and the tail (the last ``numel % 16`` elements, or of each thread's
  share) with a scalar one: ``torch.sigmoid`` / ``F.silu`` differ there by an ulp;
  ``torch.exp`` / ``torch.log`` are MKL's in eager and inductor's own (Sleef, scalar
  tails) compiled. :func:`exp`, :func:`log` and :func:`sigmoid` are written in
  ``+ - * /``, ``floor`` and bit casts, which every path rounds the same (IEEE, and
  inductor compiles with ``-ffp-contract=off``); so are RoPE's :func:`cos_sin`.
  ``rsqrt``, ``sqrt`` and the basic ops are correctly rounded everywhere.

Forward values are invariant, and the same eager and compiled by inductor (so a
compiled train step's log-probs equal an eager or compiled generator's); gradients
are computed the ordinary way (only the forward is compared between trainer and
generator). Values agree with the default ops to float32 rounding. The mode is
chosen per model by ``attn_impl="batch_invariant"`` (:func:`enabled`;
``ftitan.config.batch_invariant``); ``ftitan.infer.generate`` and
``ftitan.vllm.engine`` (``InvariantPagedAttention``) run it too. Checked on CPU
(fp32); on GPU the fixed tile shapes carry over, but the elementwise argument
(vector body vs scalar tail) is a CPU one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ftitan.kernels.autodiff import plain_reverse_mode

__all__ = [
    "IMPL",
    "KEY_BLOCK",
    "MAX_TILE",
    "TILE",
    "attention",
    "cos_sin",
    "enabled",
    "exp",
    "grouped_mm",
    "linear",
    "log",
    "log_softmax",
    "rms_norm",
    "sigmoid",
    "softmax",
    "tree_sum",
]

IMPL = "batch_invariant"  # the attn_impl that turns the mode on
TILE = 16  # rows of every GEMM tile
KEY_BLOCK = 16  # keys per attention block


def enabled(cfg: Any) -> bool:
    """Whether a model config asks for the batch-invariant mode (``attn_impl == "batch_invariant"``; a LoRA
    config answers for its base)."""
    while cfg is not None and not hasattr(cfg, "attn_impl") and hasattr(cfg, "base"):
        cfg = cfg.base
    return getattr(cfg, "attn_impl", None) == IMPL


def _needs_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def _with_grad_of(value: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """``value`` (computed without autograd), carrying ``plain``'s derivative: ``value + (plain - plain)``,
    whose second term is an exact zero where ``plain`` is finite (and is made zero elsewhere). The
    backward is then ``plain``'s few ops rather than the derivative of the fixed-order formula's many,
    and it works under every transform (grad, vjp, jvp, vmap)."""
    zero = plain - plain.detach()
    return value + torch.where(torch.isfinite(plain.detach()), zero, torch.zeros_like(zero))


def _tree_sum_value(x: torch.Tensor) -> torch.Tensor:  # over the last dim
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = F.pad(x, (0, 1))
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0] if x.shape[-1] == 1 else x.sum(-1)  # length 0: zeros


def tree_sum(x: torch.Tensor, dim: int = -1, *, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` as a pairwise tree from index 0 (``((x0 + x1) + (x2 + x3)) + ...``), zero-padded.

    Elementwise adds only, so each output depends on its own inputs alone; trailing zeros do not
    change the result, so the length may grow with padding or masked entries. The gradient is a
    sum's (the incoming gradient broadcast)."""
    dim = dim % x.dim()
    x = x.movedim(dim, -1)
    if _needs_grad(x):
        out = _with_grad_of(_tree_sum_value(x.detach()), x.sum(-1))
    else:
        out = _tree_sum_value(x)
    return out.unsqueeze(dim) if keepdim else out


# Cephes' expf / logf (Moshier 1992): range reduction and a polynomial in + - * / only, which round the same
# in ATen's eager kernels (vector body or scalar tail) and in inductor's generated C++ (no FMA contraction)
_LOG2E, _LN2_HI, _LN2_LO = 1.44269504088896341, 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_LOG_POLY = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
             -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)  # fmt: skip


def _horner(coefs: tuple[float, ...], x: torch.Tensor) -> torch.Tensor:
    p = torch.full_like(x, coefs[0])
    for c in coefs[1:]:
        p = p * x + c
    return p


def _exp_value(x: torch.Tensor) -> torch.Tensor:  # float32
    xc = x.clamp(-87.0, 88.0)
    n = torch.floor(xc * _LOG2E + 0.5)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    y = (_horner(_EXP_POLY, r) * (r * r) + r) + 1.0
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2 ** n, exact
    return torch.where(x < -87.0, torch.zeros_like(y), y * two_n)


def exp(x: torch.Tensor) -> torch.Tensor:
    """``exp`` (float32: Cephes' ``expf``, within 2 ulp; 0 below -87, so ``exp(-inf) == 0``) computed the same
    by eager ATen, wherever the element sits, and by inductor. The gradient is ``torch.exp``'s.

    ``torch.exp`` is MKL's or Sleef's in eager and inductor's own vectorized one compiled: 1 ulp apart."""
    if x.dtype != torch.float32:
        return torch.exp(x)
    if _needs_grad(x):
        return _with_grad_of(_exp_value(x.detach()), torch.exp(x))
    return _exp_value(x)


def _log_value(x: torch.Tensor) -> torch.Tensor:  # float32, finite x > 0 (normal)
    bits = x.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 126
    m = ((bits & 0x007FFFFF) | 0x3F000000).view(torch.float32)  # x = m * 2 ** e, m in [0.5, 1)
    small = m < 0.707106781186547524
    e = torch.where(small, e - 1, e).to(torch.float32)
    f = torch.where(small, (m + m) - 1.0, m - 1.0)
    z = f * f
    y = _horner(_LOG_POLY, f) * f * z
    y = (y + e * _LN2_LO) + (z * -0.5)
    return (f + y) + e * _LN2_HI


def log(x: torch.Tensor) -> torch.Tensor:
    """``log`` of finite positive float32 ``x`` (Cephes' ``logf``; see :func:`exp` for why not ``torch.log``);
    the gradient is ``torch.log``'s."""
    if x.dtype != torch.float32:
        return torch.log(x)
    if _needs_grad(x):
        return _with_grad_of(_log_value(x.detach()), torch.log(x))
    return _log_value(x)


# Cephes' sinf / cosf polynomials on |z| <= pi/4; the reduction by pi/4 in float64 (three-part Cody-Waite
# constants, each product exact for angles below 2**29), so long-context RoPE angles keep float32 accuracy
_FOPI = 1.27323954473516268615  # 4 / pi
_PIO4 = (7.85398125648498535156e-1, 3.77489470793079817668e-8, 2.69515142907905952645e-15)
_SIN_POLY = (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1)
_COS_POLY = (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2)


def cos_sin(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos(x), sin(x))`` of float32 angles (RoPE's) in ``+ - * /``, ``floor`` and integer ops: the same bits
    in eager and under inductor (``torch.cos`` / ``torch.sin`` differ there in about 1 element of 4)."""
    ax = x.to(torch.float64).abs()
    j = torch.floor(ax * _FOPI).to(torch.int64)
    j = j + (j & 1)  # the even octant boundary nearest below-or-at: |z| <= pi / 4
    y = j.to(torch.float64)
    z = (((ax - y * _PIO4[0]) - y * _PIO4[1]) - y * _PIO4[2]).to(torch.float32)
    zz = z * z
    sp = _horner(_SIN_POLY, zz) * zz * z + z  # sin(z)
    cp = (_horner(_COS_POLY, zz) * zz * zz - 0.5 * zz) + 1.0  # cos(z)
    quadrant = (j >> 1) & 3  # x = z + quadrant * pi / 2 (mod 2 pi)
    swap = (quadrant & 1) == 1
    sin = torch.where(swap, cp, sp) * torch.where(quadrant >= 2, -1.0, 1.0) * torch.where(x < 0, -1.0, 1.0)
    cos = torch.where(swap, sp, cp) * torch.where((quadrant == 1) | (quadrant == 2), -1.0, 1.0)
    return cos, sin


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` with :func:`exp` (``torch.sigmoid``'s scalar tail and vector body differ by an
    ulp on CPU: an element's value would depend on its place in the tensor)."""
    return (1.0 / (1.0 + exp(-x.float()))).to(x.dtype)


def _row_max(x: torch.Tensor) -> torch.Tensor:  # (..., n) -> (..., 1), exact in any order; 0 for all -inf rows
    m = x.detach().amax(-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``softmax`` over ``dim`` with an invariant sum (float32 math for low precision inputs)."""
    x = x.movedim(dim, -1)
    e = exp(x - _row_max(x))
    return (e / tree_sum(e, keepdim=True)).movedim(-1, dim)


def _log_softmax_value(x: torch.Tensor) -> torch.Tensor:  # over the last dim
    shifted = x - _row_max(x)
    return shifted - log(tree_sum(exp(shifted), keepdim=True))


class _InvariantLogSoftmax(torch.autograd.Function):
    """The invariant value; the backward is log-softmax's usual ``g - softmax * sum(g)`` (in any order)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _log_softmax_value(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return g - torch.exp(out) * g.sum(-1, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log_softmax`` over ``dim``: ``x - max - log(tree_sum(exp(x - max)))``."""
    x = x.movedim(dim, -1)
    if _needs_grad(x) and plain_reverse_mode():
        return _InvariantLogSoftmax.apply(x).movedim(-1, dim)
    return _log_softmax_value(x).movedim(-1, dim)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``ftitan.nn.rms_norm`` with the mean of squares as a :func:`tree_sum`."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = xf * torch.rsqrt(tree_sum(xf * xf, keepdim=True) / xf.shape[-1] + eps)
    return w.to(x.dtype) * normed.to(x.dtype)


# ---------------------------------------------------------------------------------------------- matmuls


MAX_TILE = 256  # rows of the largest GEMM tile (a multiple of TILE)


def _tiles(x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (tiles, rows, K), rows zero-padded, >= 2 tiles
    """``x``'s rows in at least two tiles of the same multiple of ``TILE`` rows, at most ``MAX_TILE``.

    The BLAS runs each tile of a batched GEMM on one thread with one kernel, whose sum over ``K`` has an
    order that depends on neither the tile's row count (a multiple of ``TILE``) nor the other tiles
    (checked on the running machine by ``tests/nn/test_invariant.py``). A batch of one tile is threaded
    inside the GEMM instead, which splits ``K`` across threads for ``K >= 1024`` (this CPU: a different
    order, and not even the same bits run to run), so one tile's rows get a zero tile beside them.

    The claim depends on the operand layout: with the weight passed transposed (``w.t()``, as here), tiles of
    16 to 256 rows sum alike for ``K`` up to 4096; with a contiguous ``(K, N)`` weight, two tiles of 192 or
    more rows with ``K >= 1024`` sum in another order than tiles of 16 (measured on this CPU), which is why
    :func:`grouped_mm` keeps ``TILE``-row tiles. Fixed 16-row tiles cost the trainer 1.64x instead of 1.23x
    (``ftitan bench rl``)."""
    units = -(-x.shape[0] // TILE)
    per = max(1, min(MAX_TILE // TILE, units // 2))  # TILE-row units per tile: big tiles for speed, >= 2 of them
    n = max(2, -(-units // per))
    pad = n * per * TILE - x.shape[0]
    return (F.pad(x, (0, 0, 0, pad)) if pad else x).view(n, per * TILE, x.shape[1])


def _tiled_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (M, K), (N, K) -> (M, N) = x @ w.T
    t = _tiles(x)
    out = torch.bmm(t, w.t().expand(t.shape[0], *w.t().shape))
    return out.view(-1, w.shape[0])[: x.shape[0]]


class _TiledLinear(torch.autograd.Function):
    """``x @ w.T`` by row tiles; backward is the ordinary two matmuls (no ``(tiles, K, N)`` weight gradient)."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _tiled_mm(x, w)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


def linear(
    x: torch.Tensor,  # (..., in)
    w: torch.Tensor,  # (out, in)
    b: torch.Tensor | None = None,  # (out,)
) -> torch.Tensor:  # (..., out)
    """``x @ w.T + b``, each row computed in one tile of a batched GEMM (see :func:`_tiles`)."""
    if not isinstance(w, torch.Tensor):
        raise ValueError(
            f"batch-invariant linear: the weight is a {type(w).__name__} (a runtime's prepacked GEMM), whose "
            f"summation order ftitan does not control; pass the plain (out, in) tensor"
        )
    x2 = x.reshape(-1, x.shape[-1])
    if x2.requires_grad or w.requires_grad:
        y = _TiledLinear.apply(x2, w) if plain_reverse_mode() else _tiled_mm(x2, w)
    else:
        y = _tiled_mm(x2, w)
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b


def grouped_mm(
    x: torch.Tensor,  # (M, K) rows sorted by group
    w: torch.Tensor,  # (G, K, N)
    offs: torch.Tensor,  # (G,) int32 cumulative row ends
) -> torch.Tensor:  # (M, N)
    """``ftitan.kernels.grouped_mm`` by tiles: each group's rows padded to whole ``TILE``-row tiles, every
    tile one ``(TILE, K) @ (K, N)`` GEMM with its group's weight. Static shapes: ``M // TILE + G`` tiles
    cover any routing. The weight is gathered per tile (``(tiles, K, N)``): meant for small models and
    for exactness, not speed."""
    m, g = x.shape[0], w.shape[0]
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tile_end = torch.cumsum((counts + TILE - 1) // TILE, 0)  # (G,) in tiles
    rows = torch.arange(m, device=x.device)
    group = (rows[:, None] >= ends[None, :]).sum(-1).clamp(max=g - 1)  # (M,)
    dest = (tile_end - (counts + TILE - 1) // TILE)[group] * TILE + rows - (ends - counts)[group]
    n_tiles = max(2, (m + g * (TILE - 1)) // TILE)  # >= 2: a one-tile batched GEMM is threaded inside (see _tiles)
    xp = x.new_zeros(n_tiles * TILE, x.shape[1]).index_copy(0, dest, x)
    tile_group = (torch.arange(n_tiles, device=x.device)[:, None] >= tile_end[None, :]).sum(-1).clamp(max=g - 1)
    out = torch.bmm(xp.view(n_tiles, TILE, -1), w[tile_group])
    return out.reshape(-1, w.shape[2])[dest]


# ---------------------------------------------------------------------------------------------- attention


def _two_or_more(x: torch.Tensor) -> torch.Tensor:  # a batched GEMM's operand, >= 2 entries (see _tiles)
    return torch.cat([x, torch.zeros_like(x)]) if x.shape[0] == 1 else x


def _blocked_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(N, Mp, D) @ (N, Sp, D)^T -> (N, Mp, Sp): one batched GEMM, whose tiles' sums over ``D`` have one order
    for every (query, key) whatever ``Mp`` and ``Sp`` (multiples of ``TILE``, ``KEY_BLOCK``; see :func:`_tiles`)."""
    n = q.shape[0]
    return torch.bmm(_two_or_more(q), _two_or_more(k).transpose(1, 2))[:n]


def _blocked_pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(N, Mp, Sp) @ (N, Sp, Dv) -> (N, Mp, Dv): a GEMM per ``KEY_BLOCK`` keys (a sum over 16 keys: one
    order), the blocks' partial products tree-summed from key 0."""
    n, mp, sp = p.shape
    dv = v.shape[2]
    st = sp // KEY_BLOCK
    a = p.view(n, mp, st, KEY_BLOCK).transpose(1, 2).reshape(n * st, mp, KEY_BLOCK)
    part = torch.bmm(_two_or_more(a), _two_or_more(v.reshape(n * st, KEY_BLOCK, dv)))[: n * st]
    return tree_sum(part.view(n, st, mp, dv), dim=1)


def _attention_core(qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, bias: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(N, Mp, D), (N, Sp, D), (N, Sp, Dv), (N, Mp, Sp) -> the output (N, Mp, Dv), the softmax numerators
    (N, Mp, Sp) and denominators (N, Mp, 1)."""
    scores = _blocked_scores(qr, kr) * scale + bias
    p = exp(scores - _row_max(scores))
    # a real query sees its max once (exp(0) = 1), so the clamp only touches the padding rows (0 / 0)
    denom = tree_sum(p, keepdim=True).clamp(min=1.0)
    return _blocked_pv(p, vr) / denom, p, denom


class _InvariantAttention(torch.autograd.Function):
    """:func:`_attention_core`'s forward; the backward is attention's usual one (``dS = P * (dP - rowsum(dO *
    O))``) from the saved probabilities: gradients need no fixed order, and differentiating the blocked,
    tree-summed forward op by op costs several times more."""

    @staticmethod
    def forward(qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, bias: torch.Tensor,  # type: ignore[override]
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        out, p, denom = _attention_core(qr, kr, vr, bias, scale)
        return out, p / denom  # the output, and the probabilities the backward reads (not differentiable)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        qr, kr, vr, _, scale = inputs
        out, probs = output
        ctx.mark_non_differentiable(probs)
        ctx.save_for_backward(qr, kr, vr, probs, out)
        ctx.scale = scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _: Any):  # type: ignore[override]
        qr, kr, vr, p, out = ctx.saved_tensors
        dv = torch.bmm(p.transpose(1, 2), g)
        dp = torch.bmm(g, vr.transpose(1, 2))
        ds = p * (dp - (g * out).sum(-1, keepdim=True)) * ctx.scale
        return torch.bmm(ds, kr), torch.bmm(ds.transpose(1, 2), qr), dv, None, None


def attention(
    q: torch.Tensor,  # (B, T, H, Dh)
    k: torch.Tensor,  # (B, S, KV, Dh)
    v: torch.Tensor,  # (B, S, KV, Dv)
    *,
    scale: float,
    mask: torch.Tensor,  # (T, S) | (B, T, S) bool, True: may attend
) -> torch.Tensor:  # (B, T, H, Dv)
    """``softmax(q k^T * scale) v`` per query over the keys it may see, with every reduction in an order
    fixed from key 0 (see the module docstring). Checked shapes come from ``nn.attention``."""
    b, t, h, dh = q.shape
    s, kv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = h // kv
    acc = torch.promote_types(q.dtype, torch.float32)
    mp, sp = -(-g * t // TILE) * TILE, -(-s // KEY_BLOCK) * KEY_BLOCK
    # rows (B*KV, G*T, .): the query heads of one kv head, each head's T queries in a run
    qr = q.to(acc).reshape(b, t, kv, g, dh).permute(0, 2, 3, 1, 4).reshape(b * kv, g * t, dh)
    kr = k.to(acc).permute(0, 2, 1, 3).reshape(b * kv, s, dh)
    vr = v.to(acc).permute(0, 2, 1, 3).reshape(b * kv, s, dv)
    qr = F.pad(qr, (0, 0, 0, mp - g * t))
    kr, vr = F.pad(kr, (0, 0, 0, sp - s)), F.pad(vr, (0, 0, 0, sp - s))
    # the mask as an additive 0 / -inf bias (exact: x + 0 == x), padded keys and queries -inf (a padded bool
    # mask inside a masked load miscompiles in inductor's C++ vectorizer, torch 2.13)
    bias = torch.zeros((), dtype=acc, device=q.device).masked_fill(~mask, float("-inf"))
    bias = (bias if bias.dim() == 3 else bias.expand(b, t, s))[:, None, None].expand(b, kv, g, t, s)
    bias = F.pad(bias.reshape(b * kv, g * t, s), (0, sp - s, 0, mp - g * t), value=float("-inf"))
    if any(map(_needs_grad, (qr, kr, vr))) and plain_reverse_mode():  # the ordinary attention backward
        out = _InvariantAttention.apply(qr, kr, vr, bias, scale)[0]
    else:
        out = _attention_core(qr, kr, vr, bias, scale)[0]
    out = out[:, : g * t].reshape(b, kv, g, t, dv).permute(0, 3, 1, 2, 4).reshape(b, t, h, dv)
    return out.to(v.dtype)
