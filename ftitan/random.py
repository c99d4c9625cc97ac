"""Explicit random keys, in the spirit of ``jax.random``.

A key is a 0-d ``int64`` tensor. Keys are derived, never advanced:
``split(key, n)`` and ``fold_in(key, data)`` hash the parent key with a
counter (SplitMix64), so a value drawn from a key depends only on that key.
Initializing ``layers.3.attn.wq`` from ``fold_in(key, "layers.3.attn.wq")``
therefore gives the same bits on every run, in every process, whatever the
number of devices the tree is later sharded over.

Sampling draws on a CPU ``torch.Generator`` seeded from the key (bitwise
reproducible across machines) and then moves to the requested device; on the
``meta`` device it only builds the shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

__all__ = ["exponential", "fold_in", "key", "key_data", "normal", "split", "truncated_normal", "uniform"]

_MASK64 = (1 << 64) - 1


def _mix(z: int) -> int:
    # SplitMix64 finalizer (Steele et al. 2014): a bijective avalanche over 64 bits
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _to_signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def key(seed: int) -> torch.Tensor:
    """A key from an integer seed."""
    if not isinstance(seed, int):
        raise TypeError(f"key(seed): seed must be an int, got {type(seed).__name__}")
    return torch.tensor(_to_signed(_mix(seed & _MASK64)), dtype=torch.int64)


def key_data(k: torch.Tensor) -> int:
    """The key's 64 bits as a non-negative Python int."""
    if not (isinstance(k, torch.Tensor) and k.dtype == torch.int64 and k.dim() == 0):
        raise TypeError(f"expected a key (0-d int64 tensor from ftitan.random.key), got {k!r}")
    return int(k.item()) & _MASK64


def fold_in(k: torch.Tensor, data: int | str) -> torch.Tensor:
    """A new key derived from ``k`` and an int or a string (e.g. a parameter path)."""
    if isinstance(data, str):
        data = int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "little")
    return torch.tensor(_to_signed(_mix(key_data(k) ^ _mix(data & _MASK64))), dtype=torch.int64)


def split(k: torch.Tensor, n: int = 2) -> list[torch.Tensor]:
    """``n`` independent keys derived from ``k``."""
    return [fold_in(k, i) for i in range(n)]


def _generator(k: torch.Tensor) -> torch.Generator:
    # manual_seed takes 64 bits; keep it in the signed range torch accepts everywhere
    return torch.Generator(device="cpu").manual_seed(key_data(k) >> 1)


def normal(
    k: torch.Tensor,
    shape: Sequence[int],
    *,
    std: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Normal samples with standard deviation ``std`` (drawn in float32, then cast)."""
    if torch.device(device or "cpu").type == "meta":
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    x = torch.randn(tuple(shape), generator=_generator(k), dtype=torch.float32)
    if std != 1.0:
        x.mul_(std)
    return x.to(dtype=dtype, device=device)


def truncated_normal(
    k: torch.Tensor,
    shape: Sequence[int],
    *,
    std: float = 1.0,
    bound: float = 3.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Normal samples truncated to ``[-bound*std, bound*std]`` (as TorchTitan's init)."""
    if torch.device(device or "cpu").type == "meta":
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    x = torch.empty(tuple(shape), dtype=torch.float32)
    torch.nn.init.trunc_normal_(x, std=std, a=-bound * std, b=bound * std, generator=_generator(k))
    return x.to(dtype=dtype, device=device)


def uniform(
    k: torch.Tensor,
    shape: Sequence[int],
    *,
    low: float = 0.0,
    high: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Uniform samples in ``[low, high)``."""
    if torch.device(device or "cpu").type == "meta":
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    x = torch.rand(tuple(shape), generator=_generator(k), dtype=torch.float32)
    return (x * (high - low) + low).to(dtype=dtype, device=device)


def exponential(
    k: torch.Tensor,
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Exponential(1) samples (the noise of the exponential race ``argmax(p / E)``, which draws
    index ``i`` with probability ``p_i / sum(p)``)."""
    if torch.device(device or "cpu").type == "meta":
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    x = torch.empty(tuple(shape), dtype=torch.float32).exponential_(generator=_generator(k))
    return x.to(dtype=dtype, device=device)
