"""Linear projection with the weight stored ``(out, in)`` as in ``torch.nn.Linear``.

Storing the weight the way torch and HF checkpoints do means checkpoint
import/export is a rename, never a transpose.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ftitan.kernels import onednn
from ftitan.nn import float8 as _float8
from ftitan.nn import invariant as _invariant
from ftitan.nn.param import Param, init, truncated_normal_init, zeros_init

__all__ = ["PreparedWeight", "bias_param", "init_linear", "linear", "linear_param"]


def linear(
    x: torch.Tensor,  # (..., in)
    w: torch.Tensor | PreparedWeight,  # (out, in)
    b: torch.Tensor | None = None,  # (out,)
    *,
    invariant: bool = False,
    kernels: str = "torch",
    float8: str = "",
) -> torch.Tensor:  # (..., out)
    """``x @ w.T + b``. ``w`` may also be a :class:`PreparedWeight` (a matrix an inference runtime
    laid out for its own GEMM, e.g. ``ftitan.vllm``'s oneDNN-packed weights): it computes the same.
    ``invariant``: each row in a GEMM of fixed shape (``ftitan.nn.invariant.linear``), so its bits do
    not depend on the other rows. ``kernels`` (a model config's): other than "torch", float32 GEMMs on
    the CPU run in oneDNN (``ftitan.kernels.onednn.linear``; ``F.linear`` under ``torch.func``). ``float8``
    (a model config's, e.g. "tensorwise"): the three GEMMs in float8 by that torchao recipe (``ftitan.nn.float8``)."""
    if float8 and not invariant and isinstance(w, torch.Tensor):
        return _float8.linear(x, w, b, recipe=float8)
    if invariant:
        return _invariant.linear(x, w, b)  # type: ignore[arg-type]
    if not isinstance(w, torch.Tensor):
        return w.linear(x, b)
    if kernels != "torch":
        return onednn.linear(x, w, b)
    return F.linear(x, w, b)


class PreparedWeight(Protocol):
    """A ``(out, in)`` weight in a runtime's own layout: ``linear(x, b)`` is ``x @ weight.T + b``."""

    shape: torch.Size

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor: ...


def linear_param(
    in_dim: int,
    out_dim: int,
    *,
    axes: tuple[str | None, str | None],
    std: float = 0.02,
) -> Param:
    """Spec of a ``(out_dim, in_dim)`` weight; ``axes`` names (out, in) logically.

    Init: normal with ``std`` truncated to 3 std (TorchTitan's choice).
    """
    return Param(shape=(out_dim, in_dim), axes=axes, init=truncated_normal_init(std))


def bias_param(out_dim: int, *, axis: str | None) -> Param:
    """Spec of a zero-initialized ``(out_dim,)`` bias."""
    return Param(shape=(out_dim,), axes=(axis,), init=zeros_init)


def init_linear(
    key: torch.Tensor,
    in_dim: int,
    out_dim: int,
    *,
    axes: tuple[str | None, str | None] = (None, None),
    std: float = 0.02,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # (out_dim, in_dim)
    """A weight drawn from ``key`` directly (models use specs + ``nn.init`` instead)."""
    return init(linear_param(in_dim, out_dim, axes=axes, std=std), key, dtype=dtype, device=device)
