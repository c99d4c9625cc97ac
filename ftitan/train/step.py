"""``make_train_step``: a pure ``(state, batch) -> (state, metrics)`` factory.

Differentiation is a pure function of the params tree. The default path is
``torch.func.grad_and_value``. The ``"autograd"`` path runs
``torch.autograd.grad`` over detached copies of the leaves and gives the same
gradients; it exists because ``torch.func`` refuses saved-tensor hooks, which
activation rematerialization (``torch.utils.checkpoint``, torch-remat) uses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ftitan import optim
from ftitan import tree as T
from ftitan.optim import finite
from ftitan.optim.masking import merge, subset
from ftitan.optim.transform import scalar_dtype
from ftitan.train.precision import MixedPrecision, apply_precision
from ftitan.train.state import Trainable, TrainState

__all__ = ["make_train_step", "update_runs_by_layers", "value_and_grad"]

LossFn = Callable[[Any, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]
GradFn = Callable[[Any, Any], tuple[Any, tuple[torch.Tensor, dict[str, torch.Tensor]]]]


def _autograd_value_and_grad(loss_fn: LossFn) -> GradFn:
    def fn(params: Any, batch: Any) -> tuple[Any, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        leaves, treedef = T.flatten(params)
        diff = [x.is_floating_point() or x.is_complex() for x in leaves]
        inputs = [x.detach().requires_grad_(d) for x, d in zip(leaves, diff, strict=True)]
        with torch.enable_grad():
            loss, aux = loss_fn(T.unflatten(treedef, inputs), batch)
            wrt = [x for x, d in zip(inputs, diff, strict=True) if d]
            got = iter(torch.autograd.grad(loss, wrt, allow_unused=True, materialize_grads=True))
        grads = [next(got) if d else torch.zeros_like(x) for x, d in zip(leaves, diff, strict=True)]
        return T.unflatten(treedef, grads), (loss.detach(), T.map(torch.Tensor.detach, aux))

    return fn


def value_and_grad(loss_fn: LossFn, *, impl: str = "func") -> GradFn:
    """``fn(params, batch) -> (grads, (loss, aux))`` for ``loss_fn(params, batch) -> (loss, aux)``.

    ``impl="func"``: ``torch.func.grad_and_value``. ``impl="autograd"``:
    ``torch.autograd.grad`` over detached leaves, for loss functions that use
    saved-tensor hooks (rematerialization) or Triton kernels' autograd
    Functions (``ftitan.kernels.op``: under ``torch.func`` they step aside for
    their references); same gradients. It compiles with ``fullgraph=True``
    (it turns on ``torch._dynamo.config.trace_autograd_ops``).
    """
    if impl == "func":
        return torch.func.grad_and_value(loss_fn, has_aux=True)
    if impl == "autograd":
        # lets torch.compile trace `torch.autograd.grad` into the graph (fullgraph) instead of refusing it
        torch._dynamo.config.trace_autograd_ops = True
        return _autograd_value_and_grad(loss_fn)
    raise ValueError(f"value_and_grad: impl={impl!r}; use 'func' (torch.func) or 'autograd' (needed for remat)")


def _split(batch: Any, n: int) -> list[Any]:
    def rows(x: torch.Tensor) -> int:
        return x.shape[0]

    sizes = {rows(x) for x in T.leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"make_train_step: batch leaves disagree on the batch dimension: {sorted(sizes)}")
    (b,) = sizes
    if b % n:
        raise ValueError(f"make_train_step: batch size {b} is not divisible by accum_steps={n}; pick a divisor of {b}")
    return [T.map(lambda x, i=i: x[i * (b // n) : (i + 1) * (b // n)], batch) for i in range(n)]


def _weight(aux: Any) -> torch.Tensor | float:
    """A micro-batch's weight in the accumulated mean: its target-token count when the loss reports one."""
    return aux["n_tokens"] if isinstance(aux, dict) and "n_tokens" in aux else 1.0


def _accumulate(grad_fn: GradFn, params: Any, batch: Any, n: int) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
    """Gradients, loss and float aux averaged over ``n`` micro-batches, weighted by target tokens
    (``optim.update_weighted_mean``, the rule ``optim.MultiSteps`` uses); integer aux (counts) add up."""
    mean: Any = None
    total = counts = None
    for micro in _split(batch, n):
        g, (loss, aux) = grad_fn(params, micro)
        floats = {k: v for k, v in aux.items() if v.is_floating_point()}
        ints = {k: v for k, v in aux.items() if not v.is_floating_point()}
        if mean is None:
            mean = T.map(torch.zeros_like, (g, loss, floats))
            total = torch.zeros((), dtype=scalar_dtype(g), device=loss.device)
        mean, total = optim.update_weighted_mean(mean, total, (g, loss, floats), _weight(aux))
        counts = ints if counts is None else T.map(torch.add, counts, ints)
    grads, loss, floats = mean
    return grads, loss, {**floats, **(counts or {})}


def _takes_weight(optimizer: optim.Transform) -> bool:
    try:
        return "weight" in inspect.signature(optimizer.update).parameters
    except (TypeError, ValueError):
        return False


def update_runs_by_layers(optimizer: optim.Transform, *, trainable: Trainable | None = None,
                          update_buffers: Callable[..., Any] | None = None) -> bool:  # fmt: skip
    """Whether ``make_train_step(update_backend=...)`` runs the update layer by layer (one compile per layer
    kind) for these arguments: a leafwise optimizer (``Transform.leafwise``) that takes no ``weight``, no
    ``trainable`` subset (its flat dict has no layers), no ``update_buffers``. Otherwise the update is
    compiled over the whole tree, whose cold compile grows with the number of leaves."""
    return optimizer.leafwise and trainable is None and update_buffers is None and not _takes_weight(optimizer)


def _donate(old: Any, new: Any) -> Any:
    # a leaf the step did not replace (a frozen param) is already in place
    return T.map(lambda o, n: o if n is o else o.copy_(n), old, new)


def make_train_step(
    loss_fn: LossFn,
    optimizer: optim.Transform,
    *,
    accum_steps: int = 1,
    grad_impl: str = "func",
    update_buffers: Callable[[Any, dict[str, torch.Tensor]], Any] | None = None,
    donate: bool = False,
    trainable: Trainable | None = None,
    precision: MixedPrecision | None = None,
    update_backend: str | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, torch.Tensor]]]:
    """A pure train step: ``step(state, batch) -> (state, metrics)``.

    ``loss_fn(params, batch) -> (loss, aux)`` with ``aux`` a dict of tensors.
    With ``accum_steps > 1`` the batch is split along dim 0 into equal
    micro-batches whose gradients (and loss and float aux) are averaged,
    weighted by ``aux["n_tokens"]`` when the loss reports it: for a
    token-mean loss (``next_token_loss``) that is the full batch's gradient
    even when the micro-batches hold different numbers of target tokens.
    The rule is ``optim.update_weighted_mean``, the one ``optim.MultiSteps``
    uses; an optimizer whose ``update`` takes ``weight`` (``MultiSteps``) is
    passed ``aux["n_tokens"]``, so ``MultiSteps(opt, k)`` over ``k`` steps of
    micro-batches weights them the same way.

    ``trainable`` (glob(s) or ``(path, leaf) -> bool``) differentiates only
    the selected leaves: the others get no gradient tensor, no optimizer
    state and stay bit-identical (the same tensors); the optimizer sees a
    flat ``{dotted path: leaf}`` dict of the trainable leaves, and clipping
    and ``grad_norm`` cover them only. Build the state with
    ``init_state(params, optimizer, trainable=<the same value>)``.

    ``metrics`` holds ``loss``, ``grad_norm`` (of the differentiated leaves,
    before any clipping), ``aux``'s entries and ``lr``: the learning rate of
    this update (``optim.find_lr``: the first in the optimizer state's tree
    order), present only when the optimizer has a learning-rate stage
    (``scale_by_learning_rate`` or an injected ``lr``); any other
    ``Transform`` works without it.
    ``update_buffers(params, metrics) -> params`` (a model's
    ``update_buffers``, e.g. DeepSeek-V3's balancing bias) runs after the
    optimizer update: state that moves with training but outside the
    gradient. Keep those leaves away from the optimizer with
    ``trainable`` or ``optim.selective_transform(opt, freeze_mask=model.frozen)``.
    Wrap it in ``torch.compile(step, fullgraph=True)``; all changing values
    (step, lr, injected hyperparameters) are tensors, so it does not recompile.

    ``donate=True`` consumes the state passed in (JAX's buffer donation): the
    new params and optimizer state are written into its buffers, which the
    returned state holds. A compiled step then updates them in place, as
    torch's optimizers do, instead of writing a fresh copy of every parameter
    and moment (an AdamW update of 32M parameters: 26 ms against 46 ms on two
    CPU cores). The values are the same; only the old state is gone, so do
    not read it after the call (``state, m = step(state, batch)`` is safe).

    ``precision`` (a :class:`~ftitan.train.MixedPrecision`, e.g.
    ``MixedPrecision.from_names("fp32", "bf16", "fp32").for_model(model)``)
    runs the loss on the params cast to its ``compute_dtype`` inside the
    differentiated function (:meth:`~ftitan.train.MixedPrecision.cast_loss`):
    params, gradients and optimizer state stay in the masters' dtype, the
    loss is float32. ``None`` or ``MixedPrecision()`` is the float32 step.

    ``update_backend`` (a ``torch.compile`` backend) compiles the half of the step after the gradients
    on its own: the optimizer update, applying it, the metrics and, with ``donate``, the writes into the
    old buffers, fused into a few loops. For a step whose gradient half runs eagerly or regionally
    compiled (``ftitan.train.regional``); a step compiled whole needs it not. With an optimizer that is
    ``leafwise`` (``optim.Transform``: AdamW, SGD, behind clipping and the non-finite guard) and params
    with ``layers``, it runs layer by layer through one compiled update per layer kind, whose cold compile
    does not grow with depth (the same values; see ``_by_layers``); otherwise (Muon, path masks,
    ``trainable``, ``update_buffers``, a ``weight``-taking optimizer) it is compiled over the whole tree.
    """
    if accum_steps < 1:
        raise ValueError(f"make_train_step: accum_steps={accum_steps} must be >= 1")
    loss_fn = apply_precision(loss_fn, precision)
    grad_fn = value_and_grad(loss_fn, impl=grad_impl)
    weighted = _takes_weight(optimizer)

    def select(params: Any) -> tuple[Any, Callable[[Any], Any]]:
        # the leaves the optimizer sees, and how its new ones go back into the whole tree
        if trainable is None:
            return params, lambda new: new
        return subset(trainable, params), lambda new: merge(params, new)

    def split_trainable(params: Any) -> tuple[Any, Callable[[Any], Any], GradFn]:
        train, put = select(params)
        if trainable is None:
            return train, put, grad_fn
        return train, put, value_and_grad(lambda t, b: loss_fn(merge(params, t), b), impl=grad_impl)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        train, _, fn = split_trainable(state.params)
        if accum_steps == 1:
            grads, (loss, aux) = fn(train, batch)
        else:
            grads, loss, aux = _accumulate(fn, train, batch, accum_steps)
        return finish(state, grads, loss, aux)

    def update(
        state: TrainState, grads: Any, loss: torch.Tensor, aux: dict[str, torch.Tensor]
    ) -> tuple[TrainState, dict[str, torch.Tensor]]:
        train, merge = select(state.params)
        extra = {"weight": aux["n_tokens"]} if weighted and "n_tokens" in aux else {}
        updates, opt_state = optimizer.update(grads, state.opt_state, train, **extra)
        params = merge(optim.apply_updates(train, updates))
        metrics = {"loss": loss.detach(), "grad_norm": T.global_norm(grads), **aux}
        lr = optim.find_lr(opt_state)
        if lr is not None:
            metrics["lr"] = lr
        if update_buffers is not None:
            params = update_buffers(params, metrics)
        if donate:  # the step boundary: the only place a step writes into its input
            params, opt_state = _donate((state.params, state.opt_state), (params, opt_state))
        return TrainState(state.step + 1, params, opt_state, state.rng), metrics

    # not fullgraph: a transform may branch on values (optim.apply_if_finite); dynamic=False: params keep their
    # shapes, and another step's update compiled from this same code must not turn this one's sizes symbolic
    whole = update if update_backend is None else torch.compile(update, backend=update_backend, dynamic=False)
    by_layers = update_backend is not None and update_runs_by_layers(optimizer, trainable=trainable,
                                                                      update_buffers=update_buffers)  # fmt: skip
    finish = _by_layers(whole, optimizer, update_backend, donate) if by_layers else whole
    return step


def _part_stats(grads: list[torch.Tensor], acc: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    # tree.global_norm's squares and optim.nonfinite_leaves' flags, leaf by leaf
    return T.squares(grads, acc), [c > 0 for c in finite.nonfinite_counts(grads)]


class LayerUpdate:
    """A leafwise optimizer's update (``Transform.leafwise``) compiled once per layer kind and run layer by
    layer (``regional.layer_parts``): its compile does not grow with depth, as a whole-tree compile's does
    (inductor's scheduling grows faster than the number of leaves). Clipping and the non-finite guard read
    the whole gradient tree's statistics, given to each part (``tree.as_part_of``): ``stats`` computes them
    from a tree of plain tensors; a tree split over processes combines each rank's ``leaf_stats`` of its
    shards (``ftitan.parallel``'s step: each rank updates its shards with the global statistics).

    Called as ``(parts, grads, opt_state, params, total, bad)``, it returns ``(params, opt_state)``, or
    ``None`` when the optimizer turns out not to run by parts (``tree.NotPartitionable`` on the first part;
    every later call then returns ``None`` at once, and the caller takes its whole-tree path)."""

    def __init__(self, optimizer: optim.Transform, backend: str, donate: bool) -> None:
        def part(grads: Any, opt_state: Any, params: Any, squares: torch.Tensor, bad: torch.Tensor) -> Any:
            with T.as_part_of(grads, sum_squares=squares, nonfinite=bad):
                updates, opt_state_new = optimizer.update(grads, opt_state, params)
            new = optim.apply_updates(params, updates)
            if donate:
                return _donate((params, opt_state), (new, opt_state_new))
            return new, opt_state_new

        self.donate = donate
        self.partitionable = True
        self._part = torch.compile(part, backend=backend, dynamic=False)
        self._stats = torch.compile(_part_stats, backend=backend, dynamic=False)

    @staticmethod
    def parts_of(params: Any, grads: Any) -> Any:
        """``regional.layer_parts(params)`` where the update can run by them: ``grads`` all tensors, of the
        params' structure; else ``None``."""
        from ftitan.train import regional

        parts = regional.layer_parts(params)
        if parts is None or not all(T.is_tensor(g) for g in T.leaves(grads)):
            return None
        return parts if T.structure(grads) == T.structure(params) else None

    def leaf_stats(self, parts: Any, grads: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each leaf's sum of squares and non-finite flag (0-d tensors), in the whole ``grads``' leaf order,
        computed part by part (the compiled ``_part_stats``, once per layer kind)."""
        acc = T.norm_dtype(T.leaves(grads))
        specs = [T.structure(sel(grads)) for sel in parts.select]
        got = [self._stats(T.leaves(sel(grads)), acc) for sel in parts.select]
        # back into the whole tree's leaf order, which global_norm sums in and the guard's bad_leaf counts in
        squares = parts.assemble([T.unflatten(spec, sq) for spec, (sq, _) in zip(specs, got, strict=True)])
        flags = parts.assemble([T.unflatten(spec, b) for spec, (_, b) in zip(specs, got, strict=True)])
        return T.leaves(squares), T.leaves(flags)

    def stats(self, parts: Any, grads: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum of squares, per-leaf non-finite flags)`` of the whole ``grads``, in its leaf order (the sum
        ``tree.global_norm`` takes)."""
        squares, flags = self.leaf_stats(parts, grads)
        return torch.stack(squares).sum(), torch.stack(flags)

    def __call__(self, parts: Any, grads: Any, opt_state: Any, params: Any, total: torch.Tensor,
                 bad: torch.Tensor) -> tuple[Any, Any] | None:  # fmt: skip
        from ftitan.train import regional

        if not self.partitionable:
            return None
        states, merge = regional.split_state(opt_state, params, parts, own_scalars=self.donate)
        new = []
        for i, (sel, s) in enumerate(zip(parts.select, states, strict=True)):
            try:
                new.append(self._part(sel(grads), s, sel(params), total, bad))
            except T.NotPartitionable:
                if i:  # earlier parts wrote their donated buffers: nothing to fall back to
                    raise
                self.partitionable = False
                return None
        return parts.assemble([p for p, _ in new]), merge([s for _, s in new], into=opt_state if self.donate else None)


def _by_layers(whole: Callable[..., Any], optimizer: optim.Transform, backend: str, donate: bool) -> Callable[..., Any]:
    """The update half run by :class:`LayerUpdate`; params that are not cut in layers, and an optimizer that
    turns out not to run by parts, take ``whole``, the update compiled whole."""
    layered = LayerUpdate(optimizer, backend, donate)

    def run(state: TrainState, grads: Any, loss: torch.Tensor, aux: dict[str, torch.Tensor]) -> Any:
        # inside tree.norm_across (a tree split over processes) the norm must be combined: the whole update does
        parts = None if not layered.partitionable or T.norm_is_combined() else LayerUpdate.parts_of(state.params, grads)
        if parts is None:
            return whole(state, grads, loss, aux)
        total, bad = layered.stats(parts, grads)
        out = layered(parts, grads, state.opt_state, state.params, total, bad)
        if out is None:
            return whole(state, grads, loss, aux)
        params, opt_state = out
        metrics = {"loss": loss.detach(), "grad_norm": torch.sqrt(total), **aux}
        lr = optim.find_lr(opt_state)
        if lr is not None:
            metrics["lr"] = lr
        return TrainState(state.step + 1, params, opt_state, state.rng), metrics

    return run
