"""Which autodiff transforms are active, so fused kernels can step aside (``ftitan.kernels.autodiff``).

Some fast paths are exact only under plain reverse mode: the fused linear
cross-entropy (``ftitan.train.losses``) forms its gradients in forward, so
they have no derivative of their own (a Hessian-vector product through them
would be silently wrong); the CPU flash SDPA kernel has no forward-AD
formula and no vmap rule; ``torch._grouped_mm`` has no forward-AD formula.
They are used when :func:`plain_reverse_mode` says so, and a plain-ops
equivalent otherwise:

- no ``torch.func`` transform, or exactly one ``torch.func.grad`` /
  ``vjp`` level (the train step), and
- no forward-AD dual level (``torch.autograd.forward_ad.dual_level``).

Every other case falls back: ``vmap`` (per-example gradients, ensembles,
``jacrev``), ``jvp`` / ``linearize`` / ``jacfwd``, ``grad`` of ``grad``.
(Plain ``torch.autograd.grad(create_graph=True)`` cannot be seen from the
forward pass; the fused cross-entropy refuses it in its backward instead.)

Dynamo traces the check: ``torch._C._are_functorch_transforms_active`` and
the top interpreter's ``key()`` / ``level()`` are compile-time constants
guarded by the functorch-stack guard, so the choice costs nothing in a
compiled graph and a compiled train step keeps the fused paths. Functorch
levels count from 1 at the bottom of the stack, so ``level() == 1`` on top
means the stack holds that one interpreter.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad
from torch._C._functorch import TransformType, peek_interpreter_stack
from torch._functorch.pyfunctorch import coerce_cinterpreter

__all__ = ["plain_reverse_mode"]


def plain_reverse_mode() -> bool:
    """True when at most one reverse-mode ``torch.func`` level and no forward-AD level are active.

    Then fused kernels (gradients formed in forward, kernels without
    forward-AD or vmap rules) are exact; otherwise use their plain-ops form.
    """
    if forward_ad._current_level >= 0:
        return False
    if not torch._C._are_functorch_transforms_active():
        return True
    # `is None` on the C interpreter does not trace in dynamo; the active check above covers it
    top = coerce_cinterpreter(peek_interpreter_stack())
    return top.key() == TransformType.Grad and top.level() == 1
