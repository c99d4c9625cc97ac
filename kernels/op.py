"""How a Triton kernel becomes an op that compiles and differentiates (``ftitan.kernels.op``).

Every kernel in ``ftitan.kernels`` has a pure-torch reference and is used
only where it is exact and supported; the reference runs everywhere else.
The pieces, measured on torch 2.13 (see ../shared/FACTS.md):

- **The op.** Each launch is a ``torch.library`` operator (:func:`define`:
  ``ftitan_kernels::<name>``) with CPU/CUDA implementations that launch the
  Triton kernel and a fake (meta) implementation, so ``torch.compile(
  fullgraph=True)`` treats it as one opaque node (a raw Triton launch, or
  ``triton_op``, does not trace here). The op has *no* autograd of its own.
- **Its derivative.** A ``torch.autograd.Function`` with ``setup_context``
  whose ``forward`` and ``backward`` call the forward and backward ops. This
  is exact under plain autograd, eager and compiled (``torch.autograd.grad``
  inside a compiled function needs ``torch._dynamo.config.trace_autograd_ops``:
  :func:`ftitan.train.value_and_grad` with ``impl="autograd"`` sets it).
- **Under torch.func the reference runs.** ``torch.library.custom_op`` with
  ``register_autograd`` is refused by ``torch.func.grad`` and returns a zero
  tangent under ``jvp``; and dynamo, tracing ``torch.func.grad``, inlines an
  ``autograd.Function``'s forward instead of using its backward, which gives
  *zero* gradients through an op without autograd. So :func:`use_kernel` is
  False whenever a ``torch.func`` transform or a forward-AD level is active
  (a compile-time constant under dynamo, guarded by the functorch-stack
  guard): ``vmap``, ``grad``, ``jvp``, ``jacrev`` and ``hessian`` all see the
  reference's plain ops, which every transform handles. A train step that
  wants the kernels therefore differentiates with ``grad_impl="autograd"``
  (the same path rematerialization needs), which gives the gradients of the
  ``torch.func`` path.
- **Where.** The kernel runs on CUDA tensors. On the CPU it runs only when
  :func:`interpret` is on (tests, under ``TRITON_INTERPRET=1``); otherwise the
  reference: a ``kernels="triton"`` model on the CPU is the reference model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad

__all__ = ["KERNELS", "LIBRARY", "check_kernels", "define", "interpret", "interpreting", "no_transform", "plain",
           "use_kernel"]

KERNELS = ("torch", "triton", "helion")  # a model config's `kernels`; "helion": Helion kernels where ftitan has one
# (RMSNorm), Triton otherwise; both: the linear layers' float32 GEMMs in oneDNN on the CPU (ftitan.kernels.onednn)
LIBRARY = "ftitan_kernels"
_lib = torch.library.Library(LIBRARY, "DEF")
_interpret = False


def check_kernels(value: Any, owner: str) -> None:
    """Raise naming ``owner`` (e.g. ``"llama.Config.kernels"``) unless ``value`` is one of :data:`KERNELS`."""
    if value not in KERNELS:
        raise ValueError(f"{owner}={value!r}: expected one of {KERNELS} ('triton': ftitan.kernels on CUDA, their "
                         "references elsewhere, the linear GEMMs in oneDNN on the CPU; 'helion': the Helion kernels "
                         "where there is one (RMSNorm), Triton otherwise)")  # fmt: skip


def define(name: str, schema: str, impl: Callable[..., Any], fake: Callable[..., Any],
           keys: tuple[str, ...] = ("CPU", "CUDA")) -> Any:  # fmt: skip
    """Register ``ftitan_kernels::{name}`` with ``schema`` (e.g. ``"(Tensor x, float eps) -> Tensor"``),
    ``impl`` for the dispatch ``keys`` (the Triton launch, on CPU and CUDA) and ``fake`` (shapes and dtypes
    only); returns the op."""
    _lib.define(name + schema)
    for key in keys:
        _lib.impl(name, impl, key)
    torch.library.register_fake(f"{LIBRARY}::{name}", fake, lib=_lib)
    return getattr(getattr(torch.ops, LIBRARY), name).default


def interpreting() -> bool:
    """Whether Triton kernels run on CPU tensors (:func:`interpret`; needs ``TRITON_INTERPRET=1`` set
    before ``triton`` is imported)."""
    return _interpret


@contextlib.contextmanager
def interpret(on: bool = True) -> Iterator[None]:
    """Run the Triton kernels on CPU tensors too (in the Triton interpreter) inside the block: the tests'
    switch. Raises unless ``TRITON_INTERPRET=1`` is set, since the kernels would then need a GPU."""
    global _interpret
    if on and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("ftitan.kernels.interpret: set TRITON_INTERPRET=1 before importing triton to run Triton "
                           "kernels on the CPU")  # fmt: skip
    before, _interpret = _interpret, on
    try:
        yield
    finally:
        _interpret = before


def no_transform() -> bool:
    """True when no ``torch.func`` transform and no forward-AD level is active: where an op whose
    derivative is an autograd Function may run instead of its reference."""
    return forward_ad._current_level < 0 and not torch._C._are_functorch_transforms_active()


def plain(*tensors: torch.Tensor) -> bool:
    """True when every one of ``tensors`` is a plain tensor (or Parameter), not a DTensor or another subclass:
    what an opaque op or a library Function (oneDNN's GEMM, torchao's float8 linear) is given."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def use_kernel(*tensors: torch.Tensor) -> bool:
    """True where the Triton kernel should run instead of its reference: on CUDA tensors (or any, under
    :func:`interpret`), with no ``torch.func`` transform and no forward-AD level active."""
    if not no_transform():
        return False
    return _interpret or all(t.is_cuda for t in tensors)
