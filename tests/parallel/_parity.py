"""Run under torchrun (gloo): every layout's loss and gradients vs a single-process run, as JSON lines.

One launch runs every check (this file's and those of each ``_checks_*.py``):
``CHECKS`` on 4 ranks, ``CHECKS_8`` when launched on 8; ``conftest.parity_results``
and ``parity_results_8`` launch each once per test session. Prints one
``RESULT {...}`` line per check on rank 0. Run some checks by name:
``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py dp_shard4``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import attrs
import torch
import torch.distributed as dist

import ftitan as ft
from ftitan import parallel
from ftitan.models import llama, qwen3

torch.set_num_threads(1)


def tiny_llama(**kw):
    return attrs.evolve(
        llama.Config.debug(), **{"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                 "ffn_dim": 128, **kw}
    )


def tiny_qwen3(**kw):
    base = qwen3.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                        max_seq_len=64, tie_embeddings=True)  # fmt: skip
    return attrs.evolve(base, **kw)


MODELS = {"llama": (llama, tiny_llama), "qwen3": (qwen3, tiny_qwen3)}


def batch_for(b: int, t: int, vocab: int) -> dict[str, torch.Tensor]:
    tok = torch.randint(0, vocab, (b, t + 1), generator=torch.Generator().manual_seed(7))
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(ft.tree.leaves(a), ft.tree.leaves(b), strict=True))


def parallel_grads(model, params, loss_fn, batch, degrees: dict[str, int], rules=None):
    """One parallel gradient: ``(loss summed over ranks, full gradients, this rank's aux, bytes sent, sharded)``."""
    layout = parallel.Layout(parallel.mesh(**degrees), rules)
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    local_loss = parallel.make_parallel_loss(loss_fn, layout, ft.tree.map(parallel.sharding_of, sharded))
    with parallel.use(layout), parallel.collectives.count_bytes() as sent:
        g, (l, aux) = ft.train.value_and_grad(local_loss, impl="autograd")(
            parallel.to_local(sharded), parallel.shard_batch(batch, layout)
        )
    total = l.detach().clone()
    dist.all_reduce(total)
    return total, parallel.unshard(parallel.from_local(g, sharded)), aux, sent, sharded


def grads_vs_one_process(model, degrees: dict[str, int], rules=None, batch: int = 4):
    """``model``'s loss and gradients on a layout against one process's, from ``model.init(key(0))``:
    ``({"loss_diff", "grad_diff", "grad_scale"}, params, full gradients, sharded params)``."""
    params = model.init(ft.random.key(0))
    batch = batch_for(batch, 16, model.config.vocab_size)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    ref_g, (ref_l, _) = ft.train.value_and_grad(loss_fn)(params, batch)
    total, full, _, _, sharded = parallel_grads(model, params, loss_fn, batch, degrees, rules)
    diffs = {"loss_diff": abs(float(total) - float(ref_l)), "grad_diff": max_diff(full, ref_g),
             "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g))}  # fmt: skip
    return diffs, params, full, sharded


def grads_check(
    name: str, family: str, degrees: dict[str, int], rules=None, impl: str = "sdpa", batch: int = 4
) -> dict:
    module, make_cfg = MODELS[family]
    diffs, *_ = grads_vs_one_process(module.model(make_cfg(attn_impl=impl)), degrees, rules, batch)
    return {"check": name, **diffs}


def steps_check(name: str, degrees: dict[str, int], n_steps: int = 5, muon: bool = False) -> dict:
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    if muon:  # Newton-Schulz in fp32 so that the comparison is not bf16 rounding
        inner = ft.optim.muon_with_adamw(params, lr=3e-3, ns_dtype=torch.float32)
    else:
        inner = ft.optim.adamw(lr=ft.optim.warmup_cosine(3e-3, warmup=2, total=n_steps), weight_decay=0.1)
    opt = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), inner)
    batches = [batch_for(4, 16, 256) for _ in range(n_steps)]
    for i, b in enumerate(batches):  # distinct batches
        g = torch.Generator().manual_seed(100 + i)
        tok = torch.randint(0, 256, (4, 17), generator=g)
        b.update(inputs=tok[:, :-1], targets=tok[:, 1:])
    ref_step = ft.train.make_train_step(loss_fn, opt)
    state = ft.train.init_state(params, opt)
    ref_losses = []
    for b in batches:
        state, m = ref_step(state, b)
        ref_losses.append(float(m["loss"]))

    layout = parallel.Layout(parallel.mesh(**degrees))
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    step = parallel.make_train_step(loss_fn, opt, layout)
    pstate = ft.train.init_state(sharded, opt)
    losses = []
    for b in batches:
        pstate, m = step(pstate, parallel.shard_batch(b, layout))
        losses.append(float(m["loss"]))
    final = parallel.unshard(pstate.params)
    return {"check": name, "losses": losses, "ref_losses": ref_losses,
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "param_diff": max_diff(final, state.params)}  # fmt: skip


def compiled_steps_check(name: str, degrees: dict[str, int]) -> dict:
    """Three steps of the compiled parallel step (aot_eager) against the eager one and one process. The steps
    after the first (new data, a new warmup-cosine lr) must not recompile. The optimizer runs on each rank's
    shards, compiled layer by layer with the global gradient statistics: AdamW behind an active clip and the
    non-finite guard, whose second step gets an infinite loss. ``record``: the optimizer's calls outside a
    compiled graph, and whether a traced one saw DTensors."""
    from torch.distributed.tensor import DTensor

    model = llama.model(tiny_llama(n_layers=1))
    params = model.init(ft.random.key(0))
    lr = ft.optim.warmup_cosine(1e-2, warmup=0, total=3)  # a new lr each step (a tensor: no recompile)
    inner = ft.optim.chain(ft.optim.clip_by_global_norm(0.05), ft.optim.adamw(lr, weight_decay=0.1))
    base = ft.optim.apply_if_finite(inner, 3)
    record = {"eager_calls": 0, "eager_dtensor": None, "traced_dtensor": None}  # keys stay put: dynamo guards them

    def spy(grads, state, params=None):
        if torch.compiler.is_compiling():  # a constant to dynamo: no graph break, nothing traced
            record["traced_dtensor"] = isinstance(ft.tree.leaves(grads)[0], DTensor)
        else:
            record["eager_calls"] += 1
            record["eager_dtensor"] = isinstance(ft.tree.leaves(grads)[0], DTensor)
        return base.update(grads, state, params)

    opt = base._replace(update=spy)
    lm = ft.train.next_token_loss(model, chunk_size=24)

    def loss_fn(p, b):  # rows carry a scale: inf makes every gradient non-finite
        loss, aux = lm(p, {k: b[k] for k in ("inputs", "targets")})
        return loss * b["scale"][0], aux

    batches = []
    for i, scale in enumerate((1.0, float("inf"), 1.0)):
        tok = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(200 + i))
        batches.append({"inputs": tok[:, :-1], "targets": tok[:, 1:], "scale": torch.full((4,), scale)})
    ref_step, ref = ft.train.make_train_step(loss_fn, opt), ft.train.init_state(params, opt)
    ref_params = []
    for b in batches:
        ref, _ = ref_step(ref, b)
        ref_params.append(ref.params)
    layout = parallel.Layout(parallel.mesh(**degrees))
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    out: dict = {"check": name}
    for label, compile in (("eager", False), ("compiled", "aot_eager")):
        record.update(eager_calls=0, eager_dtensor=None, traced_dtensor=None)
        step, state = parallel.make_train_step(loss_fn, opt, layout, compile=compile), ft.train.init_state(sharded, opt)
        diffs, norms, full = [], [], []
        for i, (b, want) in enumerate(zip(batches, ref_params, strict=True)):
            with torch._dynamo.config.patch(error_on_recompile=bool(compile) and i > 0):
                state, m = step(state, parallel.shard_batch(b, layout))
            full.append(parallel.unshard(state.params))
            diffs.append(max_diff(full[-1], want))
            norms.append(float(m["grad_norm"]))
        guard = ft.optim.find_finite_guard(state.opt_state)
        out[label] = {"diffs": diffs, "grad_norms": norms, "record": dict(record), "skipped_moved": max_diff(full[1], full[0]),
                      "total_notfinite": int(guard.total_notfinite)}  # fmt: skip
        out[f"{label}_params"] = parallel.unshard(state.params)
    out["eager_vs_compiled"] = max_diff(out.pop("eager_params"), out.pop("compiled_params"))
    return out


def shard_as_check(name: str) -> dict:
    """``shard_as`` under torch.func.grad (eager) and torch.compile: this rank's rows; gradient all-gathered."""
    layout = parallel.Layout(parallel.mesh(dp_shard=4))
    x = torch.arange(32.0).reshape(8, 4)
    index, _ = layout.data_rank()

    def f(x):
        return (parallel.shard_as(x, ("batch", None)) ** 2).sum()

    with parallel.use(layout):
        local = parallel.shard_as(x, ("batch", None))
        g = torch.func.grad(f)(x)
        compiled = torch.compile(lambda x: parallel.shard_as(x, ("batch", None)) * 2, backend="aot_eager", fullgraph=True)(x)
    return {"check": name, "block_ok": bool(torch.equal(local, x[2 * index : 2 * index + 2])),
            "grad_ok": bool(torch.equal(g, 2 * x)),  # every rank's rows' gradient, gathered
            "compiled_ok": bool(torch.equal(compiled, 2 * local))}  # fmt: skip


def _gathered(state, full_like, layout):
    """Full tensors of a (staged) state on every rank: DTensors unsharded, pp stages gathered by path."""
    mine = parallel.unshard(state)
    if layout.sizes["pp"] == 1:
        return mine
    paths, leaves, _ = ft.tree.flatten_with_paths(mine)
    stages = [None] * layout.sizes["pp"]
    dist.all_gather_object(stages, dict(zip(paths, leaves, strict=True)), group=layout.group("pp").get_group())
    by_path = {p: x for stage in stages for p, x in stage.items()}
    return ft.tree.map_with_path(lambda p, _: by_path[p], full_like)


def reshard_check(name: str, a_degrees: dict[str, int], b_degrees: dict[str, int]) -> dict:
    """A train state saved as a sharded checkpoint under one layout (each rank its own blocks) and loaded
    under another (each rank reads only its new blocks): equal to the single-process state, unchanged."""
    import shutil
    import tempfile

    from ftitan.config.schema import ParallelConfig
    from ftitan.train.runtime import Runtime

    model = llama.model(tiny_llama(tie_embeddings=False))
    params = model.init(ft.random.key(0))
    opt = ft.optim.adamw(lr=1e-3)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    a = Runtime(parallel.Layout(parallel.mesh(**a_degrees)), ParallelConfig(**a_degrees))
    b = Runtime(parallel.Layout(parallel.mesh(**b_degrees)), ParallelConfig(**b_degrees))
    batch = batch_for(8, 16, 256)
    ref, _ = ft.train.make_train_step(loss_fn, opt)(ft.train.init_state(params, opt), batch)
    step = a.make_step(model, loss_fn, opt, accum_steps=1, compile=False, update_buffers=None)
    state_a, _ = step(ft.train.init_state(a.place(params, model), opt), a.local_batch(batch))  # moments != 0
    full_like = ft.train.init_state(params, opt)
    where = [tempfile.mkdtemp(prefix="ftitan-reshard-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    ft.checkpoint.save(where[0], 1, state_a)  # collective: each rank writes its blocks
    like_b = ft.train.init_state(b.place(params, model), opt)
    state_b, _ = ft.checkpoint.load(where[0], like_b, whole=full_like)
    full, again = _gathered(state_a, full_like, a.layout), _gathered(state_b, full_like, b.layout)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where[0])
    wq = state_b.params["layers"]["0"]["attn"]["wq"]
    return {"check": name, "diff": max_diff(again, full), "wq_local": list(wq.to_local().shape),
            "vs_single": max_diff(full, ref)}  # fmt: skip


def logits_check(name: str, degrees: dict[str, int], model=None, params=None) -> dict:
    """``apply(..., logits=True)`` under a layout (the head gathered: the loss alone is vocab-parallel); default a
    tied Qwen3 (the gathered head is the vocab-split embedding), or ``model`` at ``params`` (vocab 256)."""
    if model is None:
        model = qwen3.model(tiny_qwen3())
        params = model.init(ft.random.key(0))
    batch = batch_for(4, 16, 256)
    ref, _ = model.apply(params, batch["inputs"])
    layout = parallel.Layout(parallel.mesh(**degrees))
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    view = parallel.gathered(parallel.to_local(sharded), ft.tree.map(parallel.sharding_of, sharded), layout)
    with parallel.use(layout), torch.no_grad():
        got, _ = model.apply(view, parallel.shard_batch(batch, layout)["inputs"])
    index, count = layout.data_rank()
    return {"check": name, "shape_ok": list(got.shape) == [4 // count, 16, 256],
            "diff": float((got - ref.chunk(count)[index]).abs().max())}  # fmt: skip


CHECKS = {
    "logits_dp_shard2_tp2": lambda: logits_check("logits_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
    "reshard_dp2_tp2_to_dp4": lambda: reshard_check("reshard_dp2_tp2_to_dp4", {"dp_shard": 2, "tp": 2}, {"dp_shard": 4}),
    "reshard_pp2_dp2_to_dp2_tp2": lambda: reshard_check(
        "reshard_pp2_dp2_to_dp2_tp2", {"pp": 2, "dp_shard": 2}, {"dp_shard": 2, "tp": 2}
    ),
    "shard_as_func_compile": lambda: shard_as_check("shard_as_func_compile"),
    "dp_shard4": lambda: grads_check("dp_shard4", "llama", {"dp_shard": 4}),
    "dp_replicate2_dp_shard2": lambda: grads_check("dp_replicate2_dp_shard2", "llama", {"dp_replicate": 2, "dp_shard": 2}),
    "dp_shard2_tp2": lambda: grads_check("dp_shard2_tp2", "llama", {"dp_shard": 2, "tp": 2}),
    "dp_shard2_tp2_no_sp": lambda: grads_check(
        "dp_shard2_tp2_no_sp", "llama", {"dp_shard": 2, "tp": 2}, parallel.default_rules().with_rule("norm_seq", ("cp",))
    ),
    "qwen3_dp_shard2_tp2": lambda: grads_check("qwen3_dp_shard2_tp2", "qwen3", {"dp_shard": 2, "tp": 2}),
    "tp2_cp2": lambda: grads_check("tp2_cp2", "llama", {"tp": 2, "cp": 2}),
    "tp2_cp2_math": lambda: grads_check("tp2_cp2_math", "qwen3", {"tp": 2, "cp": 2}, impl="math"),
    "steps_dp_shard2_tp2": lambda: steps_check("steps_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
    "muon_steps_dp_shard2_tp2": lambda: steps_check("muon_steps_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}, 3, muon=True),
    "compiled_steps_dp_shard2_tp2": lambda: compiled_steps_check(
        "compiled_steps_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}
    ),
}

# layouts on 8 ranks (run by a launch of 8 processes; the 4-rank launch skips them)
CHECKS_8 = {
    "dp_shard2_tp2_cp2": lambda: grads_check("dp_shard2_tp2_cp2", "llama", {"dp_shard": 2, "tp": 2, "cp": 2}),
    "dp_replicate2_dp_shard2_tp2": lambda: grads_check(
        "dp_replicate2_dp_shard2_tp2", "qwen3", {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    ),
    "dp_shard8": lambda: grads_check("dp_shard8", "llama", {"dp_shard": 8}, batch=8),
}


def all_checks() -> dict:
    """This file's checks plus those of every ``_checks_*.py`` next to it (each defines ``CHECKS``)."""
    import importlib.util
    from pathlib import Path

    eight = dist.is_initialized() and dist.get_world_size() == 8
    checks = dict(CHECKS_8 if eight else CHECKS)
    for path in sorted(Path(__file__).parent.glob("_checks_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        checks.update(getattr(mod, "CHECKS_8", {}) if eight else mod.CHECKS)
    return checks


def main() -> None:
    dist.init_process_group("gloo")
    checks = all_checks()
    names = sys.argv[1:] or list(checks)
    for name in names:
        # each check compiles from scratch, as in a process of its own: the steps of two checks share code
        # objects (make_train_step's closure), and a second compile of one with other shapes would turn on
        # dynamo's automatic dynamic shapes (one symbolic aot_eager compile took over 10 minutes)
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            result = checks[name]()
        except Exception as e:  # report, keep going: one launch runs every layout
            result = {"check": name, "error": f"{type(e).__name__}: {e}"}
            if os.environ.get("FTITAN_RAISE"):
                raise
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({**result, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    parallel.shutdown()


if __name__ == "__main__":
    main()
    parallel.end_rank()  # past shutdown's barrier: no interpreter finalization for gloo's threads to abort in
