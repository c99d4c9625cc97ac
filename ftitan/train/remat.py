"""Activation rematerialization as a transform of the block function.

Every family runs its layers through ``ftitan.models.decoder.run_stage``,
which calls ``block(i, layer_params, h, attend)`` per layer; with a model
config whose ``remat`` field is not ``"none"`` it calls
``remat_block(cfg.remat, block, layers)`` instead, so one place serves every
family. The policies (``cfg.remat``, set with ``ftitan.config.with_remat``):

- ``"none"``: autograd keeps every activation the backward needs.
- ``"full"``: the whole block is recomputed in backward; a layer keeps only
  its input (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
  Cost"), through ``torch.utils.checkpoint`` (non-reentrant).
- ``"save-matmuls"``: selective (op-level) remat: the outputs of matmuls and
  attention kernels are kept, the cheap pointwise ops between them (norms,
  activations, RoPE, residual adds) are recomputed (Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models"), through
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
- ``"regions:attn"``: only the named regions are recomputed. ``attn`` is the
  attention core behind the ``attend`` seam every block calls (scores,
  softmax, weighted sum: the (B, H, T, T) part on the math path); the block's
  projections, norms and MLP keep their activations.
- ``"budget:F"`` (0 < F < 1): keep about a fraction F of the block
  activations. Under ``torch.compile`` it is the partitioner's activation
  memory budget (``torch._functorch.config.activation_memory_budget``, which
  picks what to recompute by runtime cost; :func:`memory_budget` is the
  patch the train step compiles under). Eagerly, the first
  ``round((1 - F) * L)`` layers of each stage run under full remat and the
  others keep their activations.

Remat uses saved-tensor hooks, which ``torch.func.grad`` / ``vjp`` refuse, so
the train step of a remat config differentiates with ``torch.autograd``
(``make_train_step(grad_impl="autograd")``, chosen by ``ftitan.train``'s
runtime): its gradients are bitwise those of the ``torch.func`` path without
remat on CPU (recomputation replays the same deterministic kernels). The
functional transforms (``torch.func.grad`` / ``vmap`` / ``jvp`` of
``model.apply``) run without remat: under a functorch transform the block
runs as is. So does inference (no grad, or a KV cache).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["POLICIES", "REGIONS", "Policy", "check_policy", "memory_budget", "parse_policy", "remat_block",
           "transforms_active"]  # fmt: skip

POLICIES = ("none", "full", "save-matmuls", "regions:<names>", "budget:<fraction>")
REGIONS = ("attn",)  # the named regions ``regions:`` accepts (comma-separated)

_aten = torch.ops.aten
# the ops whose outputs "save-matmuls" keeps: GEMMs and fused attention kernels (those that exist here)
_SAVED_OPS = frozenset(
    getattr(_aten, name).default if hasattr(getattr(_aten, name), "default") else getattr(_aten, name)
    for name in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")  # fmt: skip
    if hasattr(_aten, name)
)


class Policy(NamedTuple):
    """A parsed ``remat`` string: ``kind`` in none/full/save-matmuls/regions/budget."""

    kind: str
    regions: tuple[str, ...] = ()  # kind "regions": which ones are recomputed
    budget: float = 1.0  # kind "budget": the fraction of activations kept


def _error(policy: object, field: str, why: str) -> ValueError:
    return ValueError(f"{field}={policy!r}: {why}; expected one of 'none', 'full', 'save-matmuls', "
                      f"'regions:<names>' (names from {', '.join(REGIONS)}, comma-separated) or 'budget:<F>' "
                      "with 0 < F < 1 (e.g. 'budget:0.5')")  # fmt: skip


def parse_policy(policy: str, *, field: str = "remat") -> Policy:
    """``policy`` parsed; ``ValueError`` naming ``field`` (e.g. ``--remat``) and the choices when invalid."""
    if not isinstance(policy, str):
        raise _error(policy, field, "must be a string")
    if policy in ("none", "full", "save-matmuls"):
        return Policy(policy)
    kind, sep, arg = policy.partition(":")
    if sep and kind == "regions":
        names = tuple(n.strip() for n in arg.split(","))
        unknown = [n for n in names if n not in REGIONS]
        if not arg or unknown:
            raise _error(policy, field, f"unknown region(s) {unknown or [arg]}")
        return Policy("regions", regions=names)
    if sep and kind == "budget":
        try:
            budget = float(arg)
        except ValueError:
            raise _error(policy, field, f"{arg!r} is not a number") from None
        if not 0.0 < budget < 1.0:
            raise _error(policy, field, f"the budget {budget} is outside (0, 1) ('none' keeps all, 'full' the least)")
        return Policy("budget", budget=budget)
    raise _error(policy, field, "unknown policy")


def check_policy(policy: str, *, field: str = "remat") -> str:
    """``policy`` unchanged if valid, else the :func:`parse_policy` error."""
    parse_policy(policy, field=field)
    return policy


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vjp, vmap, jvp) is running: saved-tensor hooks are refused there."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)


def _checkpointed(fn: Callable[..., Any], *args: Any, selective: bool = False) -> Any:
    """``fn(*args)`` with its activations recomputed in backward (``selective``: matmul outputs kept)."""
    extra = {"context_fn": _selective_contexts} if selective else {}
    return checkpoint(fn, *args, use_reentrant=False, **extra)


def _remat_attend(attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``attend`` with the attention core recomputed in backward (region ``attn``)."""

    def attend_remat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return _checkpointed(functools.partial(attend, **kwargs), q, k, v)

    return attend_remat


def _full_layers(policy: Policy, layers: range) -> frozenset[int]:
    """The layers of a stage that run under full remat: all for "full", the first ``(1 - F)`` for eager budgets."""
    if policy.kind == "full":
        return frozenset(layers)
    if policy.kind == "budget" and not torch.compiler.is_compiling():  # compiled: the partitioner's budget
        return frozenset(list(layers)[: round((1.0 - policy.budget) * len(layers))])
    return frozenset()


Block = Callable[[int, Mapping[str, Any], torch.Tensor, Any], tuple[torch.Tensor, Any]]


def remat_block(policy: str, block: Block, layers: range) -> Block:
    """``block`` (``decoder.Block``) under the ``policy`` of the stage running ``layers``; the block
    itself under ``"none"``, without grad, and under ``torch.func`` transforms (see the module doc)."""
    parsed = parse_policy(policy)
    if parsed.kind == "none":
        return block
    full = _full_layers(parsed, layers)

    def run(i: int, p: Mapping[str, Any], h: torch.Tensor, attend: Any) -> tuple[torch.Tensor, Any]:
        if not torch.is_grad_enabled() or transforms_active():
            return block(i, p, h, attend)
        if i in full:
            return _checkpointed(lambda p_, h_: block(i, p_, h_, attend), p, h)
        if parsed.kind == "save-matmuls":
            return _checkpointed(lambda p_, h_: block(i, p_, h_, attend), p, h, selective=True)
        if parsed.kind == "regions":  # REGIONS == ("attn",)
            return block(i, p, h, _remat_attend(attend))
        return block(i, p, h, attend)

    return run


@contextlib.contextmanager
def memory_budget(policy: str) -> Iterator[None]:
    """Around a ``torch.compile``d call: the partitioner's activation memory budget of a ``budget:F`` policy
    (read when the graph compiles); nothing for the other policies."""
    parsed = parse_policy(policy)
    if parsed.kind != "budget":
        yield
        return
    with torch._functorch.config.patch(activation_memory_budget=parsed.budget):
        yield
