"""Grouped matmul: one GEMM per contiguous row group, one call for all groups.

The MoE hot path: tokens sorted by expert, ``x[offs[g-1]:offs[g]] @ w[g]``
for every expert ``g`` at once. Backed by ATen's ``torch._grouped_mm``
(CUTLASS on CUDA, per-group GEMMs on CPU), which has an autograd formula
that ``torch.func`` accepts.

Two gaps of torch 2.13 are closed here:

- its fake (meta) kernel accepts bf16 only, although the CPU kernel runs
  fp32, so ``torch.compile`` could not trace an fp32 MoE. The meta kernel
  computes shapes only, so :func:`_allow_any_float_in_meta` widens it to every
  floating dtype (bf16 still takes the original checks). A custom op was
  not an option: under ``torch.func.grad`` + ``torch.compile`` a custom op's
  autograd (generated or inside an ``autograd.Function``) is either refused
  or silently yields zero gradients in this torch.
- it wants every row stride to be a multiple of 16 bytes; odd widths are
  zero-padded (exact: padded columns contribute nothing and are sliced off).

``grouped_mm_reference`` is the naive per-group loop the op is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftitan.kernels.autodiff import plain_reverse_mode

__all__ = ["grouped_mm", "grouped_mm_dense", "grouped_mm_reference"]


def _allow_any_float_in_meta() -> None:
    import torch._meta_registrations as meta_registrations
    from torch._C import DispatchKey

    op = torch.ops.aten._grouped_mm.default
    original = op.py_kernels.get(DispatchKey.Meta)
    if original is None or getattr(original, "_ftitan_widened", False):
        return

    def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):  # type: ignore[no-untyped-def]
        if mat_a.dtype == torch.bfloat16 or not mat_a.dtype.is_floating_point:
            return original(mat_a, mat_b, offs, bias, out_dtype)
        torch._check(mat_a.dtype == mat_b.dtype, lambda: f"grouped_mm: {mat_a.dtype} @ {mat_b.dtype}")
        return meta_registrations._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)

    meta._ftitan_widened = True  # type: ignore[attr-defined]
    op.py_kernels[DispatchKey.Meta] = meta
    op._dispatch_cache.clear()


_allow_any_float_in_meta()


_ATEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch._grouped_mm takes


def _pad_to(n: int, dtype: torch.dtype) -> int:
    per = max(1, 16 // dtype.itemsize)  # elements per 16 bytes
    return -n % per


def grouped_mm(
    x: torch.Tensor,  # (M, K) rows sorted by group
    w: torch.Tensor,  # (G, K, N)
    offs: torch.Tensor,  # (G,) int32, cumulative row ends; offs[-1] == M
) -> torch.Tensor:  # (M, N)
    """``out[offs[g-1]:offs[g]] = x[offs[g-1]:offs[g]] @ w[g]`` for every group ``g``.

    Empty groups are fine (their weight gets a zero gradient).
    Differentiable in ``x`` and ``w`` under autograd, ``torch.func`` and
    ``torch.compile(fullgraph=True)``; fp32 and bf16 (tested: compiled in fp32, bf16 eager).
    Under transforms ATen's op has no rule for (``vmap``, ``jvp``, ``grad``
    of ``grad``; see ``ftitan.kernels.autodiff``), and in float64, it is :func:`grouped_mm_dense`.
    """
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        raise ValueError(
            f"grouped_mm: expected x (M, K), w (G, K, N), offs (G,); got {tuple(x.shape)}, "
            f"{tuple(w.shape)}, {tuple(offs.shape)}"
        )
    if offs.dtype != torch.int32:
        raise ValueError(f"grouped_mm: offs must be int32 cumulative row ends, got {offs.dtype}")
    if x.dtype not in _ATEN_DTYPES or not plain_reverse_mode():
        return grouped_mm_dense(x, w, offs)
    pk, pn = _pad_to(x.shape[1], x.dtype), _pad_to(w.shape[2], w.dtype)
    if pk or pn:
        out = torch._grouped_mm(F.pad(x, (0, pk)), F.pad(w, (0, pn, 0, pk)), offs=offs)
        return out[:, : w.shape[2]]
    return torch._grouped_mm(x, w, offs=offs)


def grouped_mm_dense(
    x: torch.Tensor,  # (M, K) rows sorted by group
    w: torch.Tensor,  # (G, K, N)
    offs: torch.Tensor,  # (G,) int32, cumulative row ends
) -> torch.Tensor:  # (M, N)
    """:func:`grouped_mm` in plain ops with static shapes: every group's GEMM over all rows, masked.

    ``G`` times the FLOPs of the grouped op, but no data-dependent shape, so it
    batches under ``vmap``, has forward-AD and double-backward formulas, and
    compiles; the fallback under transforms.
    """
    group = (torch.arange(x.shape[0], device=x.device)[:, None] >= offs[None, :]).sum(-1)  # (M,) group of each row
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for g in range(w.shape[0]):
        out = torch.where((group == g)[:, None], x @ w[g], out)
    return out


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The naive loop over groups (eager only; for tests)."""
    ends = offs.tolist()
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        out[s:e] = x[s:e] @ w[g]
    return out
