"""Regional compile: each transformer block compiled once and reused across layers.

Whole-step compile traces every layer of the model into one graph, so its
cold compile grows with depth. Regional compile (TorchTitan's per-block
compile; "local compile") compiles the block function instead: while
:func:`compiling` is active, ``ftitan.models.decoder.run_stage`` calls each
layer through :func:`block_call`, one ``torch.compile``d trampoline
``(block, i, params, h, attend) -> block(i, params, h, attend)``. Dynamo keys
its compiled code on the block's code object and guards on what the block
reads: the layer's params are inputs (their shapes and the tree's keys are
guarded, not their identity), the closure (config, RoPE angles) is the same
for every layer of a step, and the layer index is guarded only where the
block reads it. So a block that does not branch on the index compiles once
for all layers (tests count it with ``torch._dynamo.config.error_on_recompile``);
a family whose layers differ by params (Qwen3-Next: linear vs full
attention, MoE vs dense) compiles once per kind. A block that reads the
index itself would specialize on it, one compile per layer: its family passes
``run_stage`` a ``layer_kind`` (Muse Glimmer: the layer's RoPE base and window)
and each layer runs as the first layer of its kind (DeepSeek-V3 tells dense
from MoE blocks by their params).

The rest of the step (embedding, loss, optimizer) runs eagerly. The eager
update, a dozen passes over every parameter and moment, is most of the
step-time gap to a whole-step compile on CPU; ``make_train_step(update_backend=...)``
compiles the half of the step after the gradients (update, applying it, the
donated writes) on its own and closes it, at a compile cost that grows with
the number of leaves (``ftitan bench compile``'s ``regional-update`` peer;
docs/compile-and-memory.md), so ``--compile regional`` leaves it eager. Gradients
come from ``torch.autograd`` (``make_train_step(grad_impl="autograd")``): a
compiled region under ``torch.func.grad`` is refused by dynamo with
``fullgraph=True`` in torch 2.13 ("Unsupported functorch tracing attempt").
Only training calls go through the region: with a KV cache (inference) the
blocks run as they are.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["backend_of", "block_call", "compiling", "current_backend", "regional_step"]

_active: list[str] = []  # the backends of the enclosing ``compiling`` contexts (innermost last)


@contextlib.contextmanager
def compiling(backend: str = "inductor") -> Iterator[None]:
    """Within it, ``run_stage`` runs each block through the compiled region (``backend``: a torch.compile backend)."""
    _active.append(backend)
    try:
        yield
    finally:
        _active.pop()


def current_backend() -> str | None:
    """The backend of the innermost :func:`compiling` context, ``None`` outside (and while dynamo traces)."""
    if not _active or torch.compiler.is_compiling():  # inside a whole-step compile: no nested regions
        return None
    return _active[-1]


def _call(block: Callable[..., Any], i: int, p: Mapping[str, Any], h: torch.Tensor, attend: Any) -> Any:
    return block(i, p, h, attend)


@functools.cache
def _region(backend: str) -> Callable[..., Any]:
    # one compiled trampoline per backend: its cache (on _call's code) holds one entry per block kind
    return torch.compile(_call, backend=backend, fullgraph=True, dynamic=False)


def _plain(p: Any) -> Any:
    # a lazy params view (FlexShard's ``parallel.gathered``: gathers on first read, and knows its layer's
    # path) read into plain dicts here, eagerly: the region then sees tensors, not a per-layer object
    return {k: _plain(v) for k, v in p.items()} if isinstance(p, Mapping) else p


def block_call(backend: str, block: Callable[..., Any], i: int, p: Mapping[str, Any], h: torch.Tensor,
               attend: Any) -> Any:  # fmt: skip
    """``block(i, p, h, attend)`` through the compiled region of ``backend`` (``p`` read into plain dicts)."""
    return _region(backend)(block, i, _plain(p), h, attend)


def backend_of(compile: bool | str) -> str | None:
    """The regional backend a ``compile`` setting asks for: ``"regional"`` -> inductor, ``"regional:<backend>"``
    -> that backend (e.g. ``"regional:aot_eager"`` in tests); ``None`` for whole-step settings (bools, backends)."""
    if not isinstance(compile, str) or not compile.startswith("regional"):
        return None
    name, _, backend = compile.partition(":")
    if name != "regional":
        return None
    return backend or "inductor"


def regional_step(step: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """``step`` (eager, autograd gradient path) with every block it runs through the compiled region of ``backend``."""

    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        with compiling(backend):
            return step(*args, **kwargs)

    return run

