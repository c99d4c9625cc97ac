"""The native KV cache: a tree of static-shape tensors that a model's ``apply`` attends through.

``KVCache`` implements ``ftitan.models.base.AttentionCache``: passed as
``apply(params, tokens, positions=..., cache=cache)``, each layer writes the
keys/values of the new tokens into its slots and attends over every slot its
row may see. Shapes never change while generating (``S`` slots per row), so a
compiled decode step is traced once.

Rows are ragged: row ``b`` holds its sequence in slots ``start[b] ..
end[b] - 1``. Left-padded prompts start late (``start[b] > 0``, every row ends
at the same slot); right-padded ones end early (``end[b] < T``, the next
token overwrites the first padding slot). A query at slot ``j`` sees keys
``start[b] .. j``; a padding query sees only itself, so padded rows stay
finite and never leak into real ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ftitan import nn, tree

__all__ = ["Donated", "KVCache", "init_cache"]


class KVCache(NamedTuple):
    """Per-layer keys/values ``{"0": {"k": (B, S, KV, Dk), "v": (B, S, KV, Dv)}, ...}`` and the rows' spans.

    A recurrent layer (linear attention, :meth:`recur`) holds its state instead, e.g. Gated DeltaNet's
    ``{"conv": (B, K - 1, C), "ssm": (B, H, Dk, Dv)}``: the state after the row's last real token.

    - ``start`` (B,) int64: first slot of each row's sequence (left padding before it).
    - ``end`` (B,) int64: one past its last written slot; the next token goes there.
    - ``limit`` (B,) int64 or None: while a right-padded prompt is prefilled, one past its last real
      slot (the padding after it must not reach a recurrent state); None: every new token is real.

    Build with :func:`init_cache`; ``ftitan.infer.prefill`` / ``decode_step``
    keep ``start``/``end`` and the positions in step.
    """

    layers: Mapping[str, Mapping[str, torch.Tensor]]
    start: torch.Tensor
    end: torch.Tensor
    limit: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        """``S``: slots per row (prompt plus generated tokens must fit; unbounded without attention layers)."""
        return next((entry["k"].shape[1] for entry in self.layers.values() if "k" in entry), 2**62)

    def recur(self, layer: int, scan: Any, inputs: Any) -> tuple[Any, KVCache]:
        """Run recurrent layer ``layer``'s ``scan`` (``base.RecurrentCache``) over the new tokens at slots
        ``end ..`` from the state this cache holds; only tokens inside each row's span change the state."""
        return self.scan_and_keep(layer, scan, inputs, inplace=False)

    def scan_and_keep(self, layer: int, scan: Any, inputs: Any, *, inplace: bool) -> tuple[Any, KVCache]:
        """:meth:`recur`, the new state in new tensors, or (``inplace``) copied into this cache's own."""
        state = self.layers[str(layer)]
        t = tree.leaves(inputs)[0].shape[1]
        slot = self.end[:, None] + torch.arange(t, device=self.end.device)  # (B, T)
        valid = slot >= self.start[:, None]
        if self.limit is not None:
            valid = valid & (slot < self.limit[:, None])
        out, new = scan(inputs, state, valid)
        if inplace:
            new = tree.map(lambda buf, x: buf.copy_(x), dict(state), dict(new))
        layers = {**self.layers, str(layer): new}
        return out, KVCache(layers, self.start, self.end, self.limit)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # (B, T, H, Dk) the new tokens' queries
        k: torch.Tensor,  # (B, T, KV, Dk)
        v: torch.Tensor,  # (B, T, KV, Dv)
        *,
        impl: nn.AttentionImpl = "sdpa",
        causal: bool = True,
        scale: float | None = None,
        window: int | None = None,  # sliding window: a query sees its `window` most recent slots, itself included
    ) -> tuple[torch.Tensor, KVCache]:  # (B, T, H, Dv), the cache with layer's k/v written
        """Write ``k``/``v`` at slots ``end .. end + T - 1`` of each row, then attend over the row's slots."""
        return self.write_and_attend(layer, q, k, v, inplace=False, impl=impl, causal=causal, scale=scale,
                                     window=window)  # fmt: skip

    def write_and_attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        inplace: bool,
        impl: nn.AttentionImpl = "sdpa",
        causal: bool = True,
        scale: float | None = None,
        window: int | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """:meth:`attend`, writing into new buffers, or (``inplace``) into this cache's own: see
        :class:`Donated`."""
        if not causal:
            raise ValueError("KVCache.attend: a KV cache serves causal attention only (causal=True)")
        b, t = k.shape[:2]
        s = self.slots
        slot = self.end[:, None] + torch.arange(t, device=k.device)  # (B, T) where each new token goes
        entry = self.layers[str(layer)]
        where = (torch.arange(b, device=k.device)[:, None].expand(b, t), slot)  # (row, slot) of each new token
        written = []
        for buf, new in ((entry["k"], k), (entry["v"], v)):
            new = new.to(buf.dtype)
            written.append(buf.index_put_(where, new) if inplace else buf.index_put(where, new))
        keys, values = written
        key_slot = torch.arange(s, device=k.device)
        ks, vs = keys, values
        if impl == nn.invariant.IMPL:  # its reductions run in blocks from key 0: rotate each row's start there
            logical = (self.start[:, None] + key_slot) % s  # (B, S): slot of the row's j-th key
            ks, vs = (buf.gather(1, logical[:, :, None, None].expand_as(buf)) for buf in (keys, values))
            # the mask below, rotated: key j of a query ``past`` slots after its row's start is visible if
            # j <= past, and a padding query (past < 0) sees itself, now key past + S (two comparisons:
            # inductor inlines the mask into every use, and a gathered one costs a modulo per element there)
            past = (slot - self.start[:, None])[:, :, None]  # (B, T, 1)
            mask = (key_slot <= past) | (key_slot == past + s)
            if window is not None:  # slots are contiguous positions: the window is a slot distance
                mask = mask & (key_slot > past - window)
        else:
            mask = (key_slot >= self.start[:, None, None]) & (key_slot <= slot[:, :, None])  # (B, T, S)
            if window is not None:
                mask = mask & (key_slot > slot[:, :, None] - window)
            mask = mask | (key_slot == slot[:, :, None])  # a padding query (before start) sees itself
        o = nn.attention(q, ks.to(q.dtype), vs.to(q.dtype), impl=impl, causal=False, scale=scale, mask=mask)
        layers = {**self.layers, str(layer): {"k": keys, "v": values}}
        return o, KVCache(layers, self.start, self.end, self.limit)


class Donated:
    """A :class:`KVCache` given up by its caller: layers write the new keys/values into its own
    buffers (an in-place scatter of ``T`` slots) instead of new copies of the whole cache.

    The values computed are those of the pure path, bit for bit; only the input cache is
    consumed (JAX's buffer donation). ``prefill`` / ``decode_step`` built with ``donate=True``
    wrap the cache in it; ``generate`` does, since it never looks at an old cache again.
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, Donated]:
        o, self.cache = self.cache.write_and_attend(layer, q, k, v, inplace=True, **kwargs)
        return o, self

    def recur(self, layer: int, scan: Any, inputs: Any) -> tuple[Any, Donated]:
        out, self.cache = self.cache.scan_and_keep(layer, scan, inputs, inplace=True)
        return out, self


class _ShapeProbe:
    """An ``AttentionCache`` that records each layer's key/value shapes (plain causal attention), and each
    recurrent layer's state (from zeros)."""

    def __init__(self) -> None:
        self.kv: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = {}
        self.states: dict[str, Any] = {}

    def recur(self, layer: int, scan: Any, inputs: Any) -> tuple[Any, _ShapeProbe]:
        out, self.states[str(layer)] = scan(inputs, None, None)
        return out, self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> tuple[
            torch.Tensor, _ShapeProbe]:  # fmt: skip
        self.kv[str(layer)] = (tuple(k.shape[2:]), tuple(v.shape[2:]), k.dtype)
        return nn.attention(q, k, v, **kwargs), self


@torch.no_grad()
def init_cache(
    model: Any,
    params: Any,
    *,
    batch: int,
    slots: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> KVCache:
    """An empty :class:`KVCache` of ``slots`` positions for ``batch`` rows of ``model``.

    The per-layer key/value shapes come from the model itself (one
    single-token ``apply`` that records what each layer attends with), so
    every family (GQA, MLA) gets the cache its attention needs. ``dtype``
    defaults to the keys' dtype (the params'), ``device`` to the embedding's.
    """
    if batch < 1 or slots < 1:
        raise ValueError(f"init_cache: batch={batch} and slots={slots} must be >= 1")
    device = params["embed"].device if device is None else device
    probe = _ShapeProbe()
    model.apply(params, torch.zeros(1, 1, dtype=torch.long, device=device), cache=probe, logits=False)
    if not probe.kv and not probe.states:
        raise ValueError("init_cache: the model's apply never called cache.attend or cache.recur; it has no "
                         "attention or recurrent state to cache")  # fmt: skip
    layers: dict[str, Any] = {
        name: {
            "k": torch.zeros(batch, slots, *k_shape, dtype=dtype or kv_dtype, device=device),
            "v": torch.zeros(batch, slots, *v_shape, dtype=dtype or kv_dtype, device=device),
        }
        for name, (k_shape, v_shape, kv_dtype) in probe.kv.items()
    }
    for name, state in probe.states.items():  # zeros: the state before any token (one row probed, B kept)
        layers[name] = tree.map(lambda x: torch.zeros(batch, *x.shape[1:], dtype=x.dtype, device=device), state)
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    return KVCache(layers, zeros, zeros.clone())
