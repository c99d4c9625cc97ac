"""Blockwise quantization for parameter all-gathers: int8 and fp8 (e4m3) values with a float32 scale per block.

A tensor (..., n) is cut into blocks along its last dim (``block``: 128 values of a row, or ``(128, 128)``
tiles of the last two dims); each block is divided by its scale, ``amax / qmax`` (127 for int8, 448 for
e4m3), and rounded to the format. Dequantizing multiplies back: the error of a value is at most half a
step of its block's grid (int8: ``amax / 254``; e4m3: a relative ``2 ** -4`` of the value, or ``2 ** -10``
of its block's amax near zero). The pure-torch reference of the kernels issue's Triton quantizer.

:func:`encode` / :func:`decode` put a part's values and scales in one ``uint8`` buffer: what a FlexShard
bucket all-gathers instead of its float parts, so the scales need no collective of their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ftitan.kernels import op

__all__ = ["BLOCK", "FORMATS", "Block", "decode", "decode_rows", "dequantize", "dequantize_reference", "encode",
           "encoded_bytes", "error_bound", "n_scales", "quantize", "quantize_reference"]  # fmt: skip

# format -> (storage dtype, largest representable magnitude)
FORMATS: dict[str, tuple[torch.dtype, float]] = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
Block = int | tuple[int, int]  # values of a row per block, or (rows, cols) tiles of the last two dims
BLOCK = 128  # the default: 128 values of a row per scale


def _check(fmt: str, block: Block) -> tuple[int, int]:
    if fmt not in FORMATS:
        raise ValueError(f"quantize: format {fmt!r}; expected one of {sorted(FORMATS)}")
    rows, cols = (1, block) if isinstance(block, int) else block
    if rows < 1 or cols < 1:
        raise ValueError(f"quantize: block {block!r} must be positive")
    return rows, cols


def _tiles(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` as (..., R, rows, C, cols) tiles of its last two dims (a vector: one row), zero-padded."""
    x2 = x.reshape(1, -1) if x.ndim < 2 else x
    m, n = x2.shape[-2], x2.shape[-1]
    pm, pn = -m % rows, -n % cols
    if pm or pn:
        x2 = torch.nn.functional.pad(x2, (0, pn, 0, pm))
    return x2.reshape(*x2.shape[:-2], (m + pm) // rows, rows, (n + pn) // cols, cols)


def _untile(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """:func:`_tiles`' inverse: (..., R, rows, C, cols) tiles back to a tensor of ``shape`` (padding cut)."""
    m, n = (1, math.prod(shape)) if len(shape) < 2 else (shape[-2], shape[-1])
    whole = t.reshape(*t.shape[:-4], t.shape[-4] * t.shape[-3], t.shape[-2] * t.shape[-1])
    return whole[..., :m, :n].reshape(tuple(shape))


def _scales(t: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, scale)`` of each tile of ``t`` (broadcastable to it): ``amax / qmax``, 1 for an all-zero tile."""
    amax = t.abs().amax(dim=(-3, -1), keepdim=True)
    return amax, torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def n_scales(shape: Sequence[int], block: Block) -> int:
    """How many blocks (scales) a tensor of ``shape`` has."""
    rows, cols = (1, block) if isinstance(block, int) else block
    shape = (1, *shape) if len(shape) < 2 else tuple(shape)
    return math.prod(shape[:-2]) * -(-shape[-2] // rows) * -(-shape[-1] // cols)


def quantize(x: torch.Tensor, fmt: str, block: Block = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: ``x``'s values in ``fmt`` (``x``'s shape) and one float32 scale per block
    (``(n_scales,)``). An all-zero block gets scale 1 (its values stay 0). Where
    ``ftitan.kernels.op.use_kernel(x)`` (CUDA), the Triton kernel ``ftitan.kernels.quantize``: bit-identical."""
    _check(fmt, block)
    if op.use_kernel(x):
        from ftitan.kernels import quantize as kernel  # (imports triton)

        return kernel.quantize(x, fmt, block)
    return quantize_reference(x, fmt, block)


def quantize_reference(x: torch.Tensor, fmt: str, block: Block = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` in torch ops: the definition the kernel is tested against."""
    rows, cols = _check(fmt, block)
    dtype, qmax = FORMATS[fmt]
    t = _tiles(x.detach().float(), rows, cols)
    _, scale = _scales(t, qmax)
    y = t / scale
    q = y.round().clamp(-qmax, qmax).to(dtype) if fmt == "int8" else y.clamp(-qmax, qmax).to(dtype)
    return _untile(q, x.shape), scale.reshape(-1)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: Block = BLOCK, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:  # fmt: skip
    """:func:`quantize`'s inverse up to rounding: ``values * scale`` of each block, in ``dtype`` (the Triton
    kernel ``ftitan.kernels.quantize`` where ``ftitan.kernels.op.use_kernel``: bit-identical)."""
    if op.use_kernel(q, scales):
        from ftitan.kernels import quantize as kernel  # (imports triton)

        return kernel.dequantize(q, scales, block, dtype)
    return dequantize_reference(q, scales, block, dtype)


def dequantize_reference(q: torch.Tensor, scales: torch.Tensor, block: Block = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """:func:`dequantize` in torch ops: the definition the kernel is tested against."""
    rows, cols = (1, block) if isinstance(block, int) else block
    t = _tiles(q.float(), rows, cols)
    y = t * scales.reshape(*t.shape[:-4], t.shape[-4], 1, t.shape[-2], 1)
    return _untile(y, q.shape).to(dtype)


def error_bound(x: torch.Tensor, fmt: str, block: Block = BLOCK) -> torch.Tensor:
    """The largest error :func:`quantize` then :func:`dequantize` may make on each value of ``x``: half a
    step of its block's grid (int8: ``scale / 2``; e4m3: ``2 ** -4`` of the value, at least the smallest
    subnormal step's half, ``2 ** -10 * scale``), plus ``2 ** -20`` of the block's amax (the float32
    rounding of dividing by the scale and multiplying back)."""
    rows, cols = _check(fmt, block)
    _, qmax = FORMATS[fmt]
    t = _tiles(x.detach().float(), rows, cols)
    amax, scale = _scales(t, qmax)
    bound = scale / 2 if fmt == "int8" else torch.maximum(t.abs() * 2.0**-4, scale * 2.0**-10)
    bound = bound + amax * 2.0**-20  # the float32 rounding of the division and the product: a few ulps of amax
    return _untile(bound.expand_as(t), x.shape)


def encoded_bytes(shape: Sequence[int], block: Block) -> int:
    """Bytes of :func:`encode`'s buffer for a tensor of ``shape``: a byte per value, 4 per scale."""
    return math.prod(shape) + 4 * n_scales(shape, block) if math.prod(shape) else 0


def encode(x: torch.Tensor, fmt: str, block: Block = BLOCK) -> torch.Tensor:
    """``x`` quantized, as one flat ``uint8`` buffer: its values' bytes, then its scales' (float32)."""
    if not x.numel():
        return torch.zeros(0, dtype=torch.uint8, device=x.device)
    q, scales = quantize(x, fmt, block)
    return torch.cat([q.reshape(-1).view(torch.uint8), scales.view(torch.uint8)])


def decode(buf: torch.Tensor, shape: Sequence[int], fmt: str, block: Block = BLOCK,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """:func:`encode`'s buffer (of a tensor of ``shape``) back to values in ``dtype``."""
    return decode_rows(buf[None], shape, fmt, block, dtype)[0]


def decode_rows(bufs: torch.Tensor, shape: Sequence[int], fmt: str, block: Block = BLOCK,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """:func:`decode` of each row of ``bufs`` (``(k, encoded_bytes(shape, block))``: ``k`` buffers of tensors
    of ``shape``, e.g. every rank's part of a leaf in an all-gather's result) in one dequantization:
    ``(k, *shape)`` in ``dtype``. Each row's values and scales are multiplied as its own :func:`decode` would
    (a vector is one row of blocks, as :func:`quantize` tiles it), so the values are the same."""
    n, k = math.prod(shape), bufs.shape[0]
    if not n:
        return torch.zeros((k, *shape), dtype=dtype, device=bufs.device)
    matrix = tuple(shape) if len(shape) >= 2 else (1, n)
    q = bufs[:, :n].view(FORMATS[fmt][0]).reshape(k, *matrix)
    scales = bufs[:, n : n + 4 * n_scales(shape, block)].contiguous().view(torch.float32)  # (a copy: 4-byte aligned)
    return dequantize(q, scales.reshape(-1), block, dtype).reshape(k, *shape)
