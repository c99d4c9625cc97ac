"""FlexShard on gloo: gathering a plan's buckets gives the full params (one all-gather per bucket), and the
gradients of the parts (one reduce-scatter per bucket, one all-reduce per bucket of replicated leaves) are
each rank's part of the single-process gradient; ``reduce_grads`` gives the same parts.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py flexshard_dp4``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import ftitan as ft
from _parity import batch_for, max_diff, tiny_llama  # torchrun puts this folder on sys.path
from ftitan import flexshard as fs
from ftitan import parallel
from ftitan.flexshard import quant
from ftitan.models import llama
from ftitan.parallel import collectives as C


def _buckets(params):
    return [fs.Bucket(["layers.*.attn.wq", "layers.*.attn.wk"], fs.BlockShard(0, 16), name="heads"),
            fs.Bucket("layers.*.mlp.*", fs.Owned(), name="owned"),
            fs.Bucket("**.*norm*", fs.Replicate(), name="norms"),
            *fs.per_layer(params, fs.Shard(0))]  # fmt: skip


def _diff(xs, ys) -> float:
    """The largest absolute difference over two trees' leaves (empty parts: 0)."""
    return max((float((a.detach() - b).abs().max()) if a.numel() else 0.0 for a, b in zip(xs, ys, strict=True)),
               default=0.0)  # fmt: skip


def _max(x: float) -> float:
    t = torch.tensor(float(x))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def flexshard_check(name: str, degrees: dict[str, int]) -> dict:
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    batch = batch_for(8, 16, 256)
    ref_g, (ref_l, _) = ft.train.value_and_grad(loss_fn)(params, batch)

    layout = parallel.Layout(parallel.mesh(**degrees))
    group = layout.group("dp_shard")
    plan = fs.plan(params, _buckets(params), group)
    local = ft.tree.map(lambda x: x.detach().requires_grad_(), plan.shard(params))
    n = plan.world
    rows = {k: v.chunk(n)[plan.rank] for k, v in batch.items()}  # this data rank's rows
    with C.count_calls() as forward:
        full = plan.gather_all(local)
    gathered_diff = _diff(ft.tree.leaves(full), ft.tree.leaves(params))
    loss, _ = loss_fn(full, rows)
    with C.count_calls() as backward:
        (loss / n).backward()
    want = plan.shard(ref_g)
    grad_diff = _diff([x.grad for x in ft.tree.leaves(local)], ft.tree.leaves(want))
    # the same through reduce_grads: this rank's full-size gradient of its rows' share
    mine = ft.train.value_and_grad(lambda p, b: (loss_fn(p, b)[0] / n, {}))(params, rows)[0]
    with C.count_calls() as reduce:
        reduced = plan.reduce_grads(mine)
    reduce_diff = _diff(ft.tree.leaves(reduced), ft.tree.leaves(want))
    total = layout.sum(loss.detach() / n, ("dp_shard",))  # (the tp ranks of a data rank compute the same)
    packed = sum(1 for b in plan.buckets if plan.padded[b])
    replicated = sum(1 for b in plan.buckets if any(not lp.packed for lp in plan.members[b]))
    owners = sorted({lp.owner for lp in plan.leaves.values() if lp.owner is not None})
    return {"check": name, "world": n, "buckets": len(plan.buckets), "packed_buckets": packed,
            "replicated_buckets": replicated, "forward_calls": dict(forward), "backward_calls": dict(backward),
            "reduce_calls": dict(reduce), "owners": owners, "loss_diff": abs(float(total) - float(ref_l)),
            "gathered_diff": _max(gathered_diff), "grad_diff": _max(grad_diff), "reduce_diff": _max(reduce_diff),
            "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g))}  # fmt: skip


CHECKS = {
    "flexshard_dp4": lambda: flexshard_check("flexshard_dp4", {"dp_shard": 4}),
    "flexshard_dp2_tp2": lambda: flexshard_check("flexshard_dp2_tp2", {"dp_shard": 2, "tp": 2}),
}


BLOCKS = {"layers.*.attn.wq": (0, 16), "layers.*.attn.wk": (0, 16)}  # per head (head_dim 16)


def _muon_buckets(params):
    return [fs.Bucket(["layers.*.attn.wq", "layers.*.attn.wk"], fs.BlockShard(0, 16), name="heads"),
            fs.Bucket(["layers.*.mlp.*", "layers.*.attn.wv"], fs.Owned(), name="owned"),
            fs.Bucket("**.*norm*", fs.Replicate(), name="norms"),
            fs.Bucket("**", fs.Shard(0), name="rest")]  # wo, embed, head: rows split (wo gathered for Muon)


# per head: rows of q / k / v, columns of o
MOE_BLOCKS = {**{f"layers.*.attn.{w}": (0, 16) for w in ("wq", "wk", "wv")}, "layers.*.attn.wo": (-1, 16)}


def _moe_buckets(params):
    return [fs.Bucket([f"layers.*.attn.{w}" for w in ("wq", "wk", "wv")], fs.BlockShard(0, 16), name="heads"),
            fs.Bucket("layers.*.attn.wo", fs.BlockShard(1, 16), name="out_heads"),
            fs.Bucket("layers.*.moe.experts.*", fs.Shard(0), name="experts"),  # whole experts, ragged: 2, 2, 1, 1
            fs.Bucket("layers.*.moe.router", fs.Owned(), name="routers"),
            fs.Bucket("**", fs.Replicate(), name="rest")]  # fmt: skip


def muon_check(name: str, degrees: dict[str, int], steps: int = 3, moe: bool = False) -> dict:
    """Distributed Muon (+ AdamW) vs single-process muon_with_adamw(blocks=...) fed the same gradients."""
    from _checks_ep import tiny_qwen3_moe

    from ftitan.models import qwen3_moe

    model = qwen3_moe.model(tiny_qwen3_moe(n_experts=6)) if moe else llama.model(tiny_llama())
    blocks, make_buckets = (MOE_BLOCKS, _moe_buckets) if moe else (BLOCKS, _muon_buckets)
    params = model.init(ft.random.key(0))
    g = torch.Generator().manual_seed(5)
    grads = [ft.tree.map(lambda x: torch.randn(x.shape, generator=g) * 0.01, params) for _ in range(steps)]
    kw = dict(lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32, blocks=blocks)
    opt = ft.optim.muon_with_adamw(params, **kw)
    state = opt.init(params)
    ref = params
    for gr in grads:
        updates, state = opt.update(gr, state, ref)
        ref = ft.optim.apply_updates(ref, updates)

    layout = parallel.Layout(parallel.mesh(**degrees))
    plan = fs.plan(params, make_buckets(params), layout.group("dp_shard"))
    dopt = fs.muon_with_adamw(plan, params, **kw)
    local = plan.shard(params)
    dstate = dopt.init(local)
    with C.count_calls() as calls:
        for gr in grads:
            updates, dstate = dopt.update(plan.shard(gr), dstate, local)
            local = ft.optim.apply_updates(local, updates)
    final = plan.unshard(local)
    paths = ft.tree.paths(params)
    diffs = {p: float((a - b).abs().max()) for p, a, b in zip(paths, ft.tree.leaves(final), ft.tree.leaves(ref),
                                                              strict=True)}  # fmt: skip
    kinds = {p: (type(plan.leaves[p].placement).__name__, fs.local_kind(plan, p, blocks)) for p in paths}
    owned = [p for p in paths if kinds[p][0] == "Owned"]
    mine = [p for p in owned if plan.leaves[p].owner == plan.rank]
    return {"check": name, "world": plan.world, "calls_per_step": {k: v / steps for k, v in calls.items()},
            "gathered_leaves": sorted(p for p, x in zip(paths, ft.tree.leaves(params), strict=True)
                                      if kinds[p][1] == "gather" and ft.optim.muon_label(p, x) == "muon"),
            "owned_diff": _max(max(diffs[p] for p in owned)),
            "other_diff": _max(max(d for p, d in diffs.items() if p not in owned)),
            "owned_here": len(mine), "owned": len(owned),
            "moved": _max(max(float((a - b).abs().max()) for a, b in zip(ft.tree.leaves(ref), ft.tree.leaves(params),
                                                                          strict=True)))}  # fmt: skip


CHECKS.update({
    "flexshard_muon_dp4": lambda: muon_check("flexshard_muon_dp4", {"dp_shard": 4}),
    "flexshard_muon_dp2": lambda: muon_check("flexshard_muon_dp2", {"dp_shard": 2, "dp_replicate": 2}),
    "flexshard_muon_moe_dp4": lambda: muon_check("flexshard_muon_moe_dp4", {"dp_shard": 4}, moe=True),
})  # fmt: skip


def _train(plan, params, loss_fn, batch, steps: int) -> list[float]:
    """``steps`` AdamW steps on the plan's parts: each rank's rows through the gathered params (their
    share of the global mean), gradients by the gathers' adjoints; the global losses."""
    opt = ft.optim.adamw(3e-3, weight_decay=0.0)
    local = plan.shard(params)
    state = opt.init(local)
    rows = {k: v.chunk(plan.world)[plan.rank] for k, v in batch.items()}
    losses = []
    for _ in range(steps):
        local = ft.tree.map(lambda x: x.detach().requires_grad_(), local)
        loss = loss_fn(plan.gather_all(local), rows)[0] / plan.world
        grads = torch.autograd.grad(loss, ft.tree.leaves(local))
        grads = ft.tree.unflatten(ft.tree.structure(local), grads)
        updates, state = opt.update(grads, state, local)
        local = ft.optim.apply_updates(ft.tree.map(torch.Tensor.detach, local), updates)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def quantized_check(name: str, steps: int = 100) -> dict:
    """int8 / fp8 blockwise gathers on 4 ranks: one all-gather per bucket, ~0.52x the bytes of bf16, values
    within the formats' bounds, and ``steps`` training steps whose loss stays within 2% of the unquantized run."""
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    layout = parallel.Layout(parallel.mesh(dp_shard=4))
    group = layout.group("dp_shard")

    def buckets(**kw):
        return [fs.Bucket("**.*norm*", fs.Replicate(), name="norms"), *fs.per_layer(params, fs.Shard(0), **kw)]

    out: dict = {"check": name}
    for label, kw in (("bf16", {"gather_dtype": torch.bfloat16}), ("int8", {"quantize": "int8"}),
                      ("fp8", {"quantize": "fp8"})):  # fmt: skip
        plan = fs.plan(params, [attrs_evolve(b, **kw) if b.label != "norms" else b for b in buckets()], group)
        with C.count_calls() as calls, C.count_bytes() as sent:
            full = plan.unshard(plan.shard(params))
        if label != "bf16":
            within = all(bool(((f - p).abs() <= quant.error_bound(p, label)).all())
                         for path, f, p in zip(ft.tree.paths(params), ft.tree.leaves(full), ft.tree.leaves(params),
                                               strict=True) if "norm" not in path)  # fmt: skip
            out[f"{label}_within_bound"] = bool(_max(0.0 if within else 1.0) == 0.0)
        out[f"{label}_calls"] = dict(calls)
        out[f"{label}_bytes"] = int(sent["all_gather"])
        out["buckets"] = sum(1 for b in plan.buckets if plan.padded[b])
    batch = batch_for(8, 32, 256)
    fp32 = fs.plan(params, buckets(), group)
    int8 = fs.plan(params, [attrs_evolve(b, quantize="int8") if b.label != "norms" else b for b in buckets()], group)
    out["losses_fp32"] = _train(fp32, params, loss_fn, batch, steps)
    out["losses_int8"] = _train(int8, params, loss_fn, batch, steps)
    return out


def attrs_evolve(b, **kw):
    import attrs

    return attrs.evolve(b, **kw)


CHECKS["flexshard_quantized_dp4"] = lambda: quantized_check("flexshard_quantized_dp4", steps=35)
if os.environ.get("FTITAN_SLOW_CHECKS"):  # the long curve (100 steps, the loss well below its start): slow tier
    CHECKS["flexshard_quantized_dp4_100_steps"] = lambda: quantized_check("flexshard_quantized_dp4_100_steps")


def checkpoint_check(name: str, steps: int = 2) -> dict:
    """FlexShard state (parts, distributed Muon + AdamW state, step) saved on 4 ranks (dp_shard 4) and loaded
    under another plan on 2 (dp_shard 2 x dp_replicate 2): equal to the state that plan reaches itself, and
    one more step from either is the same."""
    import shutil
    import tempfile

    import ftitan.checkpoint as ckpt

    params = llama.model(tiny_llama()).init(ft.random.key(0))
    g = torch.Generator().manual_seed(5)
    grads = [ft.tree.map(lambda x: torch.randn(x.shape, generator=g) * 0.01, params) for _ in range(steps + 1)]
    kw = dict(lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32, blocks=BLOCKS)

    def run(plan, opt, state, gs):
        local, opt_state = state["params"], state["opt"]
        for gr in gs:
            updates, opt_state = opt.update(plan.shard(gr), opt_state, local)
            local = ft.optim.apply_updates(local, updates)
        return {"params": local, "opt": opt_state, "step": state["step"] + len(gs)}

    def fresh(plan, opt):
        local = plan.shard(params)
        return {"params": local, "opt": opt.init(local), "step": torch.zeros((), dtype=torch.int64)}

    a = fs.plan(params, _muon_buckets(params), parallel.mesh(dp_shard=4)["dp_shard"])
    opt_a = fs.muon_with_adamw(a, params, **kw)
    saved = run(a, opt_a, fresh(a, opt_a), grads[:steps])
    box = [tempfile.mkdtemp(prefix="ftitan-flexshard-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    ckpt.save(box[0], steps, a.parts(saved))
    written = len(list(next(Path(box[0]).glob("step_*")).glob("rank*.safetensors")))

    layout_b = parallel.Layout(parallel.mesh(dp_shard=2, dp_replicate=2))
    b = fs.plan(params, _muon_buckets(params), layout_b.group("dp_shard"))
    opt_b = fs.muon_with_adamw(b, params, **kw)
    loaded, _ = ckpt.load(box[0], b.parts(fresh(b, opt_b)))
    loaded = b.from_parts(loaded)
    own = run(b, opt_b, fresh(b, opt_b), grads[:steps])
    state_diff = max((float((x - y).abs().max()) if x.numel() else 0.0)
                     for x, y in zip(ft.tree.leaves(loaded), ft.tree.leaves(own), strict=True))  # fmt: skip
    after = run(b, opt_b, loaded, grads[steps:])["params"]
    own_after = run(b, opt_b, own, grads[steps:])["params"]
    next_diff = max((float((x - y).abs().max()) if x.numel() else 0.0)
                    for x, y in zip(ft.tree.leaves(after), ft.tree.leaves(own_after), strict=True))  # fmt: skip
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0])
    return {"check": name, "files": written, "step": int(loaded["step"]), "state_diff": _max(state_diff),
            "next_diff": _max(next_diff), "leaves": len(ft.tree.leaves(loaded)),
            "world_b": b.world}  # fmt: skip


CHECKS["flexshard_checkpoint_4_to_2"] = lambda: checkpoint_check("flexshard_checkpoint_4_to_2")


def dp_shard_buckets_check(name: str, degrees: dict[str, int], family: str = "llama") -> dict:
    """The trainer's dp_shard path (``parallel.make_parallel_loss``) with FlexShard's per-layer buckets vs
    per-leaf gathers: the same loss and gradients, and the collectives each calls (eager, counted)."""
    from _checks_ep import FAMILIES

    module, make_cfg = FAMILIES[family] if family != "llama" else (llama, tiny_llama)
    model = module.model(make_cfg())
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    batch = batch_for(4, 16, model.config.vocab_size)
    layout = parallel.Layout(parallel.mesh(**degrees))
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    shardings = ft.tree.map(parallel.sharding_of, sharded)
    out: dict = {"check": name}
    grads = {}
    for buckets in ("per_layer", "per_leaf"):
        local_loss = parallel.make_parallel_loss(loss_fn, layout, shardings, buckets=buckets)
        with parallel.use(layout), C.count_calls() as calls:
            g, (loss, _) = ft.train.value_and_grad(local_loss, impl="autograd")(
                parallel.to_local(sharded), parallel.shard_batch(batch, layout))  # fmt: skip
        grads[buckets] = g
        out[f"{buckets}_calls"] = dict(calls)
        out[f"{buckets}_loss"] = float(loss)
    out["grad_diff"] = _max(_diff(ft.tree.leaves(grads["per_layer"]), ft.tree.leaves(grads["per_leaf"])))
    out["dp_shard_leaves"] = sum(1 for s in ft.tree.leaves(shardings) if "dp_shard" in s.mesh_axes())
    out["layers"] = model.config.n_layers
    return out


CHECKS.update({
    "flexshard_buckets_dp_shard2_tp2": lambda: dp_shard_buckets_check("flexshard_buckets_dp_shard2_tp2",
                                                                      {"dp_shard": 2, "tp": 2}),
    "flexshard_buckets_ep2_dp_shard2": lambda: dp_shard_buckets_check("flexshard_buckets_ep2_dp_shard2",
                                                                      {"ep": 2, "dp_shard": 2}, "qwen3_moe"),
})  # fmt: skip


def trainer_quantized_check(name: str, steps: int = 30, compiled: bool = False) -> dict:
    """The trainer's dp_shard step (``parallel.make_train_step``, 4 ranks) with int8 gathers against float32
    ones: losses within 2%, the gathers' bytes; ``compiled``: the compiled step (aot_eager, ~25 s of
    tracing a rank) against the eager one instead, both with int8 gathers."""
    model = llama.model(tiny_llama(n_layers=1))
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    layout = parallel.Layout(parallel.mesh(dp_shard=4))
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    batch = parallel.shard_batch(batch_for(8, 32, 256), layout)
    opt = ft.optim.adamw(3e-3, weight_decay=0.0)
    out: dict = {"check": name}
    runs = [("fp32", None, False), ("int8", "int8", False)]
    if compiled:
        runs = [("int8", "int8", False), ("int8_compiled", "int8", "aot_eager")]
    for label, quantize, compile in runs:
        step = parallel.make_train_step(loss_fn, opt, layout, quantize=quantize, compile=compile)
        state, losses = ft.train.init_state(sharded, opt), []
        for i in range(steps):
            with C.count_bytes() as sent, C.count_calls() as calls:
                state, m = step(state, batch)
            losses.append(float(m["loss"]))
            if i == 0 and not compile:
                out[f"{label}_gather_bytes"] = int(sent["all_gather"])
                out[f"{label}_calls"] = dict(calls)
        out[f"losses_{label}"] = losses
    return out


CHECKS["flexshard_trainer_int8_dp4"] = lambda: trainer_quantized_check("flexshard_trainer_int8_dp4")
if os.environ.get("FTITAN_SLOW_CHECKS"):
    CHECKS["flexshard_trainer_int8_dp4_compiled"] = lambda: trainer_quantized_check(
        "flexshard_trainer_int8_dp4_compiled", steps=4, compiled=True
    )


def compiled_eval_check(name: str) -> dict:
    """The parallel loss under ``torch.no_grad`` (an evaluation) compiled with fullgraph (aot_eager) against
    eager, per layout and bucket policy (int8 only per layer: per-leaf gathers refuse it). The FlexShard
    gathers' autograd Functions once failed to trace where no gradient is wanted (``packed._apply``)."""
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    batch = batch_for(8, 16, 256)
    out: dict = {"check": name, "diffs": {}}
    for degrees in ({"dp_shard": 4}, {"dp_shard": 2, "tp": 2}, {"tp": 2, "cp": 2}):
        layout = parallel.Layout(parallel.mesh(**degrees))
        sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
        local, b = parallel.to_local(sharded), parallel.shard_batch(batch, layout)
        for buckets, quantize in (("per_leaf", None), ("per_layer", None), ("per_layer", "int8")):
            loss = parallel.make_parallel_loss(ft.train.next_token_loss(model, chunk_size=24), layout,
                                               ft.tree.map(parallel.sharding_of, sharded), buckets=buckets,
                                               quantize=quantize)  # fmt: skip
            torch._dynamo.reset()
            with torch.no_grad(), parallel.use(layout):
                want = loss(local, b)[0]
                got = torch.compile(loss, fullgraph=True, backend="aot_eager")(local, b)[0]
            key = "_".join(f"{k}{v}" for k, v in degrees.items()) + f"_{buckets}_{quantize or 'fp32'}"
            out["diffs"][key] = _max(float((got - want).abs()))
    return out


if os.environ.get("FTITAN_SLOW_CHECKS"):  # 9 aot_eager compiles of a sharded forward (~2 min on 2 cores)
    CHECKS["flexshard_compiled_eval_layouts"] = lambda: compiled_eval_check("flexshard_compiled_eval_layouts")


def mesh_muon_check(name: str, degrees: dict[str, int], family: str = "llama", placement: str = "shard",
                    steps: int = 3, ns_dtype: torch.dtype = torch.float32) -> dict:  # fmt: skip
    """The trainer's distributed Muon (``flexshard.mesh_muon_with_adamw`` on DTensor state) against
    single-process ``muon_with_adamw`` with the same per-head ``blocks``, fed the same gradients (Newton-Schulz
    in fp32); and the trainer's former FSDP-only Muon (``ft.optim`` on DTensors: every rank orthogonalizes
    every matrix) as the baseline of the collectives."""
    from _checks_ep import FAMILIES

    from ftitan.flexshard import mesh as mm

    module, make_cfg = FAMILIES[family] if family != "llama" else (llama, tiny_llama)
    model = module.model(make_cfg())
    params = model.init(ft.random.key(0))
    blocks = mm.head_blocks(model)
    g = torch.Generator().manual_seed(5)
    grads = [ft.tree.map(lambda x: torch.randn(x.shape, generator=g) * 0.01, params) for _ in range(steps)]
    kw = dict(lr=0.02, adamw_lr=1e-3, ns_dtype=ns_dtype, blocks=blocks)
    opt = ft.optim.muon_with_adamw(params, **kw)
    state, ref = opt.init(params), params
    for gr in grads:
        updates, state = opt.update(gr, state, ref)
        ref = ft.optim.apply_updates(ref, updates)

    rules = mm.block_rules(parallel.default_rules(), model, degrees) if placement == "block" else None
    layout = parallel.Layout(parallel.mesh(**degrees), rules)
    place = lambda t: parallel.shard_params(t, model.param_axes, layout.rules, layout)  # noqa: E731
    sharded = place(params)
    dopt = mm.mesh_muon_with_adamw(layout, sharded, **kw)
    dstate = dopt.init(sharded)
    with C.count_calls() as calls:
        for gr in grads:
            updates, dstate = dopt.update(place(gr), dstate, sharded)
            sharded = ft.optim.apply_updates(sharded, updates)
    final = parallel.unshard(sharded)
    paths, leaves = ft.tree.paths(params), ft.tree.leaves(place(params))
    muon_paths = [p for p, x in zip(paths, ft.tree.leaves(params), strict=True) if ft.optim.muon_label(p, x) == "muon"]
    kinds = {p: mm.muon_kind(x, p, blocks) for p, x in zip(paths, leaves, strict=True) if p in muon_paths}
    diffs = {p: float((a - b).abs().max()) for p, a, b in zip(paths, ft.tree.leaves(final), ft.tree.leaves(ref),
                                                              strict=True)}  # fmt: skip
    return {"check": name, "calls_per_step": {k: v / steps for k, v in calls.items()},
            "local": sorted(p for p, k in kinds.items() if k == "local"),
            "owned": sorted(p for p, k in kinds.items() if k == "owned"),
            "blocks": {k: list(v) for k, v in blocks.items()},
            "diff": _max(max(diffs.values())), "muon_diff": _max(max(diffs[p] for p in muon_paths)),
            "moved": _max(max_diff(ref, params))}  # fmt: skip


def mesh_muon_train_check(name: str, steps: int = 12) -> dict:
    """``parallel.make_train_step`` on 4 dp_shard ranks with distributed Muon and int8 gathers (what
    ``ftitan train --recipe llama3-debug-muon-fsdp`` runs) against the single-process Muon step: losses."""
    from ftitan.flexshard import mesh as mm

    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    batch = batch_for(8, 32, 256)
    kw = dict(lr=0.02, adamw_lr=3e-3, shape_scaling="original", blocks=mm.head_blocks(model))
    opt = ft.optim.muon_with_adamw(params, **kw)
    ref_step, state, ref = ft.train.make_train_step(loss_fn, opt), ft.train.init_state(params, opt), []
    for _ in range(steps):
        state, m = ref_step(state, batch)
        ref.append(float(m["loss"]))
    layout = parallel.Layout(parallel.mesh(dp_shard=4))
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    out: dict = {"check": name, "ref": ref}
    for label, quantize in (("fp32", None), ("int8", "int8")):
        dopt = mm.mesh_muon_with_adamw(layout, sharded, **kw)
        step = parallel.make_train_step(loss_fn, dopt, layout, quantize=quantize)
        pstate, losses = ft.train.init_state(sharded, dopt), []
        for _ in range(steps):
            pstate, m = step(pstate, parallel.shard_batch(batch, layout))
            losses.append(float(m["loss"]))
        out[label] = losses
    return out


CHECKS.update({
    "mesh_muon_dp_shard4": lambda: mesh_muon_check("mesh_muon_dp_shard4", {"dp_shard": 4}),
    "mesh_muon_dp_shard2_tp2": lambda: mesh_muon_check("mesh_muon_dp_shard2_tp2", {"dp_shard": 2, "tp": 2},
                                                       ns_dtype=torch.bfloat16),
    "mesh_muon_block_dp_shard4": lambda: mesh_muon_check("mesh_muon_block_dp_shard4", {"dp_shard": 4},
                                                         placement="block"),
    "mesh_muon_block_deepseek_dp_shard4": lambda: mesh_muon_check(
        "mesh_muon_block_deepseek_dp_shard4", {"dp_shard": 4}, "deepseek_v3", "block"),
    "mesh_muon_train_dp_shard4": lambda: mesh_muon_train_check("mesh_muon_train_dp_shard4"),
})  # fmt: skip


def mesh_muon_checkpoint_check(name: str, steps: int = 2) -> dict:
    """The trainer's Muon state (DTensor params and momentum, distributed Muon) saved from dp_shard 4 with
    whole heads per rank (``--flexshard.placement block``) and loaded into dp_shard 2 x tp 2 (rows of the
    model dim): equal to the state that layout reaches itself, and one more step from either is the same."""
    import shutil
    import tempfile

    import ftitan.checkpoint as ckpt
    from ftitan.flexshard import mesh as mm

    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    g = torch.Generator().manual_seed(5)
    grads = [ft.tree.map(lambda x: torch.randn(x.shape, generator=g) * 0.01, params) for _ in range(steps + 1)]
    kw = dict(lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32, blocks=mm.head_blocks(model))

    def setup(degrees, rules=None):
        layout = parallel.Layout(parallel.mesh(**degrees), rules)
        place = lambda t: parallel.shard_params(t, model.param_axes, layout.rules, layout)  # noqa: E731
        opt = mm.mesh_muon_with_adamw(layout, params, **kw)
        sharded = place(params)
        return place, opt, {"params": sharded, "opt": opt.init(sharded)}

    def run(place, opt, state, gs):
        p, s = state["params"], state["opt"]
        for gr in gs:
            updates, s = opt.update(place(gr), s, p)
            p = ft.optim.apply_updates(p, updates)
        return {"params": p, "opt": s}

    rules_a = mm.block_rules(parallel.default_rules(), model, {"dp_shard": 4})
    place_a, opt_a, fresh_a = setup({"dp_shard": 4}, rules_a)
    saved = run(place_a, opt_a, fresh_a, grads[:steps])
    box = [tempfile.mkdtemp(prefix="ftitan-mesh-muon-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    ckpt.save(box[0], steps, saved)
    place_b, opt_b, fresh_b = setup({"dp_shard": 2, "tp": 2})
    loaded, _ = ckpt.load(box[0], fresh_b)
    own = run(place_b, opt_b, fresh_b, grads[:steps])

    def diff(x, y):
        return max(float((a - b).abs().max()) for a, b in zip(ft.tree.leaves(parallel.unshard(x)),
                                                              ft.tree.leaves(parallel.unshard(y)), strict=True))

    out = {"check": name, "state_diff": _max(diff(loaded, own)),
           "placements_differ": str(saved["params"]["layers"]["0"]["attn"]["wq"].placements)
           != str(loaded["params"]["layers"]["0"]["attn"]["wq"].placements),
           "next_diff": _max(diff(run(place_b, opt_b, loaded, grads[steps:]), run(place_b, opt_b, own, grads[steps:])))}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0])
    return out


CHECKS["mesh_muon_checkpoint_block4_to_dp2_tp2"] = lambda: mesh_muon_checkpoint_check(
    "mesh_muon_checkpoint_block4_to_dp2_tp2")
