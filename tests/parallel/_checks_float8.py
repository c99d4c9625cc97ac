"""Float8 training under parallel layouts (merged into the ``_parity.py`` launch, 4 gloo ranks).

Each rank computes its float8 scales from the tensors it holds: its rows of the batch (a data-parallel
rank, a pipeline micro-batch) and, under tensor parallelism, its shard of each weight. On the data axes
that makes a parallel step the single-process float8 step over the same micro-batches (gradient
accumulation with one micro-batch per data rank): the references below. Under tp tensorwise scales are per
weight shard (finer than one process's), held to one process within float8's rounding; rowwise scales are
powers of two, which leave the float8 values as they are on any rows or shard: every rowwise layout is held
to one process on the whole batch.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py float8_steps_dp_shard4``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ftitan as ft
from ftitan import parallel
from ftitan.models import deepseek_v3, llama, qwen3_moe
from _checks_ep import batch_for as moe_batch_for
from _checks_ep import init_params, tiny_deepseek_v3, tiny_qwen3_moe
from _checks_pp import SEQ, _max_over_ranks, _stage_state
from _parity import batch_for, max_diff, parallel_grads, tiny_llama

torch.set_num_threads(1)


def _batches(n: int, rows: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(n):
        tok = torch.randint(0, 256, (rows, SEQ + 1), generator=torch.Generator().manual_seed(100 + i))
        out.append({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    return out


def _run(step, state, batches, prepare=lambda b: b):
    """The losses, the params after the first step (as full tensors), the final state."""
    losses, first = [], None
    for b in batches:
        state, m = step(state, prepare(b))
        losses.append(float(m["loss"]))
        first = first or parallel.unshard(state.params)
    return losses, first, state


def steps_check(name: str, recipe: str, degrees: dict[str, int], n_steps: int = 3) -> dict:
    """AdamW steps of the parallel float8 step against one process accumulating one micro-batch per data
    rank (the same scales), and against one process on the whole batch (other activation scales)."""
    model = llama.model(tiny_llama(float8=recipe))
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    opt = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(lr=3e-3, weight_decay=0.1))
    batches = _batches(n_steps, 4)
    layout = parallel.Layout(parallel.mesh(**degrees))
    n_data = layout.data_rank()[1]
    ref = {}
    for accum in sorted({1, n_data}):  # grad_impl autograd: torchao's recipe, output-gradient cast included
        step = ft.train.make_train_step(loss_fn, opt, accum_steps=accum, grad_impl="autograd")
        ref[accum] = _run(step, ft.train.init_state(params, opt), batches)
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    step = parallel.make_train_step(loss_fn, opt, layout)
    losses, first, state = _run(step, ft.train.init_state(sharded, opt), batches,
                                lambda b: parallel.shard_batch(b, layout))  # fmt: skip
    final = parallel.unshard(state.params)
    out = {"check": name, "losses": losses}
    for accum, (ref_losses, ref_first, ref_state) in ref.items():
        out[f"loss_diff_accum{accum}"] = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        out[f"first_param_diff_accum{accum}"] = max_diff(first, ref_first)
        out[f"param_diff_accum{accum}"] = max_diff(final, ref_state.params)
    return out


def grads_check(name: str, degrees: dict[str, int]) -> dict:
    """One gradient per recipe under tp (per-shard scales) against one process's, on the whole batch and
    accumulated over the data ranks' rows. Rowwise scales are powers of two: an e4m3 value scaled by one
    rounds as the unscaled value does (away from the subnormals), so the float8 operands, and the
    gradients, do not depend on which rows or which shard a scale was taken over."""
    out = {"check": name}
    for recipe in ("tensorwise", "rowwise"):
        model = llama.model(tiny_llama(float8=recipe))
        params = model.init(ft.random.key(0))
        batch = batch_for(4, SEQ, 256)
        loss_fn = ft.train.next_token_loss(model, chunk_size=24)
        n_data = parallel.Layout(parallel.mesh(**degrees)).data_rank()[1]
        vg = ft.train.value_and_grad(loss_fn, impl="autograd")
        whole_g, (whole_l, _) = vg(params, batch)
        parts = [vg(params, {k: v.chunk(n_data)[i] for k, v in batch.items()}) for i in range(n_data)]
        accum_g = ft.tree.map(lambda *g: sum(g) / n_data, *[g for g, _ in parts])
        accum_l = sum(float(l) for _, (l, _) in parts) / n_data
        total, full, _, _, _ = parallel_grads(model, params, loss_fn, batch, degrees)
        out[recipe] = {"loss_diff_whole": abs(float(total) - float(whole_l)),
                       "grad_diff_whole": max_diff(full, whole_g),
                       "loss_diff_accum": abs(float(total) - accum_l), "grad_diff_accum": max_diff(full, accum_g),
                       "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(whole_g))}  # fmt: skip
    return out


def rowwise_check(name: str, family: str, degrees: dict[str, int], experts: bool = False) -> dict:
    """Rowwise float8 gradients on a layout whose ranks hold other rows or shards (cp's sequence chunks,
    ep's experts) against one process's on the whole batch: the same, as under tp. ``experts``: the MoE
    experts' grouped GEMMs in float8 too (their scales per expert: over the rows the expert got)."""
    if family in ("qwen3_moe", "deepseek_v3"):
        make = {"qwen3_moe": (qwen3_moe, tiny_qwen3_moe), "deepseek_v3": (deepseek_v3, tiny_deepseek_v3)}[family]
        extra = {"kv_lora_rank": 24} if family == "deepseek_v3" else {}  # kv_a = 24 + 8: a multiple of 16
        model = make[0].model(make[1](float8="rowwise", float8_experts=experts, **extra))
        params, batch = init_params(family, model), moe_batch_for(8, SEQ, 256)
    else:
        model = llama.model(tiny_llama(float8="rowwise"))
        params, batch = model.init(ft.random.key(0)), batch_for(4, SEQ, 256)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    ref_g, (ref_l, _) = ft.train.value_and_grad(loss_fn, impl="autograd")(params, batch)
    total, full, _, _, _ = parallel_grads(model, params, loss_fn, batch, degrees)
    return {"check": name, "loss_diff": abs(float(total) - float(ref_l)), "grad_diff": max_diff(full, ref_g),
            "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g))}  # fmt: skip


def pp_check(name: str, degrees: dict[str, int], n_microbatches: int = 2) -> dict:
    """The 1F1B pipeline's float8 gradients against one process accumulating its micro-batches: micro-batch
    ``m`` of data rank ``d`` is rows ``d * b/n_data + m * b/(n_data M) ...`` of the global batch."""
    model = llama.model(tiny_llama(float8="tensorwise"))
    params = model.init(ft.random.key(0))
    batch = _batches(1, 8)[0]
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    layout = parallel.Layout(parallel.mesh(**degrees))
    n_parts = layout.data_rank()[1] * n_microbatches  # contiguous rows: data ranks, then their micro-batches
    vg = ft.train.value_and_grad(loss_fn, impl="autograd")
    parts = [vg(params, {k: v.chunk(n_parts)[i] for k, v in batch.items()}) for i in range(n_parts)]
    ref_g = ft.tree.map(lambda *g: sum(g) / n_parts, *[g for g, _ in parts])
    ref_l = sum(float(l) for _, (l, _) in parts) / n_parts
    whole_g, _ = vg(params, batch)
    sharded, shardings = _stage_state(model, params, layout)
    make = parallel.pipeline_grad(model, layout, schedule="1f1b", n_microbatches=n_microbatches, chunk_size=24)
    with parallel.use(layout):
        g, (l, _) = make(shardings)(parallel.to_local(sharded), parallel.shard_batch(batch, layout))
    total = l.detach().clone()
    dist.all_reduce(total)
    full = parallel.unshard(parallel.from_local(g, sharded))
    return {"check": name, "loss_diff": abs(float(total) - ref_l),
            "grad_diff": _max_over_ranks(max_diff(full, parallel.stage_params(ref_g, model, layout))),
            "whole_batch_diff": _max_over_ranks(max_diff(full, parallel.stage_params(whole_g, model, layout))),
            "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g))}  # fmt: skip


CHECKS = {
    "float8_steps_dp_shard4": lambda: steps_check("float8_steps_dp_shard4", "tensorwise", {"dp_shard": 4}),
    "float8_grads_dp_shard2_tp2": lambda: grads_check("float8_grads_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
    "float8_rowwise_tp2_cp2": lambda: rowwise_check("float8_rowwise_tp2_cp2", "llama", {"tp": 2, "cp": 2}),
    "float8_experts_ep2_dp_shard2_qwen3_moe": lambda: rowwise_check(
        "float8_experts_ep2_dp_shard2_qwen3_moe", "qwen3_moe", {"ep": 2, "dp_shard": 2}, experts=True
    ),
    "float8_experts_ep2_dp_shard2_deepseek_v3": lambda: rowwise_check(
        "float8_experts_ep2_dp_shard2_deepseek_v3", "deepseek_v3", {"ep": 2, "dp_shard": 2}, experts=True
    ),
    "float8_pp2_dp_shard2": lambda: pp_check("float8_pp2_dp_shard2", {"pp": 2, "dp_shard": 2}),
}
