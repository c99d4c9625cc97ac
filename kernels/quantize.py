"""Blockwise int8 / fp8 (e4m3) quantize and dequantize as Triton kernels (``ftitan.kernels.quantize``).

The reference is ``ftitan.flexshard.quant`` (:func:`quantize_reference`,
:func:`dequantize_reference`): a tensor ``(..., m, n)`` cut into ``(rows, cols)``
blocks of its last two dims (a vector: one row), one float32 scale per block,
``amax / qmax`` (127 for int8, 448 for e4m3; 1 for an all-zero block), values
divided by their scale and rounded to the format (int8: round half to even, then
clamped to +-127; e4m3: clamped to +-448, then rounded to nearest even, subnormals
included). The kernels are *bit-identical* to it, so a quantized FlexShard
gather sends the same bytes whichever runs:

- the divisions are IEEE round-to-nearest (``tl.math.div_rn``: Triton's ``/`` is
  an approximate division on CUDA);
- the roundings are written out in exact float32 / integer steps rather than
  left to a conversion instruction (Triton's interpreter rounds fp32 -> e4m3
  half-up and truncates subnormals): int8 ``rint`` from the integer and fractional
  parts; e4m3 from the value's binade (its quantum ``2 ** (e - 3)``, ``2 ** -9``
  below the smallest normal ``2 ** -6``), ``rint`` of the value in quanta, and the
  byte assembled from the rounded value's float32 bits. fp8 travels as its bytes
  (``uint8``) and is viewed as ``torch.float8_e4m3fn`` outside the kernel;
- dequantize decodes the bytes the same way, multiplies in float32 and returns
  float32; a ``dtype`` other than float32 is a torch cast after it (the
  reference's ``.to(dtype)``, so the rounding is torch's).

Each program quantizes ``G`` vertically adjacent blocks of one block column
(about 4096 values in all), so ``1 x 128`` row blocks and ``128 x 128`` tiles both
give programs of a useful size; the grid is one-dimensional (no 65535 limit on
the block columns). No gradients: FlexShard quantizes parameters inside its
packed gather's ``autograd.Function``, whose backward passes the gradient
straight through (``ftitan.flexshard.packed``), so there is no autograd here.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ftitan.flexshard import quant
from ftitan.kernels import op

__all__ = ["dequantize", "dequantize_reference", "quantize", "quantize_reference"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel loads (others: cast to float32 first)
_TILE = 4096  # values a program handles (G blocks of one block column)


@triton.jit
def _rint(v):
    """Round half to even of ``v >= 0`` (< 2 ** 31) as int32, in exact steps."""
    f = v.to(tl.int32)  # floor for v >= 0
    frac = v - f.to(tl.float32)  # exact: both multiples of v's ulp
    up = (frac > 0.5) | ((frac == 0.5) & ((f & 1) == 1))
    return f + up.to(tl.int32)


@triton.jit
def _pow2(e):
    """``2.0 ** e`` (float32) for an int32 ``-126 <= e <= 127``."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_byte(y):
    """The float8_e4m3fn byte (int32 0..255) of float32 ``y``: clamped to +-448, rounded to nearest even."""
    a = tl.minimum(tl.abs(y), 448.0)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # binade, at least the normals' -6
    n = _rint(a * _pow2(3 - e))  # the value in quanta of 2 ** (e - 3): 0..16
    r = n.to(tl.float32) * _pow2(e - 3)  # the rounded magnitude (exact)
    rbits = r.to(tl.int32, bitcast=True)
    re = ((rbits >> 23) & 0xFF) - 127
    normal = ((re + 7) << 3) | ((rbits >> 20) & 7)
    sub = (r * 512.0).to(tl.int32)  # subnormal: r in quanta of 2 ** -9
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return tl.where(re >= -6, normal, sub) | (sign << 7)


@triton.jit
def _e4m3_value(b):
    """The float32 value of float8_e4m3fn bytes ``b`` (int32 0..255)."""
    e = (b >> 3) & 15
    m = b & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (m + 8).to(tl.float32) * _pow2(e - 10))
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where((b >> 7) == 1, -mag, mag)


@triton.jit
def _block_offsets(pid, M, N, R, C, BR, ROWS: tl.constexpr, COLS: tl.constexpr, RP: tl.constexpr,
                   CP: tl.constexpr, G: tl.constexpr):  # fmt: skip
    """The (G, RP, CP) offsets and mask of program ``pid``'s blocks, and their (G,) scale indices and mask."""
    pid_g, pid_c = pid // C, pid % C
    g = pid_g * G + tl.arange(0, G)  # block rows over every (batch, block row) pair: (G,)
    b, br = (g // R).to(tl.int64), (g % R).to(tl.int64)
    r, c = tl.arange(0, RP), tl.arange(0, CP)
    row = br[:, None, None] * ROWS + r[None, :, None]  # (G, RP, 1)
    col = pid_c * COLS + c[None, None, :]  # (1, 1, CP)
    mask = (g[:, None, None] < BR) & (r[None, :, None] < ROWS) & (row < M) & (c[None, None, :] < COLS) & (col < N)
    offs = b[:, None, None] * M * N + row * N + col
    return offs, mask, g.to(tl.int64) * C + pid_c, g < BR


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, N, R, C, BR, QMAX: tl.constexpr, FP8: tl.constexpr, ROWS: tl.constexpr,
                     COLS: tl.constexpr, RP: tl.constexpr, CP: tl.constexpr, G: tl.constexpr):  # fmt: skip
    # x: (B, M, N) contiguous; blocks (ROWS, COLS) padded to (RP, CP); R x C blocks per matrix, BR = B * R
    offs, mask, s_offs, s_mask = _block_offsets(tl.program_id(0), M, N, R, C, BR, ROWS, COLS, RP, CP, G)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (G, RP, CP)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # (G,)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
    y = tl.math.div_rn(x, scale[:, None, None])
    if FP8:
        q = _e4m3_byte(y).to(tl.uint8)
    else:
        n = tl.minimum(_rint(tl.abs(y)), 127)
        q = tl.where(y < 0, -n, n).to(tl.int8)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + s_offs, scale, mask=s_mask)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, y_ptr, M, N, R, C, BR, FP8: tl.constexpr, ROWS: tl.constexpr,
                       COLS: tl.constexpr, RP: tl.constexpr, CP: tl.constexpr, G: tl.constexpr):  # fmt: skip
    offs, mask, s_offs, s_mask = _block_offsets(tl.program_id(0), M, N, R, C, BR, ROWS, COLS, RP, CP, G)
    raw = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)  # (G, RP, CP)
    v = _e4m3_value(raw & 0xFF) if FP8 else raw.to(tl.float32)
    scale = tl.load(s_ptr + s_offs, mask=s_mask, other=1.0)  # (G,)
    tl.store(y_ptr + offs, v * scale[:, None, None], mask=mask)


def _geometry(shape: torch.Size, rows: int, cols: int) -> tuple[dict[str, int], int]:
    """The kernels' sizes for a tensor of ``shape`` and its grid size."""
    shape = (1, math.prod(shape)) if len(shape) < 2 else tuple(shape)
    m, n = shape[-2], shape[-1]
    r, c = -(-m // rows), -(-n // cols)
    rp, cp = triton.next_power_of_2(rows), triton.next_power_of_2(cols)
    g = max(1, _TILE // (rp * cp))
    br = math.prod(shape[:-2]) * r
    sizes = dict(M=m, N=n, R=r, C=c, BR=br, ROWS=rows, COLS=cols, RP=rp, CP=cp, G=g)
    return sizes, -(-br // g) * c


def _quantize_impl(x: torch.Tensor, fmt: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    dtype, qmax = quant.FORMATS[fmt]
    x = x.contiguous()
    sizes, grid = _geometry(x.shape, rows, cols)
    q = torch.empty(x.shape, dtype=torch.uint8 if fmt == "fp8" else torch.int8, device=x.device)
    scales = torch.empty(quant.n_scales(x.shape, (rows, cols)), dtype=torch.float32, device=x.device)
    if x.numel():
        _quantize_kernel[(grid,)](x, q, scales, QMAX=qmax, FP8=fmt == "fp8", **sizes)
    return q.view(dtype), scales


def _quantize_fake(x: torch.Tensor, fmt: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    scales = x.new_empty(quant.n_scales(x.shape, (rows, cols)), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=quant.FORMATS[fmt][0]), scales


def _dequantize_impl(q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    fp8 = q.dtype == torch.float8_e4m3fn
    q = q.contiguous().view(torch.uint8) if fp8 else q.contiguous()
    sizes, grid = _geometry(q.shape, rows, cols)
    y = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if q.numel():
        _dequantize_kernel[(grid,)](q, scales.contiguous(), y, FP8=fp8, **sizes)
    return y


def _dequantize_fake(q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=torch.float32)


quantize_op = op.define("quantize", "(Tensor x, str fmt, int rows, int cols) -> (Tensor, Tensor)", _quantize_impl,
                        _quantize_fake)  # fmt: skip
dequantize_op = op.define("dequantize", "(Tensor q, Tensor scales, int rows, int cols) -> Tensor", _dequantize_impl,
                          _dequantize_fake)  # fmt: skip

quantize_reference = quant.quantize_reference
dequantize_reference = quant.dequantize_reference


def _block(block: quant.Block) -> tuple[int, int]:
    rows, cols = (1, block) if isinstance(block, int) else block
    if rows < 1 or cols < 1:
        raise ValueError(f"quantize: block {block!r} must be positive")
    return rows, cols


def quantize(x: torch.Tensor, fmt: str, block: quant.Block = quant.BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``ftitan.flexshard.quant.quantize`` (``(values, scales)``), by the Triton kernel where
    :func:`ftitan.kernels.op.use_kernel` says so, else by the reference; bit-identical either way."""
    if fmt not in quant.FORMATS:
        raise ValueError(f"quantize: format {fmt!r}; expected one of {sorted(quant.FORMATS)}")
    rows, cols = _block(block)
    if not op.use_kernel(x) or x.dim() == 0:  # (a 0-d tensor: the reference's one-value block)
        return quantize_reference(x, fmt, block)
    x = x.detach()
    return quantize_op(x if x.dtype in _FLOATS else x.float(), fmt, rows, cols)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: quant.Block = quant.BLOCK,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """``ftitan.flexshard.quant.dequantize`` (``values * scale`` of each block, in ``dtype``), by the Triton
    kernel where :func:`ftitan.kernels.op.use_kernel` says so, else by the reference; bit-identical."""
    rows, cols = _block(block)
    if not op.use_kernel(q, scales) or q.dim() == 0:
        return dequantize_reference(q, scales, block, dtype)
    return dequantize_op(q, scales, rows, cols).to(dtype)
