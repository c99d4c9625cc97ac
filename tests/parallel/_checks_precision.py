"""Mixed-precision parity checks (merged into ``_parity.py``'s launch): FSDP 2 x TP 2 with bfloat16
compute and float32 reductions against the single-process bfloat16 step.

Each check records the FSDP collectives of its first step by wrapping the raw collectives that
``parallel.shard.gather_leaf`` calls (``collectives._ag`` / ``_rs`` / ``_ar``; the tensor-parallel
seams go through their own table and are not recorded): the axis, dtype and bytes of every
all-gather of a param shard and every reduction of its gradient.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py precision_dp_shard2_tp2``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

import ftitan as ft
from ftitan import parallel
from ftitan.models import llama
from ftitan.parallel import collectives as C
from _parity import max_diff, tiny_llama  # torchrun puts this folder on sys.path

BF16 = ft.train.MixedPrecision.from_names("fp32", "bf16", "fp32")


@contextlib.contextmanager
def fsdp_log() -> Iterator[list[dict]]:
    """Every FSDP/DDP collective run in the block (eager): kind, mesh axis, dtype, bytes sent."""
    log: list[dict] = []
    raw = {"all_gather": C._ag, "reduce_scatter": C._rs, "all_reduce": C._ar}

    def wrap(kind: str):
        def fn(x: torch.Tensor, *args):
            group = args[-1]
            n = group.size()
            sent = {"all_gather": n - 1, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}[kind]
            log.append({"kind": kind, "axis": group.mesh_dim_names[0], "dtype": str(x.dtype).removeprefix("torch."),
                        "bytes": sent * x.numel() * x.element_size()})  # fmt: skip
            return raw[kind](x, *args)

        return fn

    C._ag, C._rs, C._ar = wrap("all_gather"), wrap("reduce_scatter"), wrap("all_reduce")
    try:
        yield log
    finally:
        C._ag, C._rs, C._ar = raw["all_gather"], raw["reduce_scatter"], raw["all_reduce"]


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(n):
        tok = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(100 + i))
        out.append({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    return out


def _single(loss_fn, opt, params, batches, precision) -> tuple[list[float], dict]:
    step = ft.train.make_train_step(loss_fn, opt, precision=precision)
    state = ft.train.init_state(params, opt)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses, state.params


def _parallel(model, loss_fn, opt, params, batches, layout, precision, compile):
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    step = parallel.make_train_step(loss_fn, opt, layout, precision=precision, compile=compile)
    state = ft.train.init_state(sharded, opt)
    losses, log = [], []
    for i, b in enumerate(batches):
        with torch._dynamo.config.patch(error_on_recompile=bool(compile) and i > 0):
            with fsdp_log() if i == 0 and not compile else contextlib.nullcontext([]) as first:  # eager only
                state, m = step(state, parallel.shard_batch(b, layout))
        log = log or first
        losses.append(float(m["loss"]))
    dtypes = lambda t: sorted({str(x.dtype) for x in ft.tree.leaves(t) if x.is_floating_point()})  # noqa: E731
    return losses, log, parallel.unshard(state.params), {"params": dtypes(state.params), "opt": dtypes(state.opt_state)}


def _bytes(log: list[dict], kind: str, axis: str) -> float:
    return sum(r["bytes"] for r in log if r["kind"] == kind and r["axis"] == axis)


def precision_check(name: str, degrees: dict[str, int], n_steps: int = 3, compile: bool | str = False) -> dict:
    """bf16 compute + fp32 reduce over ``degrees`` vs the single-process bf16 step (and fp32 both ways)."""
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    opt = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(lr=3e-3, weight_decay=0.1))
    batches = _batches(n_steps)
    policy = BF16.for_model(model)
    ref32, _ = _single(loss_fn, opt, params, batches, None)
    ref16, ref16_params = _single(loss_fn, opt, params, batches, policy)
    layout = parallel.Layout(parallel.mesh(**degrees))
    got32, log32, _, _ = _parallel(model, loss_fn, opt, params, batches, layout, None, compile)
    got16, log16, params16, dtypes16 = _parallel(model, loss_fn, opt, params, batches, layout, policy, compile)
    gathers16 = [r for r in log16 if r["kind"] == "all_gather"]
    reductions16 = [r for r in log16 if r["kind"] != "all_gather"]
    return {
        "check": name, "losses_bf16": got16, "ref_losses_bf16": ref16, "losses_fp32": got32, "ref_losses_fp32": ref32,
        "loss_diff_bf16": max(abs(a - b) for a, b in zip(got16, ref16, strict=True)),
        "loss_diff_fp32": max(abs(a - b) for a, b in zip(got32, ref32, strict=True)),
        "bf16_vs_fp32": max(abs(a - b) for a, b in zip(ref16, ref32, strict=True)),
        "gather_bytes_fp32": _bytes(log32, "all_gather", "dp_shard"),
        "gather_bytes_bf16": _bytes(log16, "all_gather", "dp_shard"),
        "reduce_bytes_fp32": _bytes(log32, "reduce_scatter", "dp_shard"),
        "reduce_bytes_bf16": _bytes(log16, "reduce_scatter", "dp_shard"),
        "gather_dtypes": sorted({r["dtype"] for r in gathers16}),
        "reduce_dtypes": sorted({r["dtype"] for r in reductions16}),
        "n_gathers": len(gathers16), "n_reductions": len(reductions16),
        "param_dtypes": dtypes16["params"], "opt_dtypes": dtypes16["opt"],
        "param_diff_bf16": max_diff(params16, ref16_params),
    }  # fmt: skip


def compiled_precision_check(name: str, degrees: dict[str, int], n_steps: int = 3) -> dict:
    """The compiled parallel step (aot_eager, fullgraph) in bf16: same losses as eager, no recompiles."""
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    opt = ft.optim.adamw(lr=ft.optim.warmup_cosine(3e-3, warmup=2, total=n_steps))
    batches = _batches(n_steps)
    policy = BF16.for_model(model)
    layout = parallel.Layout(parallel.mesh(**degrees))
    eager, _, _, _ = _parallel(model, loss_fn, opt, params, batches, layout, policy, False)
    compiled, _, _, dtypes = _parallel(model, loss_fn, opt, params, batches, layout, policy, "aot_eager")
    ref, _ = _single(loss_fn, opt, params, batches, policy)
    return {"check": name, "losses": compiled, "eager_losses": eager, "ref_losses": ref,
            "compiled_vs_eager": max(abs(a - b) for a, b in zip(compiled, eager, strict=True)),
            "param_dtypes": dtypes["params"]}  # fmt: skip


CHECKS = {
    "precision_dp_shard2_tp2": lambda: precision_check("precision_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
}
if os.environ.get("FTITAN_SLOW_CHECKS"):  # compile x bf16 x parallel (~40 s of compiling a rank): the slow tier
    CHECKS["precision_compiled_dp_shard2_tp2"] = lambda: compiled_precision_check(
        "precision_compiled_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}
    )
