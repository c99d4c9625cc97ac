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

Two more regions keep the rest of the step off the eager path without
growing with depth: the head's fused loss (:func:`compiled`, used by
``ftitan.train.losses`` in one process), and the optimizer update run layer
by layer (``make_train_step(update_backend=...)`` with a ``Transform.leafwise``
optimizer: :func:`layer_parts` cuts the params, :func:`split_state` the
optimizer state, and one compiled update serves every layer of a kind; a
whole-tree compiled update's cold compile grows faster than its leaves).
The embedding runs eagerly. ``ftitan bench compile`` measures it against a
whole-step compile (docs/compile-and-memory.md). Gradients
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
from typing import Any, NamedTuple

import optree
import torch

from ftitan import tree as T

__all__ = ["Parts", "backend_of", "block_call", "compiled", "compiling", "current_backend", "layer_parts",
           "regional_step", "split_state"]

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


@functools.cache
def compiled(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """``fn`` compiled once for ``backend`` (fullgraph, static shapes): one more region beside the blocks, e.g. the
    fused head-and-loss forward (``ftitan.train.losses``), which regional compile would otherwise run eagerly."""
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


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


class Parts(NamedTuple):
    """A params tree cut into parts of which the update runs one at a time (:func:`layer_parts`)."""

    select: list[Callable[[Any], Any]]
    """Per part: a tree of the params' structure (params, gradients, a moment) -> that part's subtree."""
    assemble: Callable[[list[Any]], Any]
    """The parts' subtrees, in ``select`` order -> the whole tree."""


def layer_parts(params: Any) -> Parts | None:
    """``params`` by layers: what lies outside ``params["layers"]`` (one part, when there is any), then each
    layer. Layers of one kind have one structure and shapes, so a compiled update of a part compiles once per
    kind. ``None`` when ``params`` is not a dict whose ``layers`` is a dict (the families': ``{"0": ...}``) or a
    list of layers (e.g. ``trainable``'s flat dict of dotted paths)."""
    layers = params.get("layers") if type(params) is dict else None
    if type(layers) not in (dict, list, tuple) or not layers:
        return None
    keys = list(layers) if type(layers) is dict else list(range(len(layers)))
    rest = [k for k in params if k != "layers"]
    select: list[Callable[[Any], Any]] = [lambda t: {k: t[k] for k in rest}] if rest else []
    select += [lambda t, i=i: t["layers"][i] for i in keys]

    def assemble(pieces: list[Any]) -> Any:
        others, own = (pieces[0], pieces[1:]) if rest else ({}, pieces)
        stacked = dict(zip(keys, own, strict=True)) if type(layers) is dict else type(layers)(own)
        return {k: stacked if k == "layers" else others[k] for k in params}

    return Parts(select, assemble)


def split_state(state: Any, params: Any, parts: Parts, *, own_scalars: bool) -> tuple[list[Any], Callable[..., Any]]:
    """An optimizer state cut like ``params``: ``(part states, merge)``.

    Subtrees of the params' structure (moments) are cut by ``parts``; the other leaves (step counts, learning
    rates) are the same in every part, each part getting its own copy when ``own_scalars`` (a part's update
    that writes into its state in place must not advance the next part's step). ``merge(new part states)``
    assembles the moments and takes the other leaves from the first part; ``merge(..., into=state)`` writes
    those into ``state``'s leaves instead (the donated step)."""
    spec = T.structure(params)
    mirror = lambda x: not T.is_tensor(x) and T.structure(x) == spec  # noqa: E731
    nodes, outer = optree.tree_flatten(state, is_leaf=mirror, namespace=T.NAMESPACE)
    flags = [mirror(n) for n in nodes]
    copy = (lambda x: x.clone() if T.is_tensor(x) else x) if own_scalars else (lambda x: x)  # noqa: E731
    states = [outer.unflatten([sel(n) if f else copy(n) for n, f in zip(nodes, flags, strict=True)])
              for sel in parts.select]  # fmt: skip

    def merge(new: list[Any], into: Any = None) -> Any:
        cols = [outer.flatten_up_to(s) for s in new]
        old = outer.flatten_up_to(into) if into is not None else None
        out = []
        for j, f in enumerate(flags):
            if f:
                out.append(parts.assemble([c[j] for c in cols]))
            elif old is not None and T.is_tensor(old[j]):
                out.append(old[j].copy_(cols[0][j]))
            else:
                out.append(cols[0][j])
        return outer.unflatten(out)

    return states, merge
