"""``torch.func`` transforms over whole losses: per-example gradients, gradients of partitioned trees.

A loss is a pure function of the params tree, so ``torch.func`` composes
with it as ``jax`` does with a flax ``apply``: ``vmap(grad(loss_fn))`` gives
per-example gradients, ``vmap(model.apply)`` over ``tree.stack``-ed params
runs an ensemble, ``jvp(grad(...))`` is a Hessian-vector product. The layers
and the fused cross-entropy pick transform-safe forms by themselves (see
``ftitan.kernels.autodiff``); this module adds the two pieces that need more
than calling ``torch.func``:

- :func:`per_example_grads`: ``vmap`` of ``grad`` where each batch row runs
  as a batch of one (so the model sees ``(1, T)``, as in a Python loop);
- :func:`filter_grad`: ``grad`` over a tree with ``None`` placeholders
  (``tree.partition`` output), which ``torch.func`` cannot take directly:
  its pytree treats ``None`` as a leaf, ftitan's (like JAX's) as an empty subtree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as torch_pytree

from ftitan import tree

__all__ = ["filter_grad", "per_example_grads"]

LossFn = Callable[[Any, Any], tuple[torch.Tensor, Any]]  # (params, batch) -> (loss, aux)


def _batch_size(batch: Any) -> int:
    leaves = torch_pytree.tree_leaves(batch)
    bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor) or x.dim() == 0]
    if not leaves or bad:
        raise ValueError(
            "per_example_grads: every batch entry must be a tensor with a leading batch dim, "
            f"got {bad or 'no tensors'}; "
            f"pass scalars and flags by closing over them in loss_fn"
        )
    sizes = {x.shape[0] for x in leaves}
    if len(sizes) != 1:
        raise ValueError(f"per_example_grads: batch entries disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def per_example_grads(
    loss_fn: LossFn, *, chunk_size: int | None = None
) -> Callable[[Any, Any], tuple[Any, tuple[torch.Tensor, Any]]]:
    """``fn(params, batch) -> (grads, (losses, aux))``, each with a leading batch dim ``B``.

    ``loss_fn(params, batch) -> (loss, aux)`` as for ``make_train_step``
    (e.g. ``next_token_loss(model)``). Every tensor in ``batch`` has a
    leading dim ``B``; example ``i`` is passed to ``loss_fn`` as a batch of
    one (``x[i:i+1]``, so ``(B, T)`` tokens arrive as ``(1, T)``), and
    ``grads`` leaf ``[i]`` is the gradient of example ``i``'s loss alone: what a
    Python loop over the examples gives, in one ``vmap(grad(loss_fn))``.
    MoE routing is per example (each example's tokens are routed among
    themselves), and so is the balancing loss in ``aux``. ``chunk_size``
    bounds how many examples are vmapped at once (memory).
    """

    def one(params: Any, example: Any) -> tuple[torch.Tensor, Any]:
        return loss_fn(params, torch_pytree.tree_map(lambda x: x.unsqueeze(0), example))

    grad_one = torch.func.grad_and_value(one, has_aux=True)
    batched = torch.func.vmap(grad_one, in_dims=(None, 0), chunk_size=chunk_size)

    def fn(params: Any, batch: Any) -> tuple[Any, tuple[torch.Tensor, Any]]:
        _batch_size(batch)
        return batched(params, batch)

    return fn


def filter_grad(
    fn: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., Any]:
    """``torch.func.grad`` of ``fn`` with respect to its first argument, a tree that may hold ``None``.

    The equinox filter idiom for ``tree.partition`` output::

        trainable, frozen = ft.tree.partition(params, "layers.*.attn.*")
        loss_of = lambda t, batch: loss_fn(ft.tree.combine(t, frozen), batch)[0]
        grads = ft.train.filter_grad(loss_of)(trainable, batch)   # same tree as trainable

    The tree is flattened in ftitan's namespace (``None`` placeholders are
    empty subtrees, custom nodes from ``tree.register_node`` are seen),
    ``torch.func.grad`` runs over the list of tensor leaves, and the
    gradients come back in the tree's shape, ``None`` where it had ``None``.
    Other arguments pass through undifferentiated; with ``has_aux``, ``fn``
    returns ``(value, aux)`` and so does the result ``(grads, aux)``.
    """

    def wrapped(params: Any, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = tree.flatten(params)
        bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
        if bad:
            raise TypeError(f"filter_grad: leaves must be tensors (or None placeholders), got {bad}")

        def of_leaves(flat: list[torch.Tensor], *a: Any, **k: Any) -> Any:
            return fn(tree.unflatten(treedef, flat), *a, **k)

        out = torch.func.grad(of_leaves, has_aux=has_aux)(leaves, *args, **kwargs)
        if has_aux:
            return tree.unflatten(treedef, out[0]), out[1]
        return tree.unflatten(treedef, out)

    return wrapped
