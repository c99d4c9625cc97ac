"""``ftitan bench remat``: activation bytes kept for backward and step time, per remat policy.

A Llama of the debug width (D=256, 8 layers, V=2048) trains at seq 512 with
each ``remat`` policy (``ftitan.train.remat``) on the autograd gradient path,
side by side in one process:

- ``saved_bytes``: the bytes the autograd graph keeps alive between forward
  and backward, exactly: every storage an op creates during the forward
  (recorded by a ``TorchDispatchMode``) that is still alive once the forward
  has returned its loss, counted once per storage, params and batch excluded.
  ``hook_bytes`` is what ``torch.autograd.graph.saved_tensors_hooks`` sees
  (unique storages, params excluded): all saved tensors without remat, but
  only what autograd saves outside checkpointed regions with it (their own
  hooks shadow the outer ones), so it is reported, not judged.
- ``step_s``: median eager train-step time over interleaved rounds
  (``timing.time_steps``); ``grads_identical``: the policy's gradients equal
  the ``torch.func`` path's without remat, bit for bit.

Goals (``goal_is`` says which way each is judged): ``full`` keeps at most 20%
of the activation bytes of ``none`` (saves >= 80%) with identical gradients;
``save-matmuls`` saves >= 40% at <= 15% step-time cost. Prints one JSON
object (DESIGN.md, "Benchmarks"); ``--out FILE`` also writes it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import ftitan as ft
from ftitan import tree as T
from ftitan.bench import timing

__all__ = ["Options", "hook_bytes", "main", "run", "saved_bytes"]

POLICIES = ("none", "full", "save-matmuls", "regions:attn", "budget:0.5")
GOALS = {"full/none:saved": 0.20, "save-matmuls/none:saved": 0.60, "save-matmuls/none:step_s": 1.15}
QUICK = {"dim": 32, "n_layers": 2, "seq_len": 32, "batch_size": 2, "vocab_size": 128}


@attrs.frozen(kw_only=True)
class Options:
    """Options of ``ftitan bench remat``."""

    policies: tuple[str, ...] = POLICIES
    """Remat policies to measure ("none", the reference, is always among them)."""
    n_layers: int = 8
    """Decoder blocks of the debug-width Llama."""
    seq_len: int = 512
    """Tokens per row."""
    batch_size: int = 4
    """Rows per step."""
    warmup: int = 1
    """Untimed steps per policy first."""
    rounds: int = 5
    """Timed rounds (one step per policy each, the starting policy rotating); medians are reported."""
    quick: bool = False
    """A tiny model (a smoke run, not a measurement)."""
    out: Path | None = None
    """Also write the JSON to this file."""


class _Allocations(TorchDispatchMode):
    """Records a weak reference to the storage of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                self.made.append((StorageWeakRef(s), s.nbytes()))
        return out


def _leaves_requiring_grad(params: Any) -> tuple[Any, set[int]]:
    leaves, treedef = T.flatten(params)
    inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in leaves]
    return T.unflatten(treedef, inputs), {x.untyped_storage().data_ptr() for x in leaves}


def saved_bytes(loss_fn: Callable[[Any, Any], Any], params: Any, batch: Any) -> int:
    """Bytes of the storages created by the forward of ``loss_fn(params, batch)`` that the autograd graph
    keeps alive for backward (each storage once; params, batch and the loss itself excluded)."""
    tracked, exclude = _leaves_requiring_grad(params)
    exclude |= {x.untyped_storage().data_ptr() for x in T.leaves(batch)}
    mode = _Allocations()
    with torch.enable_grad(), mode:
        loss, _ = loss_fn(tracked, batch)
    exclude.add(loss.untyped_storage().data_ptr())
    alive: dict[int, int] = {}
    for ref, nbytes in mode.made:
        if not ref.expired():
            ptr = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).data_ptr()
            if ptr not in exclude:
                alive[ref.cdata] = nbytes
    del loss
    return sum(alive.values())


def hook_bytes(loss_fn: Callable[[Any, Any], Any], params: Any, batch: Any) -> int:
    """Bytes of the unique storages ``saved_tensors_hooks`` sees saved (params excluded); see the module doc."""
    tracked, exclude = _leaves_requiring_grad(params)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(tracked, batch)
    return sum(seen.values())


def _model_cfg(opts: Options, policy: str) -> Any:
    from ftitan.models import llama

    size = QUICK if opts.quick else {"dim": 256, "n_layers": opts.n_layers, "vocab_size": 2048}
    d = size["dim"]
    return attrs.evolve(llama.Config.debug(), dim=d, ffn_dim=3 * d, n_layers=size["n_layers"], n_heads=8 if d >= 256
                        else 4, n_kv_heads=2, vocab_size=size["vocab_size"], max_seq_len=2048, remat=policy)  # fmt: skip


def _batch(opts: Options, vocab: int) -> dict[str, torch.Tensor]:
    b, t = (QUICK["batch_size"], QUICK["seq_len"]) if opts.quick else (opts.batch_size, opts.seq_len)
    tokens = torch.randint(0, vocab, (b, t + 1), generator=torch.Generator().manual_seed(0))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _measure(opts: Options, batch: Any) -> tuple[dict[str, Any], dict[str, Callable[[], Any]]]:
    from ftitan.models import llama
    from ftitan.train.step import value_and_grad

    results: dict[str, Any] = {}
    steps: dict[str, Callable[[], Any]] = {}
    reference = None
    for policy in opts.policies:
        model = llama.model(_model_cfg(opts, policy))
        params = model.init(ft.random.key(0))
        loss_fn = ft.train.next_token_loss(model)
        if reference is None:  # "none" first: the torch.func path without remat
            reference, _ = value_and_grad(loss_fn, impl="func")(params, batch)
        grads, _ = value_and_grad(loss_fn, impl="autograd")(params, batch)
        same = all(torch.equal(a, b) for a, b in zip(T.leaves(reference), T.leaves(grads), strict=True))
        results[policy] = {"saved_bytes": saved_bytes(loss_fn, params, batch),
                           "hook_bytes": hook_bytes(loss_fn, params, batch), "grads_identical": same}  # fmt: skip
        opt = ft.optim.adamw(1e-3)
        step = ft.train.make_train_step(loss_fn, opt, grad_impl="autograd")
        state = ft.train.init_state(params, opt)
        steps[policy] = lambda step=step, state=state: step(state, batch)
    return results, steps


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result."""
    from ftitan.train import remat

    for p in opts.policies:
        remat.check_policy(p, field="--policies")
    if "none" not in opts.policies:
        raise ValueError(f"--policies={opts.policies!r}: 'none' must be among them (the reference)")
    opts = attrs.evolve(opts, policies=("none", *[p for p in opts.policies if p != "none"]))
    cfg = _model_cfg(opts, "none")
    batch = _batch(opts, cfg.vocab_size)
    torch.manual_seed(0)
    results, steps = _measure(opts, batch)
    timed = timing.time_steps(steps, tokens_per_step=batch["inputs"].numel(), warmup=opts.warmup, rounds=opts.rounds)
    for p, r in timed["results"].items():
        results[p].update(step_s=r["median_s"], step_times_s=r["times_s"], tokens_per_s=r["tokens_per_s"])
    none = results["none"]
    ratios = {}
    for p in opts.policies[1:]:
        ratios[f"{p}/none:saved"] = results[p]["saved_bytes"] / none["saved_bytes"]
        ratios[f"{p}/none:step_s"] = results[p]["step_s"] / none["step_s"]
    goals = {k: v for k, v in GOALS.items() if k in ratios}
    met = all(ratios[k] <= v for k, v in goals.items()) and all(r["grads_identical"] for r in results.values())
    return {
        "bench": "remat",
        "config": {"family": "llama", "dim": cfg.dim, "n_layers": cfg.n_layers, "vocab_size": cfg.vocab_size,
                   "batch_size": batch["inputs"].shape[0], "seq_len": batch["inputs"].shape[1],
                   "policies": list(opts.policies), "grad_impl": "autograd", "compiled": False,
                   "warmup": opts.warmup, "rounds": opts.rounds, "quick": opts.quick},  # fmt: skip
        "machine": timing.machine_info(),
        "results": results,
        "ratios": ratios,
        "goals": goals,
        # ratios are judged as upper bounds: kept bytes / none's, step time / none's; every policy's
        # gradients must also be identical to the torch.func path's without remat
        "goal_is": "max",
        "met": bool(goals) and met,
    }


def main(argv: list[str] | None = None) -> int:
    return timing.cli(Options, run, argv, prog="ftitan bench remat", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
