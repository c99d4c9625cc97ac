"""Explicit, traceable random keys, in the spirit of ``jax.random``.

A key is a 0-d ``int64`` tensor. Keys are derived, never advanced:
``split(key, n)`` and ``fold_in(key, data)`` hash the parent key with a
counter through the SplitMix64 finalizer (Steele et al. 2014, "Fast
splittable pseudorandom number generators"), so a value drawn from a key
depends only on that key. Initializing ``layers.3.attn.wq`` from
``fold_in(key, "layers.3.attn.wq")`` therefore gives the same bits on every
run, in every process, whatever the number of devices the tree is later
sharded over.

Draws are counter-based (Salmon et al. 2011, "Parallel random numbers: as
easy as 1, 2, 3"): element ``i`` (row-major flat index into ``shape``) is a
function of the key and ``i`` alone, namely the 64-bit hash
``mix(mix((key + i) * G) ^ key)`` (``mix`` = SplitMix64's ``z += G`` and
finalizer, ``G`` its golden-ratio increment), turned into a float. So any
block of a draw can be computed without the rest (``block=``), which is
what per-rank sharded init builds on, and an eager draw of a big leaf is
computed in pieces (of rows, or of a row) to bound memory.

Everything is int64 tensor arithmetic (multiplication wraps; right shifts
are masked to be logical): no key value is read back into Python, so keys,
``fold_in``, ``split`` and draws work eagerly, under ``torch.func.vmap``
(batched keys: ``vmap(model.init)(keys)``) and under
``torch.compile(fullgraph=True)``, with the same bits (inductor: same hash
bits, floats within ~1 ulp, its vectorized log/cos round differently). On the ``meta``
device a draw only builds the shape. Draws run on the requested device;
the integer hashes are identical on every device, the float transforms
(log, cos, ndtri) are bitwise identical on one device type and may differ
in the last ulp between CPU and CUDA.

Changed on 2026-12-04: draws used to come from a CPU ``torch.Generator``
seeded from the key. Keys (``key``, ``fold_in``, ``split``) keep their
values, but every draw from them (so every freshly initialized parameter)
differs from before, still deterministic. Checkpoints store values and are
unaffected.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "bits",
    "exponential",
    "fold_in",
    "key",
    "key_data",
    "normal",
    "split",
    "truncated_normal",
    "uniform",
]

_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 24  # elements per piece of an eager draw on an accelerator (bounds memory)
_CPU_CHUNK = 1 << 18  # ... on CPU: its int64 temporaries (2 MiB each) stay in cache, ~4x faster


def _signed(u: int) -> int:
    """An unsigned 64-bit Python int as the int64 with the same bits."""
    u &= _MASK64
    return u - (1 << 64) if u >= (1 << 63) else u


_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / golden ratio, odd
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64 finalizer multipliers
_GAMMA_S, _M1_S, _M2_S = _signed(_GAMMA), _signed(_M1), _signed(_M2)


def _mix_int(z: int) -> int:
    """SplitMix64 step on a Python int (Steele et al. 2014): ``z + G``, then the bijective finalizer."""
    z = (z + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic: mask off the sign copies)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """``_mix_int`` as int64 tensor arithmetic (wrapping multiply, logical shifts); elementwise."""
    z = z + _GAMMA_S
    z = (z ^ _shr(z, 30)) * _M1_S
    z = (z ^ _shr(z, 27)) * _M2_S
    return z ^ _shr(z, 31)


def key(seed: int) -> torch.Tensor:
    """A key from an integer seed: a 0-d int64 tensor."""
    if not isinstance(seed, int):
        raise TypeError(f"key(seed): seed must be an int, got {type(seed).__name__}")
    return torch.tensor(_signed(_mix_int(seed & _MASK64)), dtype=torch.int64)


def _check_key(k: object, where: str) -> torch.Tensor:
    if not (isinstance(k, torch.Tensor) and k.dtype == torch.int64 and k.dim() == 0):
        raise TypeError(
            f"{where}: expected a key (0-d int64 tensor from ftitan.random.key), got {k!r}; "
            f"for several keys from split(key, n), pass one of them (keys[i]) or vmap over them"
        )
    return k


def key_data(k: torch.Tensor) -> int:
    """The key's 64 bits as a non-negative Python int (eager only: reads the value back)."""
    return int(_check_key(k, "key_data").item()) & _MASK64


def _str_int(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "little")


# a str is static under tracing and dynamo cannot trace hashlib: the result is a constant to it. This is what
# ``torch.compiler.assume_constant_result`` sets (tests/test_random.py checks that it still is); the decorator
# imports torch._dynamo, ~2 s of every process's ``import ftitan``, even of one that never compiles
_str_int._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _data_int(data: int | str) -> int:
    return _str_int(data) if isinstance(data, str) else data & _MASK64


def fold_in(k: torch.Tensor, data: int | str | torch.Tensor) -> torch.Tensor:
    """A new key ``mix(k ^ mix(data))`` from ``k`` and ``data``.

    ``data`` is an int, a string (e.g. a parameter path; hashed with
    BLAKE2b in Python, so static under tracing) or a 0-d integer tensor
    (e.g. a step counter inside compiled code). ``fold_in(k, i)`` equals
    ``fold_in(k, torch.tensor(i))`` and ``split(k, n)[i]``.
    """
    _check_key(k, "fold_in")
    if isinstance(data, torch.Tensor):
        if data.dim() != 0 or data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
            raise TypeError(
                f"fold_in: data must be an int, a str or a 0-d integer tensor, got a {data.dtype} tensor "
                f"of shape {tuple(data.shape)}; for many keys use split(key, n)"
            )
        return _mix(k ^ _mix(data.to(device=k.device, dtype=torch.int64)))
    if not isinstance(data, (int, str)) or isinstance(data, bool):
        raise TypeError(f"fold_in: data must be an int, a str or a 0-d integer tensor, got {type(data).__name__}")
    return _mix(k ^ _signed(_mix_int(_data_int(data))))


def split(k: torch.Tensor, n: int = 2) -> torch.Tensor:
    """``n`` independent keys derived from ``k``, as an ``(n,)`` int64 tensor.

    Unpack or index it like JAX's: ``a, b = split(k)``, ``split(k, 3)[i]``
    (a 0-d key); key ``i`` is ``fold_in(k, i)``.
    """
    _check_key(k, "split")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"split: n must be an int >= 1, got {n!r}")
    return _mix(k ^ _mix(torch.arange(n, dtype=torch.int64, device=k.device)))


# ---- counter-based draws -------------------------------------------------------------------------

Block = Sequence[tuple[int, int]]


def _spans(shape: tuple[int, ...], block: Block | None, where: str) -> list[tuple[int, int]]:
    """(start, stop) per dim: the block's leading dims, the rest whole."""
    block = list(block or ())
    if len(block) > len(shape):
        raise ValueError(f"{where}: block {block} names {len(block)} dims but shape {shape} has {len(shape)}")
    spans = [(int(lo), int(hi)) for lo, hi in block] + [(0, d) for d in shape[len(block) :]]
    for dim, ((lo, hi), size) in enumerate(zip(spans, shape, strict=True)):
        if not 0 <= lo <= hi <= size:
            raise ValueError(
                f"{where}: block dim {dim} is ({lo}, {hi}) but shape {shape} has {size} there; "
                f"give 0 <= start <= stop <= {size}"
            )
    return spans


def _flat_index(shape: tuple[int, ...], spans: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Row-major flat indices into ``shape`` of the block ``spans``, shaped like the block."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = math.prod(shape)
    for (lo, hi), size in zip(spans, shape, strict=True):
        stride //= size
        index = index[..., None] + torch.arange(lo, hi, dtype=torch.int64, device=device) * stride
    return index


def _hash(k: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """64 random bits per element: output ``index`` of SplitMix64 seeded with ``k*G``, re-mixed
    with ``k`` (so keys ``k`` and ``k + j`` do not give shifted copies of one stream).

    ``(k + index) * G`` rather than ``k*G + index*G``: inductor folds ``index * G`` into its
    symbolic index arithmetic, which overflows int64 at codegen.
    """
    return _mix(_mix((k + index) * _GAMMA_S) ^ k)


def _is_traced(k: torch.Tensor) -> bool:
    # under compile or a functorch transform (vmap, grad) draw in one piece: no in-place chunk writes
    return torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(k)


def _chunk(device: torch.device) -> int:
    # CPU: pieces whose int64 temporaries stay in cache (faster than one pass over a big leaf);
    # accelerators: big pieces, few kernel launches. Either way memory stays bounded.
    return _CPU_CHUNK if device.type == "cpu" else _CHUNK


def _fill(
    out: torch.Tensor,
    k: torch.Tensor,
    shape: tuple[int, ...],
    spans: list[tuple[int, int]],
    transform: Callable[[torch.Tensor], torch.Tensor],
    dim: int = 0,
) -> None:
    """Write the block ``spans`` into ``out`` piecewise: runs of dim ``dim``, recursing into the
    next dim when one slice of ``dim`` is itself too big (the dims before ``dim`` have extent 1)."""
    chunk = _chunk(out.device)
    if out.numel() <= chunk or dim == out.dim():
        out.copy_(transform(_hash(k, _flat_index(shape, spans, out.device))))
        return
    lo, hi = spans[dim]
    step = max(1, chunk // max(1, math.prod(out.shape[dim + 1 :])))
    for start in range(lo, hi, step):
        stop = min(start + step, hi)
        piece = [*spans[:dim], (start, stop), *spans[dim + 1 :]]
        _fill(out.narrow(dim, start - lo, stop - start), k, shape, piece, transform, dim + 1)


def _draw(
    k: torch.Tensor,
    shape: Sequence[int],
    block: Block | None,
    dtype: torch.dtype,
    device: torch.device | str | None,
    transform: Callable[[torch.Tensor], torch.Tensor],  # int64 hashes -> values (float32 or int64)
    where: str,
) -> torch.Tensor:
    """``transform(_hash(k, i))`` over the block of ``shape``, cast to ``dtype``; piecewise when eager."""
    _check_key(k, where)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{where}: shape {shape} has a negative dim")
    spans = _spans(shape, block, where)
    out_shape = tuple(hi - lo for lo, hi in spans)
    device = k.device if device is None else torch.device(device)
    if device.type == "meta":
        return torch.empty(out_shape, dtype=dtype, device="meta")
    k = k.to(device)
    if _is_traced(k) or math.prod(out_shape) <= _chunk(device):
        return transform(_hash(k, _flat_index(shape, spans, device))).to(dtype)
    out = torch.empty(out_shape, dtype=dtype, device=device)
    _fill(out, k, shape, spans, transform)
    return out


def _unit(h: torch.Tensor) -> torch.Tensor:
    """float32 in ``[0, 1)``: the top 24 bits times 2^-24 (exact)."""
    return _shr(h, 40).to(torch.float32) * 2.0**-24


def _open_unit(h: torch.Tensor) -> torch.Tensor:
    """float32 in the open ``(0, 1)``: the top 23 bits as the odd multiple ``(2m + 1) * 2^-24`` (exact),
    so the extremes ``2^-24`` and ``1 - 2^-24`` keep logs finite."""
    return (_shr(h, 41) * 2 + 1).to(torch.float32) * 2.0**-24


def _standard_normal(h: torch.Tensor) -> torch.Tensor:
    """Box-Muller (Box & Muller 1958) from one hash: radius from the high 32 bits (open interval),
    angle from the low 32 bits; ``|z| <= sqrt(48 ln 2) ~ 5.77``."""
    radius = torch.sqrt(-2.0 * torch.log(_open_unit(h)))
    angle = ((h >> 8) & 0xFFFFFF).to(torch.float32) * (2.0 * math.pi * 2.0**-24)
    return radius * torch.cos(angle)


def bits(
    k: torch.Tensor,
    shape: Sequence[int],
    *,
    block: Block | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The raw 64-bit hashes (int64) behind every draw: element ``i`` is ``mix(mix((k + i) * G) ^ k)``.

    ``block=((start, stop), ...)`` gives the sub-block ``full[start:stop, ...]`` of the full
    draw of ``shape`` (leading dims; the rest whole) without computing the rest; this holds for
    every draw function below.
    """
    return _draw(k, shape, block, torch.int64, device, lambda h: h, "bits")


def normal(
    k: torch.Tensor,
    shape: Sequence[int],
    *,
    std: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    block: Block | None = None,
) -> torch.Tensor:
    """Normal samples with standard deviation ``std`` (Box-Muller in float32, then cast).

    ``block``: see :func:`bits` (e.g. ``block=((r0, r1),)`` is rows ``r0:r1`` of the full draw).
    """
    return _draw(k, shape, block, dtype, device, lambda h: _standard_normal(h) * std, "normal")


def truncated_normal(
    k: torch.Tensor,
    shape: Sequence[int],
    *,
    std: float = 1.0,
    bound: float = 3.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    block: Block | None = None,
) -> torch.Tensor:
    """Normal samples truncated to ``[-bound*std, bound*std]`` (TorchTitan's init).

    Inverse CDF restricted to the interval: ``ndtri(Phi(-bound) + u * (Phi(bound) - Phi(-bound)))``
    with ``u`` in the open ``(0, 1)``; no rejection loop, so it vmaps and compiles. ``block``: see
    :func:`bits`.
    """
    if not 0.0 < bound < math.inf:
        raise ValueError(f"truncated_normal: bound={bound} must be finite and > 0 (in units of std)")
    low = 0.5 * math.erfc(bound / math.sqrt(2.0))  # Phi(-bound), accurate in the tail
    width = math.erf(bound / math.sqrt(2.0))  # Phi(bound) - Phi(-bound)

    def transform(h: torch.Tensor) -> torch.Tensor:
        z = torch.special.ndtri(low + _open_unit(h) * width)
        return z.clamp(-bound, bound) * std

    return _draw(k, shape, block, dtype, device, transform, "truncated_normal")


def uniform(
    k: torch.Tensor,
    shape: Sequence[int],
    *,
    low: float = 0.0,
    high: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    block: Block | None = None,
) -> torch.Tensor:
    """Uniform samples in ``[low, high)`` (24 random bits; ``block``: see :func:`bits`)."""
    return _draw(k, shape, block, dtype, device, lambda h: _unit(h) * (high - low) + low, "uniform")


def exponential(
    k: torch.Tensor,
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    block: Block | None = None,
) -> torch.Tensor:
    """Exponential(1) samples ``-log(u)``, ``u`` in the open ``(0, 1)``: never 0, never inf.

    The noise of the exponential race ``argmax(p / E)``, which draws index ``i`` with probability
    ``p_i / sum(p)``. ``block``: see :func:`bits`.
    """
    return _draw(k, shape, block, dtype, device, lambda h: -torch.log(_open_unit(h)), "exponential")
