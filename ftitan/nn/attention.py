"""Scaled dot-product attention with grouped-query heads (GQA, Ainslie et al. 2023).

Implementations that agree to float32 rounding:

- ``"sdpa"``: ``F.scaled_dot_product_attention`` (fused kernels where the
  backend has them; ``enable_gqa`` so K/V are never repeated in memory).
- ``"math"``: explicit ``softmax(q k^T * scale) v`` with the softmax in
  float32. It is plain tensor algebra, so it works wherever SDPA has no rule
  (DTensor on CPU, exotic transforms) and it is the readable reference.
  ``"sdpa"`` switches to it by itself under ``torch.func`` transforms other
  than one level of ``grad`` (``vmap``, ``jvp``, ``linearize``, ``grad`` of
  ``grad``) and under forward-AD dual tensors, where the CPU flash kernel
  has no rule (``ftitan.kernels.autodiff.plain_reverse_mode``).
- ``"batch_invariant"``: ``ftitan.nn.invariant.attention``, every reduction in an order fixed
  from key 0, so a query's output does not depend on the batch, the padding or the number of
  keys after the ones it sees (prefill vs decode). A model config with this impl runs all its
  ops batch-invariantly (``ftitan.config.batch_invariant``).
- ``"flex"``: FlexAttention (``ftitan.nn.flex``) with the mask as a mask function and block
  sparsity (static block masks cached per shape). Where it cannot run (CPU with an input that
  requires grad, ``torch.func`` transforms, forward-AD) it runs ``"sdpa"`` with the same mask,
  materialized from the mask function (``flex.runs``: a compile-time choice).
- ``"gemm"``: causal self-attention as plain GEMMs over blocks of :data:`GEMM_BLOCK` queries, each
  block against only the keys it can see (the keys after the block, and before its window, are never
  multiplied), its scores materialized and softmaxed in float32 (:func:`gemm_applies` says where: on
  the CPU, the causal rule, alone or refined by a ``window`` and/or packed rows' ``segments``, with as
  many queries as keys, up to :data:`GEMM_MAX_SEQ` of them unless windowed). On the CPU at such lengths
  it is faster than SDPA's flash kernel (whose causal forward there takes as long as its non-causal
  one, at a third of a batched GEMM's FLOP/s): forward and backward of B 4, T 256, 8/2
  heads of 64, compiled, 8.7-10.9 ms against 12.8-14.0 in float32, 5.7 against 15.0 in bfloat16
  (docs/kernels.md). It saves a layer's probabilities for backward (``B H T (T + 64) / 2``
  elements, capped at :data:`GEMM_MAX_SAVED` bytes), where the flash kernel saves one float a row.
  A window skips the keys before it; packed documents cost one comparison of segment ids per score
  (B 2, T 1024, 8/2 heads: window 128 24.8 ms against SDPA's 106.4, 4 documents a row 65.5 against 106.3
  with the dense mask; docs/kernels.md). Windowed rows longer than :data:`GEMM_MAX_SEQ` run as bands
  (every block against its span of keys in one batched GEMM: linear in T, one graph at any length).
  Plain tensor algebra: every ``torch.func`` transform and forward-AD runs it as it is. Elsewhere
  (explicit masks, a prefix-LM, a KV cache, CUDA, longer rows without a window) it runs ``"sdpa"``.
- ``"auto"``: ``"flex"`` on CUDA inside ``torch.compile`` (where FlexAttention is a fused kernel; eager
  it materializes the scores), ``"gemm"`` on the CPU (``"sdpa"`` where that does not apply),
  ``"sdpa"`` elsewhere: resolved from the tensors' device.

Queries may be fewer than keys (decoding against a KV cache): the causal mask
is then aligned bottom-right, i.e. query ``t`` sits at key position
``t + S - T`` and sees keys ``0 .. t + S - T``.

An explicit ``mask`` (``(T, S)``, or ``(B, T, S)`` per sequence) replaces
the causal rule where positions are not ``arange``: context parallelism's
head-tail chunks, a KV cache of padded rows (``ftitan.infer``), or packed
rows of several documents (:func:`document_mask`: block-diagonal causal, no
token sees another document).

A ``window`` (sliding-window attention, Beltagy et al. 2020 / Mistral) keeps
only the ``window`` most recent keys of each query, itself included: query
``t`` (at key position ``p = t + S - T``) sees key ``j`` only if
``j > p - window``, on top of the causal rule or the explicit ``mask`` (HF's
``sliding_window`` convention, ``kv_idx > q_idx - sliding_window``).

``segments`` (packed rows, ``(B, T)`` document ids) and ``prefix`` (prefix-LM,
an int or ``(B,)`` lengths: bidirectional inside each row's prefix, causal
after it) come with ``causal=True`` and refine it; every impl takes them
(``flex.mask_of`` is the one definition of each mask).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ftitan.kernels import onednn
from ftitan.kernels.autodiff import plain_reverse_mode
from ftitan.nn import flex, invariant

__all__ = [
    "GEMM_BLOCK",
    "GEMM_MAX_SAVED",
    "GEMM_MAX_SEQ",
    "Attend",
    "AttentionImpl",
    "attention",
    "causal_mask",
    "document_mask",
    "document_positions",
    "gemm_applies",
    "window_mask",
]

AttentionImpl = Literal["sdpa", "math", "batch_invariant", "flex", "gemm", "auto"]
IMPLS: tuple[str, ...] = ("sdpa", "math", "batch_invariant", "flex", "gemm", "auto")

# "gemm": queries per block; the longest row its causal blocks run (measured faster than the CPU flash
# kernel from 256 to 1024 keys, even at 2048, but each block compiles its own kernels: longer windowed rows
# run as bands); the most bytes of probabilities one call may save for backward
GEMM_BLOCK = 64
GEMM_MAX_SEQ = 1024
GEMM_MAX_SAVED = 256 << 20

# the attention op a model block calls: ``attend(q, k, v, *, impl, causal, scale) -> o`` with the
# shapes of :func:`attention` (``attention`` itself, context-parallel attention, a KV cache's)
Attend = Callable[..., torch.Tensor]


def causal_mask(t: int, s: int, *, device: torch.device | str | None = None) -> torch.Tensor:  # (T, S) bool
    """True where query ``i`` (of the last ``t`` of ``s`` positions) may see key ``j``."""
    q_pos = torch.arange(t, device=device)[:, None] + (s - t)
    return torch.arange(s, device=device)[None, :] <= q_pos


def window_mask(t: int, s: int, window: int, *, device: torch.device | str | None = None) -> torch.Tensor:  # (T, S)
    """True where key ``j`` is among the ``window`` most recent keys of query ``i`` (of the last ``t`` of
    ``s`` positions), itself included: ``j > i + s - t - window``. Earlier keys only with :func:`causal_mask`."""
    q_pos = torch.arange(t, device=device)[:, None] + (s - t)
    return torch.arange(s, device=device)[None, :] > q_pos - window


def document_mask(segments: torch.Tensor) -> torch.Tensor:  # (B, T) int -> (B, T, T) bool
    """Block-diagonal causal mask of packed rows: query ``i`` sees key ``j`` iff ``j <= i`` and both
    carry the same document id (``segments[b, i] == segments[b, j]``)."""
    if segments.dim() != 2 or segments.is_floating_point():
        raise ValueError(f"document_mask: segments must be (B, T) int document ids, got {tuple(segments.shape)} "
                         f"{segments.dtype}")  # fmt: skip
    t = segments.shape[1]
    return causal_mask(t, t, device=segments.device)[None] & (segments[:, :, None] == segments[:, None, :])


def document_positions(segments: torch.Tensor) -> torch.Tensor:  # (B, T) int -> (B, T) int64
    """Positions that restart at 0 where a new document starts (``segments`` changes along the row):
    each document of a packed row is placed as if it ran alone."""
    t = segments.shape[1]
    index = torch.arange(t, device=segments.device).expand_as(segments)
    first = torch.ones_like(segments[:, :1], dtype=torch.bool)
    start = torch.cat([first, segments[:, 1:] != segments[:, :-1]], dim=1)  # (B, T): a document begins
    return index - torch.where(start, index, torch.zeros_like(index)).cummax(dim=1).values


def attention(
    q: torch.Tensor,  # (B, T, H, Dh)
    k: torch.Tensor,  # (B, S, KV, Dh)
    v: torch.Tensor,  # (B, S, KV, Dv)
    *,
    impl: AttentionImpl = "sdpa",
    causal: bool = True,
    scale: float | None = None,
    mask: torch.Tensor | None = None,  # (T, S) | (B, T, S) bool, True: may attend
    window: int | None = None,  # sliding window: each query sees its `window` most recent keys, itself included
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows (with causal, T == S)
    prefix: int | torch.Tensor | None = None,  # prefix-LM: int | (B,) int prefix lengths (with causal)
    kernels: str = "torch",  # a model config's kernels: not "torch": "gemm"'s GEMMs by ftitan.kernels.onednn
) -> torch.Tensor:  # (B, T, H, Dv)
    """Attention of ``H`` query heads over ``KV`` key/value heads (``H % KV == 0``).

    Query head ``h`` reads key/value head ``h // (H // KV)``, as HF's
    ``repeat_kv``. ``scale`` defaults to ``Dh ** -0.5``. Values may be
    narrower than keys (MLA: ``Dv < Dn + Dr``). ``mask`` (with
    ``causal=False``) gives which keys each query sees, for layouts where
    positions are not in order (context parallelism's head-tail chunks), per
    sequence when it is ``(B, T, S)``; every query must see at least one key.
    ``window`` (an int >= 1) further limits query ``t`` to keys ``j > t + S - T - window``
    (:func:`window_mask`, ANDed with the causal rule or ``mask``; index distance is position
    distance where positions are contiguous: a row, a document of packed rows).
    """
    b, t, h, dh = q.shape
    s, kv = k.shape[1], k.shape[2]
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != dh:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not line up")
    if h % kv:
        raise ValueError(f"attention: {h} query heads are not a multiple of {kv} key/value heads")
    if causal and t > s:
        raise ValueError(f"attention: causal with more queries ({t}) than keys ({s})")
    # sizes compared one by one: under torch.compile with symbolic sizes, dynamo answers
    # `static_tuple in (tuples holding a SymInt)` False without comparing (torch 2.13)
    if mask is not None and (causal or mask.dim() not in (2, 3) or mask.shape[-2] != t or mask.shape[-1] != s
                             or (mask.dim() == 3 and mask.shape[0] != b)):  # fmt: skip
        raise ValueError(
            f"attention: mask {tuple(mask.shape)} must be (T, S) = {(t, s)} or (B, T, S) = {(b, t, s)} "
            f"and comes with causal=False"
        )
    scale = dh**-0.5 if scale is None else scale
    _check_packed(b, t, s, causal=causal, segments=segments, prefix=prefix)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"attention: window={window!r} must be an int >= 1 (keys each query sees, itself included)")
    if impl == "auto":  # the device and whether dynamo traces: compile-time constants
        if q.device.type == "cuda":
            impl = "flex" if torch.compiler.is_compiling() else "sdpa"
        else:
            impl = "gemm" if q.device.type == "cpu" else "sdpa"
    if impl == "gemm" and prefix is None and gemm_applies(q, k, causal=causal, mask=mask, window=window):
        # windows and documents refine causal
        return _gemm(q, k, v, scale=scale, window=window, segments=segments, kernels=kernels)
    if impl == "flex" or segments is not None or prefix is not None:
        m = flex.mask_of(b, t, s, causal=causal, mask=mask, window=window, segments=segments, prefix=prefix)
        if impl == "flex" and flex.runs(q, k, v):
            return flex.attention(q, k, v, m, scale=scale)
        impl = "sdpa" if impl == "flex" else impl  # flex cannot run here: SDPA with the same mask
        if segments is not None or prefix is not None:  # the causal rule, a mask and a window: as below
            mask, causal, window = flex.dense(m, device=q.device), False, None
    if window is not None:
        mask, causal = _with_window(window, t, s, causal=causal, mask=mask, device=q.device), False
    if impl not in IMPLS:
        raise ValueError(f"attention: impl={impl!r}; expected one of {IMPLS}")
    if impl == "gemm":  # where it did not apply above
        impl = "sdpa"
    # the CPU flash kernel has no forward-AD formula, vmap rule or double backward: under such
    # transforms sdpa falls back to the math form (equal to rounding); a compile-time choice
    if impl == "sdpa" and plain_reverse_mode():
        return _sdpa(q, k, v, causal=causal, scale=scale, mask=mask)
    if impl == "batch_invariant":
        if causal or mask is None:
            mask = causal_mask(t, s, device=q.device) if causal else torch.ones(t, s, dtype=torch.bool, device=q.device)
        return invariant.attention(q, k, v, scale=scale, mask=mask)
    return _math(q, k, v, causal=causal, scale=scale, mask=mask)


def gemm_applies(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    window: int | None = None,
) -> bool:
    """Whether ``attn_impl="gemm"`` runs its blocked GEMMs for these queries and keys (else it runs
    ``"sdpa"``): plain (not DTensor) floating-point CPU tensors, the causal rule (no explicit ``mask``;
    a ``window`` and packed rows' ``segments`` refine it and run here too, a prefix-LM's ``prefix`` does
    not) with as many queries as keys, and at most :data:`GEMM_MAX_SAVED` bytes of probabilities saved;
    rows of at most :data:`GEMM_MAX_SEQ` keys, longer ones only with a ``window`` shorter than the row,
    which runs them in bands (any length: that graph does not grow with the row). Decided from shapes,
    device and dtype: a compile-time choice. Sizes that ``torch.compile`` made dynamic decide nothing
    (``statically_known_true`` adds no guard): such a graph runs SDPA, which serves every length, where
    the blocks would specialize on each length and recompile."""
    if not causal or mask is not None:
        return False
    if q.device.type != "cpu" or not q.is_floating_point() or not (type(q) is type(k) is torch.Tensor):
        return False
    b, t, h = q.shape[0], q.shape[1], q.shape[2]
    per = 4 + (q.element_size() if q.dtype != torch.float32 else 0)  # float32 softmax output and its cast
    if _banded(t, window):  # every block of queries against its span of window + GEMM_BLOCK - 1 keys
        assert window is not None
        saved = b * h * -(-t // GEMM_BLOCK) * GEMM_BLOCK * (window + GEMM_BLOCK - 1)
        return all(statically_known_true(c) for c in (t == k.shape[1], saved * per <= GEMM_MAX_SAVED))
    saved = b * h * t * (t + GEMM_BLOCK) // 2  # the probabilities of every block
    return all(statically_known_true(c) for c in (t == k.shape[1], t <= GEMM_MAX_SEQ, saved * per <= GEMM_MAX_SAVED))


def _banded(t: int, window: int | None) -> bool:
    """Whether ``gemm`` runs a windowed row as bands (:func:`_gemm_banded`): a row longer than
    :data:`GEMM_MAX_SEQ` (shorter ones run the causal blocks, keys before the window skipped: faster, 31
    against 46 ms at T 1024, window 128, B 2, 8/2 heads) whose window's span of keys is shorter than it."""
    if window is None:
        return False
    return all(statically_known_true(c) for c in (t > GEMM_MAX_SEQ, window + GEMM_BLOCK - 1 < t))


def _check_packed(
    b: int, t: int, s: int, *, causal: bool, segments: torch.Tensor | None, prefix: int | torch.Tensor | None
) -> None:
    """Raise unless ``segments`` / ``prefix`` fit :func:`attention`'s shapes (each with ``causal``)."""
    if (segments is not None or prefix is not None) and not causal:
        raise ValueError("attention: segments (packed rows) and prefix (prefix-LM) refine the causal rule: "
                         "pass causal=True, or an explicit mask instead")  # fmt: skip
    if segments is not None and (segments.dim() != 2 or segments.is_floating_point() or segments.shape[0] != b
                                 or segments.shape[1] != t or t != s):  # fmt: skip
        raise ValueError(f"attention: segments {tuple(segments.shape)} {segments.dtype} must be (B, T) = {(b, t)} "
                         f"int document ids, with as many keys as queries (got S={s})")  # fmt: skip
    if segments is not None and prefix is not None:
        raise ValueError("attention: segments and prefix together are not supported; pass an explicit mask")
    if isinstance(prefix, torch.Tensor) and (prefix.dim() != 1 or prefix.shape[0] != b or prefix.is_floating_point()):
        raise ValueError(f"attention: prefix {tuple(prefix.shape)} {prefix.dtype} must be (B,) = ({b},) int lengths")
    if prefix is not None and not isinstance(prefix, torch.Tensor) and (not isinstance(prefix, int)
                                                                        or isinstance(prefix, bool) or prefix < 0):
        raise ValueError(f"attention: prefix={prefix!r} must be an int >= 0 or a (B,) int tensor of lengths")


def _with_window(
    window: int, t: int, s: int, *, causal: bool, mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:  # (T, S) | (B, T, S) bool
    """The explicit mask of a windowed attention: the window ANDed with the causal rule or ``mask``."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"attention: window={window!r} must be an int >= 1 (keys each query sees, itself included)")
    if causal:
        return _span_mask(t, s, window, device=device)
    near = window_mask(t, s, window, device=device)
    return near if mask is None else near & mask


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    t, s = q.shape[1], k.shape[1]
    # SDPA's is_causal aligns top-left; when T != S pass the bottom-right mask explicitly.
    # Branches, not `causal and t == s`: when dynamo makes sizes (or config ints, after a
    # recompile with another config) symbolic, that is a SymBool, which SDPA refuses
    if causal and t != s:
        mask, is_causal = causal_mask(t, s, device=q.device), False
    else:
        is_causal = causal
    if mask is not None and mask.dim() == 3:  # per sequence: broadcast over heads
        mask = mask[:, None]
    gqa = False
    if q.shape[2] != k.shape[2]:  # a branch (a guard) for the same reason
        gqa = True
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)


def _gemm(
    q: torch.Tensor,  # (B, T, H, Dh)
    k: torch.Tensor,  # (B, T, KV, Dh)
    v: torch.Tensor,  # (B, T, KV, Dv)
    *,
    scale: float,
    window: int | None = None,
    segments: torch.Tensor | None = None,  # (B, T) document ids
    kernels: str = "torch",
) -> torch.Tensor:  # (B, T, H, Dv)
    """Causal attention, ``T == S``, one query block of :data:`GEMM_BLOCK` at a time against the keys it
    can see: those up to its last query and, with a ``window``, from its first query's oldest key on
    (keys outside that span are never multiplied). Two batched GEMMs per block (query heads grouped by the
    kv head they read, so K and V are never repeated) around a float32 softmax masked where the causal
    rule, the window or the documents (``segments``, compared per row) hide a key. Every query sees
    itself, so no row is empty. ``kernels`` other than "torch": the GEMMs by ``ftitan.kernels.onednn.matmul``
    (each in the faster library for its shape on the CPU: aten::bmm or oneDNN's matmul)."""
    b, t, h, dh = q.shape
    matmul = _matmul(kernels)
    if _banded(t, window):
        assert window is not None
        return _gemm_banded(q, k, v, scale=scale, window=window, segments=segments, matmul=matmul)
    kv, dv = k.shape[2], v.shape[3]
    g = h // kv
    acc = torch.promote_types(q.dtype, torch.float32)
    qh = q.reshape(b, t, kv, g, dh).permute(0, 2, 3, 1, 4)  # (B, KV, G, T, Dh)
    kt = k.permute(0, 2, 3, 1)  # (B, KV, Dh, S)
    vh = v.permute(0, 2, 1, 3)  # (B, KV, S, Dv)
    outs = []
    for i in range(0, t, GEMM_BLOCK):
        e = min(i + GEMM_BLOCK, t)  # queries i..e-1 see keys lo..e-1 at most
        lo = 0 if window is None else max(0, i - window + 1)
        n, m = e - i, e - lo
        scores = matmul(qh[:, :, :, i:e].reshape(b, kv, g * n, dh), kt[..., lo:e]).view(b, kv, g, n, m)
        seen = _span_mask(n, m, window, device=q.device)  # the block's queries are its span's last n keys
        if segments is not None:  # (B, n, m): the same document
            seen = (seen & (segments[:, i:e, None] == segments[:, None, lo:e]))[:, None, None]
        probs = (scores.to(acc) * scale).masked_fill(~seen, float("-inf")).softmax(dim=-1).to(v.dtype)
        outs.append(matmul(probs.view(b, kv, g * n, m), vh[:, :, lo:e]).view(b, kv, g, n, dv))
    return torch.cat(outs, dim=3).permute(0, 3, 1, 2, 4).reshape(b, t, h, dv)


def _matmul(kernels: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``torch.matmul``, or with ``kernels`` other than "torch" ``ftitan.kernels.onednn.matmul``."""
    return torch.matmul if kernels == "torch" else onednn.matmul


def _span_mask(n: int, m: int, window: int | None, *, device: torch.device) -> torch.Tensor:  # (n, m) bool
    """Which of a span of ``m`` keys each of its last ``n`` (the queries: a ``gemm`` block, a KV cache's
    new tokens) sees: the causal rule and the ``window`` (:func:`causal_mask`, :func:`window_mask`)."""
    seen = causal_mask(n, m, device=device)
    return seen if window is None else seen & window_mask(n, m, window, device=device)


def _gemm_banded(
    q: torch.Tensor,  # (B, T, H, Dh)
    k: torch.Tensor,  # (B, T, KV, Dh)
    v: torch.Tensor,  # (B, T, KV, Dv)
    *,
    scale: float,
    window: int,
    segments: torch.Tensor | None = None,  # (B, T) document ids
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul,
) -> torch.Tensor:  # (B, T, H, Dv)
    """Sliding-window causal attention, every block of :data:`GEMM_BLOCK` queries at once: the row is padded
    to whole blocks (and by ``window - 1`` keys in front), K and V are unfolded into each block's span of
    ``window + GEMM_BLOCK - 1`` keys (the first query's oldest visible key through the last query), and two
    batched GEMMs over (row, kv head, block) run around one float32 softmax. The mask (within the window,
    not after the query, not in the front padding, the same document) is one pattern for every block, so
    the graph and its kernels do not grow with the row. Padded queries see their padded selves and are
    dropped."""
    b, t, h, dh = q.shape
    kv, dv = k.shape[2], v.shape[3]
    g, n = h // kv, GEMM_BLOCK
    nb = -(-t // n)
    front, back, m = window - 1, nb * n - t, window - 1 + n
    acc = torch.promote_types(q.dtype, torch.float32)
    qb = F.pad(q, (0, 0, 0, 0, 0, back)).reshape(b, nb, n, kv, g, dh).permute(0, 3, 1, 4, 2, 5)
    ks = F.pad(k, (0, 0, 0, 0, front, back)).unfold(1, m, n).permute(0, 2, 1, 3, 4)  # (B, KV, nb, Dh, m)
    vs = F.pad(v, (0, 0, 0, 0, front, back)).unfold(1, m, n).permute(0, 2, 1, 4, 3)  # (B, KV, nb, m, Dv)
    scores = matmul(qb.reshape(b, kv, nb, g * n, dh), ks).view(b, kv, nb, g, n, m)
    # block j's queries are the last n keys of its span, whose key c sits at j n - (window - 1) + c
    c, j = torch.arange(m, device=q.device), torch.arange(nb, device=q.device)[:, None, None]
    seen = _span_mask(n, m, window, device=q.device) & (j * n - front + c >= 0)  # (nb, n, m): not front padding
    if segments is not None:  # padded queries and keys share one id: a padded query sees itself
        ids = F.pad(segments, (front, back))
        same = ids[:, front:].view(b, nb, n)[..., None] == ids.unfold(1, m, n)[:, :, None]  # (B, nb, n, m)
        seen = (seen & same)[:, None, :, None]  # (B, 1, nb, 1, n, m)
    else:
        seen = seen[:, None]  # (nb, 1, n, m)
    probs = (scores.to(acc) * scale).masked_fill(~seen, float("-inf")).softmax(dim=-1).to(v.dtype)
    out = matmul(probs.view(b, kv, nb, g * n, m), vs).view(b, kv, nb, g, n, dv)
    return out.permute(0, 2, 4, 1, 3, 5).reshape(b, nb * n, h, dv)[:, :t]


def _math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    b, t, h, dh = q.shape
    dv = v.shape[3]
    s, kv = k.shape[1], k.shape[2]
    # group query heads by the kv head they read, instead of repeating K/V
    qg = q.reshape(b, t, kv, h // kv, dh)
    # float32 softmax for low precision; float64 stays float64
    scores = torch.einsum("btkgd,bskd->bkgts", qg, k).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if causal:
        mask = causal_mask(t, s, device=q.device)
    if mask is not None:  # (T, S) | (B, T, S) against scores (B, KV, G, T, S)
        scores = scores.masked_fill(~(mask[:, None, None] if mask.dim() == 3 else mask), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, dv)
