"""Checks shared by the elementwise / row kernels' tests (RMSNorm, SwiGLU, RoPE): a spy on a kernel
module's ops, gradients of a loss eager and compiled, and the torch.func transforms stepping aside."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch._dynamo.backends.debugging import aot_eager

from ftitan.kernels import op


class Spy:
    """Counts calls of a kernel module's op globals (``names``: e.g. ``("_fwd_op", "_bwd_op")``), patched
    over the module so its autograd.Function calls the spies."""

    def __init__(self, monkeypatch: Any, module: ModuleType, names: Sequence[str]) -> None:
        self.calls = dict.fromkeys(names, 0)
        for name in names:
            monkeypatch.setattr(module, name, self._spy(name, getattr(module, name)))

    def _spy(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any) -> Any:
            self.calls[name] += 1
            return fn(*args)

        return spy

    def total(self) -> int:
        return sum(self.calls.values())


def value_and_grads(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                    cotangent: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # fmt: skip
    """``fn(*inputs)`` and the gradients of ``<fn(*inputs), cotangent>`` w.r.t. every input (plain autograd)."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad((out.float() * cotangent.float()).sum(), leaves)
    return out.detach(), grads


def compiled_value_and_grads(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                             cotangent: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], str]:  # fmt: skip
    """:func:`value_and_grads` inside ``torch.compile(fullgraph=True, backend="aot_eager")`` (``torch.autograd.grad``
    traced, as ``ftitan.train.value_and_grad(impl="autograd")`` compiles it); also the traced graphs' code."""
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append(gm.print_readable(print_output=False))
        return aot_eager(gm, example)

    torch._dynamo.reset()
    before = torch._dynamo.config.trace_autograd_ops
    torch._dynamo.config.trace_autograd_ops = True
    try:
        compiled = torch.compile(lambda *xs: value_and_grads(fn, xs, cotangent), backend=backend, fullgraph=True)
        out, grads = compiled(*inputs)
    finally:
        torch._dynamo.config.trace_autograd_ops = before
        torch._dynamo.reset()
    return out, grads, "\n".join(graphs)


def assert_steps_aside_under_func(public: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor],
                                  inputs: Sequence[torch.Tensor], spy: Spy) -> None:  # fmt: skip
    """Inside ``op.interpret()``: under ``torch.func.grad``, ``vmap`` and ``jvp`` the public function gives the
    reference's values exactly (it runs the reference: no op call) and a plain call does run the kernel."""
    xs = [x.detach() for x in inputs]
    tangents = [torch.randn_like(x) for x in xs]
    with op.interpret():
        before = spy.total()
        got = (  # per-input gradients of a scalar, batched values, tangents
            torch.func.grad(lambda *a: public(*a).float().square().sum(), argnums=tuple(range(len(xs))))(*xs),
            torch.func.vmap(public, in_dims=(0,) + (None,) * (len(xs) - 1))(torch.stack([xs[0], 2 * xs[0]]), *xs[1:]),
            torch.func.jvp(public, tuple(xs), tuple(tangents)),
        )
        assert spy.total() == before, "the kernel ran under a torch.func transform"
        public(*xs)
        assert spy.total() > before, "the kernel did not run in a plain call under op.interpret()"
    want = (
        torch.func.grad(lambda *a: reference(*a).float().square().sum(), argnums=tuple(range(len(xs))))(*xs),
        torch.func.vmap(reference, in_dims=(0,) + (None,) * (len(xs) - 1))(torch.stack([xs[0], 2 * xs[0]]), *xs[1:]),
        torch.func.jvp(reference, tuple(xs), tuple(tangents)),
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
