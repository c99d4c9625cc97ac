"""FlexAttention masks and the ``attn_impl="flex"`` backend of :func:`ftitan.nn.attention`.

FlexAttention (Dong et al. 2024, "Flex Attention: A Programming Model for
Generating Optimized Attention Kernels") takes the mask as a function
``mask_mod(b, h, q_idx, kv_idx) -> bool`` and a :class:`BlockMask`, the
mask's block sparsity (128 x 128 tiles) from which the kernel skips whole
empty tiles. This module builds the mask functions of every attention
layout ftitan has, with the conventions of ``nn.attention``:

- causal, aligned bottom-right when queries are fewer than keys (decoding
  against a cache: query ``t`` sits at key position ``t + S - T``);
- sliding window (``window``: the ``window`` most recent keys, itself
  included), ANDed with the rest (Muse Glimmer's windowed layers);
- packed documents (``segments`` (B, T) int ids): block-diagonal causal;
- prefix-LM (``prefix``: one int, or (B,) int lengths per row): every
  query sees the keys of its row's prefix (bidirectional inside it), causal
  after it (Raffel et al. 2020, T5's prefix LM);
- an explicit ``mask`` tensor (T, S) | (B, T, S) (context parallelism's
  head-tail chunks, a KV cache's ragged rows) as a mask function.

Block masks that depend only on shapes (causal, window, an int prefix) are
built once per ``(kind, T, S, window, prefix, device)`` and reused from a
small cache (:func:`block_mask_cache_info`); those that depend on tensors
(segments, per-row prefixes, explicit masks) are built per call, i.e. per
batch. Inside ``torch.compile`` the block mask is built in the graph (a
trace must not fill a Python cache with fake tensors).

FlexAttention runs forward on CPU only when no input requires grad, and it
has no ``torch.func`` (grad, vmap, jvp) or forward-AD rules: :func:`runs`
says whether it can run here; otherwise ``nn.attention`` runs SDPA with the
same mask, :func:`dense` of the same mask function. The decision reads only
the device, grad mode, ``requires_grad`` and the functorch / forward-AD
stacks: constants that dynamo guards, so a compiled graph holds one branch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.autograd.forward_ad as forward_ad
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, flex_attention, or_masks

__all__ = [
    "Mask",
    "MaskMod",
    "attention",
    "block_mask",
    "block_mask_cache_info",
    "causal_mod",
    "clear_block_mask_cache",
    "dense",
    "document_mod",
    "mask_of",
    "prefix_mod",
    "runs",
    "tensor_mod",
    "window_mod",
]

# (batch, head, q_idx, kv_idx) int tensors -> bool tensor: True where the query may see the key
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

CACHE_SIZE = 64  # static block masks kept (oldest dropped first)
_BLOCK_MASKS: OrderedDict[tuple[Any, ...], BlockMask] = OrderedDict()
_STATS = {"hits": 0, "builds": 0}


def causal_mod(t: int, s: int) -> MaskMod:
    """Causal, bottom-right aligned: query ``q`` (of the last ``t`` of ``s`` positions) sees keys ``<= q + s - t``."""
    offset = s - t

    def causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return kv <= q + offset

    return causal


def window_mod(t: int, s: int, window: int) -> MaskMod:
    """The ``window`` most recent keys of each query, itself included: ``kv > q + s - t - window``."""
    offset = s - t

    def sliding_window(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return kv > q + offset - window

    return sliding_window


def document_mod(segments: torch.Tensor) -> MaskMod:  # (B, T) int document ids
    """Same document: ``segments[b, q] == segments[b, kv]`` (AND it with :func:`causal_mod`)."""

    def document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return segments[b, q] == segments[b, kv]

    return document


def prefix_mod(prefix: int | torch.Tensor) -> MaskMod:  # an int, or (B,) int lengths
    """Keys inside the row's prefix: ``kv < prefix[b]`` (OR it with :func:`causal_mod`: a prefix LM)."""

    def in_prefix(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return kv < (prefix if isinstance(prefix, int) else prefix[b])

    return in_prefix


def tensor_mod(mask: torch.Tensor) -> MaskMod:  # (T, S) | (B, T, S) bool
    """An explicit boolean mask as a mask function."""
    if mask.dim() == 2:

        def shared(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return mask[q, kv]

        return shared

    def per_row(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return mask[b, q, kv]

    return per_row


class Mask(NamedTuple):
    """A mask function with what its block mask needs.

    - ``mod``: the mask function; None: every query sees every key.
    - ``t``, ``s``: queries and keys.
    - ``batch``: rows the mask differs over (None: the same for every row).
    - ``key``: the static cache key (kind, T, S, window, prefix) when the mask depends on shapes only;
      None when it depends on tensors (built per call).
    """

    mod: MaskMod | None
    t: int
    s: int
    batch: int | None
    key: tuple[Any, ...] | None


def mask_of(
    b: int,
    t: int,
    s: int,
    *,
    causal: bool,
    mask: torch.Tensor | None = None,  # (T, S) | (B, T, S) bool
    window: int | None = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids
    prefix: int | torch.Tensor | None = None,  # int | (B,) int prefix lengths
) -> Mask:
    """The :class:`Mask` of ``nn.attention``'s arguments (checked by it): the causal rule or ``mask``,
    OR the ``prefix`` (with causal), AND the documents of ``segments`` (with causal), AND the ``window``."""
    mods: list[MaskMod] = []
    per_row = mask is not None and mask.dim() == 3 or segments is not None or isinstance(prefix, torch.Tensor)
    if causal:
        mods.append(causal_mod(t, s) if prefix is None else or_masks(causal_mod(t, s), prefix_mod(prefix)))
    elif mask is not None:
        mods.append(tensor_mod(mask))
    if segments is not None:
        mods.append(document_mod(segments))
    if window is not None:
        mods.append(window_mod(t, s, window))
    static = mask is None and segments is None and not isinstance(prefix, torch.Tensor)
    key = ("causal" if causal else "full", t, s, window, prefix) if static else None
    mod = None if not mods else mods[0] if len(mods) == 1 else and_masks(*mods)
    return Mask(mod, t, s, b if per_row else None, key)


def dense(m: Mask, *, device: torch.device | str | None = None) -> torch.Tensor | None:  # (T, S) | (B, T, S) bool
    """``m``'s mask function evaluated at every (row, query, key): the mask SDPA and the math form take."""
    if m.mod is None:
        return None
    rows = torch.arange(m.batch or 1, device=device)[:, None, None]
    q = torch.arange(m.t, device=device)[None, :, None]
    kv = torch.arange(m.s, device=device)[None, None, :]
    out = m.mod(rows, torch.zeros((), dtype=torch.long, device=device), q, kv).expand(m.batch or 1, m.t, m.s)
    return out if m.batch is not None else out[0]


def block_mask(m: Mask, *, device: torch.device) -> BlockMask | None:
    """``m``'s :class:`BlockMask`: from the cache when it is static (built on its first use), else built now."""
    if m.mod is None:
        return None
    if m.key is None or torch.compiler.is_compiling():
        return create_block_mask(m.mod, m.batch, None, m.t, m.s, device=device)
    key = (*m.key, str(torch.device(device)))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None:
        _STATS["hits"] += 1
        _BLOCK_MASKS.move_to_end(key)
        return hit
    built = create_block_mask(m.mod, None, None, m.t, m.s, device=device)
    _STATS["builds"] += 1
    _BLOCK_MASKS[key] = built
    if len(_BLOCK_MASKS) > CACHE_SIZE:
        _BLOCK_MASKS.popitem(last=False)
    return built


def block_mask_cache_info() -> dict[str, int]:
    """``{"hits", "builds", "size"}`` of the static block-mask cache (eager calls)."""
    return {**_STATS, "size": len(_BLOCK_MASKS)}


def clear_block_mask_cache() -> None:
    """Drop every cached static block mask and zero the counters."""
    _BLOCK_MASKS.clear()
    _STATS.update(hits=0, builds=0)


def runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether FlexAttention can run on these inputs: no ``torch.func`` transform and no forward-AD level
    (it has no rules for them), and on CPU / MPS (no backward there) no input that requires grad."""
    if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
        return False
    if q.device.type in ("cpu", "mps"):
        return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    return True


def attention(
    q: torch.Tensor,  # (B, T, H, Dh)
    k: torch.Tensor,  # (B, S, KV, Dh)
    v: torch.Tensor,  # (B, S, KV, Dv)
    m: Mask,
    *,
    scale: float,
) -> torch.Tensor:  # (B, T, H, Dv)
    """``flex_attention`` with ``m``'s block mask, grouped-query heads read in place (``enable_gqa``)."""
    gqa = False
    if q.shape[2] != k.shape[2]:  # a branch, not a SymBool: flex wants a Python bool
        gqa = True
    out = flex_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=block_mask(m, device=q.device),
        scale=scale,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)
