"""Pipeline-parallel parity checks, merged into the ``_parity.py`` launch (4 gloo ranks).

Each check runs the pipeline grad function (``parallel.pipeline_grad``) on
this rank's stage and compares the loss and every stage's gradients (or 3
training steps) with a single-process run; results are reduced to rank 0
(max over ranks), which prints them. Run alone:
``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py pp2_dp_shard2_1f1b``.
"""

from __future__ import annotations

import contextlib

import attrs
import torch
import torch.distributed as dist

import ftitan as ft
from ftitan import parallel
from ftitan.models import deepseek_v3, llama, qwen3_moe
from ftitan.parallel import collectives as C

# the launch script's directory is on sys.path (torchrun runs tests/parallel/_parity.py)
from _parity import MODELS, batch_for, max_diff, tiny_llama
from _checks_ep import batch_for as moe_batch_for
from _checks_ep import init_params, tiny_deepseek_v3, tiny_qwen3_moe

torch.set_num_threads(1)

SEQ = 16


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _gathered(obj: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _stage_state(model, params, layout):
    """This rank's stage of ``params`` as DTensors, and their shardings."""
    stage = parallel.stage_params(params, model, layout)
    axes = parallel.stage_params(model.param_axes, model, layout)
    sharded = parallel.shard_params(stage, axes, layout.rules, layout)
    return sharded, ft.tree.map(parallel.sharding_of, sharded)


def pipeline_vs_one_process(model, params, batch, ref_g, layout, context=None) -> tuple[float, float]:
    """The 1f1b pipeline (2 micro-batches, under ``context`` if given) on ``params``: ``(its loss summed over
    ranks, the largest difference over ranks of its gradients from ref_g)``, one process's gradients."""
    sharded, shardings = _stage_state(model, params, layout)
    make = parallel.pipeline_grad(model, layout, schedule="1f1b", n_microbatches=2, chunk_size=24)
    with context or contextlib.nullcontext(), parallel.use(layout):
        g, (l, _) = make(shardings)(parallel.to_local(sharded), parallel.shard_batch(batch, layout))
    total = l.detach().clone()
    dist.all_reduce(total)  # weighted losses: 0 off the last stage, sum = the global mean
    full = parallel.unshard(parallel.from_local(g, sharded))
    return float(total), _max_over_ranks(max_diff(full, parallel.stage_params(ref_g, model, layout)))


def _expected_sends(layout, model, local_rows: int, n_microbatches: int) -> int:
    """Bytes this rank sends: one fp32 activation (b, T / cp / tp under sequence parallelism, D) per micro-batch
    forward (plus a 64-byte shape header) unless last, one gradient of it per backward unless first."""
    pp, stage = layout.sizes["pp"], layout.coords["pp"]
    t = SEQ // layout.sizes["cp"] // (layout.tp if layout.sequence_parallel else 1)
    one = local_rows // n_microbatches * t * model.config.dim * 4
    return (stage < pp - 1) * (n_microbatches * one + 64) + (stage > 0) * n_microbatches * one


def pp_grads_check(name: str, degrees: dict[str, int], *, schedule: str, n_microbatches: int = 4,
                   family: str = "llama", batch_size: int = 8, **cfg) -> dict:  # fmt: skip
    module, make_cfg = MODELS[family]
    model = module.model(attrs.evolve(make_cfg(), **cfg))  # cfg: e.g. n_layers (tiny_* fix them)
    params = model.init(ft.random.key(0))
    batch = batch_for(batch_size, SEQ, model.config.vocab_size)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    ref_g, (ref_l, _) = ft.train.value_and_grad(loss_fn)(params, batch)

    layout = parallel.Layout(parallel.mesh(**degrees))
    sharded, shardings = _stage_state(model, params, layout)
    make = parallel.pipeline_grad(model, layout, schedule=schedule, n_microbatches=n_microbatches, chunk_size=24)
    local_batch = parallel.shard_batch(batch, layout)
    with C.count_bytes() as counts, parallel.use(layout):
        g, (l, _) = make(shardings)(parallel.to_local(sharded), local_batch)
    total = l.detach().clone()
    dist.all_reduce(total)  # weighted losses: 0 off the last stage, sum = the global mean
    full = parallel.unshard(parallel.from_local(g, sharded))
    ref_stage = parallel.stage_params(ref_g, model, layout)
    covered = set().union(*_gathered(ft.tree.paths(full))) == set(ft.tree.paths(ref_g))
    expected = _expected_sends(layout, model, local_batch["inputs"].shape[0], n_microbatches)
    return {"check": name, "loss_diff": abs(float(total) - float(ref_l)),
            "grad_diff": _max_over_ranks(max_diff(full, ref_stage)), "covered": covered,
            "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g)),
            "sends": _gathered(counts["send"]), "expected_sends": _gathered(expected)}  # fmt: skip


def pp_steps_check(name: str, degrees: dict[str, int], *, schedule: str = "1f1b", n_steps: int = 3) -> dict:
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    # a clip that binds (grad norms here are ~1-3): each stage must scale by the whole model's norm
    opt = ft.optim.chain(ft.optim.clip_by_global_norm(0.5), ft.optim.adamw(lr=3e-3, weight_decay=0.1))
    batches = []
    for i in range(n_steps):
        tok = torch.randint(0, 256, (8, SEQ + 1), generator=torch.Generator().manual_seed(100 + i))
        batches.append({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    ref_step, state = ft.train.make_train_step(loss_fn, opt), ft.train.init_state(params, opt)
    ref = []
    for b in batches:
        state, m = ref_step(state, b)
        ref.append((float(m["loss"]), float(m["grad_norm"])))

    layout = parallel.Layout(parallel.mesh(**degrees))
    sharded, _ = _stage_state(model, params, layout)
    grad_fn = parallel.pipeline_grad(model, layout, schedule=schedule, n_microbatches=4, chunk_size=24)
    step = parallel.make_train_step(None, opt, layout, grad_fn=grad_fn)
    pstate = ft.train.init_state(sharded, opt)
    got = []
    for b in batches:
        pstate, m = step(pstate, parallel.shard_batch(b, layout))
        got.append((float(m["loss"]), float(m["grad_norm"])))
    final = parallel.unshard(pstate.params)
    ref_final = parallel.stage_params(state.params, model, layout)
    everyone = _gathered([x for x, _ in got])  # metrics must be the same on every rank
    return {"check": name, "losses": [x for x, _ in got], "ref_losses": [x for x, _ in ref],
            "loss_diff": max(abs(a[0] - b[0]) for a, b in zip(got, ref, strict=True)),
            "grad_norm_diff": max(abs(a[1] - b[1]) for a, b in zip(got, ref, strict=True)),
            "ref_grad_norms": [x for _, x in ref],
            "loss_spread": max(abs(a - b) for losses in everyone for a, b in zip(losses, everyone[0], strict=True)),
            "param_diff": _max_over_ranks(max_diff(final, ref_final))}  # fmt: skip


# ---------------------------------------------------------------- MoE families

MOE = {"qwen3_moe": lambda: tiny_qwen3_moe(n_layers=4),  # untied, 8 experts top 2, aux_loss_coef 0.1
       "deepseek_v3": lambda: tiny_deepseek_v3(n_layers=4)}  # first layer dense, nonzero router biases  # fmt: skip


def microbatched_loss(model, n_data: int, n_microbatches: int):
    """The pipeline's objective in one process: ``sum_m n_m / N (CE_m + c LB_m)`` over the global
    micro-batches (micro-batch ``m`` of every data rank's rows, as ``shard_batch`` and the pipeline split
    them), with the router loads summed over them. The balancing loss pools a micro-batch's statistics
    (as gradient accumulation does): the pipeline cannot know a later micro-batch's loads in 1F1B."""
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)

    def fn(params, batch):
        b = batch["inputs"].shape[0]
        rows = torch.arange(b).view(n_data, n_microbatches, -1).transpose(0, 1)  # (M, data rank, rows)
        n = (batch["targets"] != ft.train.IGNORE_INDEX).sum()
        total, load, lb = 0.0, 0.0, 0.0
        for idx in rows:
            mb = {k: v[idx.reshape(-1)] for k, v in batch.items()}
            loss, aux = loss_fn(params, mb)
            w = aux["n_tokens"] / n
            total, load, lb = total + w * loss, load + aux["moe.tokens_per_expert"], lb + w * aux["moe.aux_loss"]
        max_load = (load.amax(-1) / load.mean(-1).clamp(min=1e-9)).amax()
        return total, {"n_tokens": n, "moe.tokens_per_expert": load, "moe.aux_loss": lb, "moe.max_load": max_load}

    return fn


def pp_moe_grads_check(name: str, family: str, degrees: dict[str, int], *, n_microbatches: int = 4) -> dict:
    module = {"qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}[family]
    model = module.model(MOE[family]())
    params = init_params(family, model)
    batch = moe_batch_for(8, SEQ, model.config.vocab_size)
    layout = parallel.Layout(parallel.mesh(**degrees))
    n_data = layout.data_rank()[1]
    ref_fn = microbatched_loss(model, n_data, n_microbatches)
    ref_g, (ref_l, ref_aux) = ft.train.value_and_grad(ref_fn)(params, batch)

    sharded, shardings = _stage_state(model, params, layout)
    make = parallel.pipeline_grad(model, layout, schedule="1f1b", n_microbatches=n_microbatches, chunk_size=24)
    with parallel.use(layout):
        g, (l, aux) = make(shardings)(parallel.to_local(sharded), parallel.shard_batch(batch, layout))
    total = l.detach().clone()
    dist.all_reduce(total)  # every stage's weighted share (CE on the last, balancing terms on each)
    full = parallel.unshard(parallel.from_local(g, sharded))
    ref_stage = parallel.stage_params(ref_g, model, layout)
    covered = set().union(*_gathered(ft.tree.paths(full))) == set(ft.tree.paths(ref_g))
    router = [f"layers.{i}.moe.router" for i in range(model.config.n_layers)]
    return {"check": name, "loss_diff": abs(float(total) - float(ref_l)),
            "grad_diff": _max_over_ranks(max_diff(full, ref_stage)), "covered": covered,
            "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g)),
            "router_grad_scale": max(float(v.abs().max()) for k, v in zip(*ft.tree.flatten_with_paths(ref_g)[:2],
                                                                           strict=True) if k in router),
            "load_diff": _max_over_ranks(max_diff(aux["moe.tokens_per_expert"], ref_aux["moe.tokens_per_expert"])),
            "aux_loss_diff": _max_over_ranks(max_diff(aux["moe.aux_loss"], ref_aux["moe.aux_loss"]))}  # fmt: skip


def pp_moe_steps_check(name: str, degrees: dict[str, int], n_steps: int = 3, n_microbatches: int = 4) -> dict:
    """``n_steps`` of AdamW on DeepSeek-V3 with ``update_buffers`` (router-bias balancing), pipeline vs single."""
    model = deepseek_v3.model(MOE["deepseek_v3"]())
    params = init_params("deepseek_v3", model)
    opt = ft.optim.chain(
        ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(lr=3e-3, weight_decay=0.1), ft.optim.freeze(model.frozen)
    )
    batches = [moe_batch_for(8, SEQ, 256, seed=100 + i) for i in range(n_steps)]
    layout = parallel.Layout(parallel.mesh(**degrees))
    ref_fn = microbatched_loss(model, layout.data_rank()[1], n_microbatches)
    ref_step = ft.train.make_train_step(ref_fn, opt, update_buffers=model.update_buffers)
    state, ref = ft.train.init_state(params, opt), []
    for b in batches:
        state, m = ref_step(state, b)
        ref.append(m)

    sharded, _ = _stage_state(model, params, layout)
    grad_fn = parallel.pipeline_grad(model, layout, schedule="1f1b", n_microbatches=n_microbatches, chunk_size=24)
    step = parallel.make_train_step(None, opt, layout, grad_fn=grad_fn, update_buffers=model.update_buffers)
    pstate, got = ft.train.init_state(sharded, opt), []
    for b in batches:
        pstate, m = step(pstate, parallel.shard_batch(b, layout))
        got.append(m)
    final = parallel.unshard(pstate.params)
    ref_final = parallel.stage_params(state.params, model, layout)

    def biases(p):
        return [p["layers"][k]["moe"]["router_bias"] for k in sorted(p["layers"], key=int) if "moe" in p["layers"][k]]

    def metric_diff(key):
        return _max_over_ranks(max(float((a[key] - b[key]).abs().max()) for a, b in zip(got, ref, strict=True)))

    return {"check": name, "losses": [float(m["loss"]) for m in got],
            "ref_losses": [float(m["loss"]) for m in ref],
            "loss_diff": metric_diff("loss"), "load_diff": metric_diff("moe.tokens_per_expert"),
            "aux_loss_diff": metric_diff("moe.aux_loss"), "max_load_diff": metric_diff("moe.max_load"),
            "bias_diff": _max_over_ranks(max_diff(biases(final), biases(ref_final))),
            "bias_moved": max_diff(biases(final), biases(parallel.stage_params(params, model, layout))),
            "param_diff": _max_over_ranks(max_diff(final, ref_final))}  # fmt: skip


CHECKS = {
    "pp2_dp_shard2_1f1b": lambda: pp_grads_check("pp2_dp_shard2_1f1b", {"pp": 2, "dp_shard": 2}, schedule="1f1b"),
    "pp2_dp_shard2_gpipe_3layers": lambda: pp_grads_check(
        "pp2_dp_shard2_gpipe_3layers", {"pp": 2, "dp_shard": 2}, schedule="gpipe", n_layers=3
    ),
    "pp2_tp2_1f1b": lambda: pp_grads_check("pp2_tp2_1f1b", {"pp": 2, "tp": 2}, schedule="1f1b"),
    "qwen3_pp2_tp2_1f1b": lambda: pp_grads_check(
        "qwen3_pp2_tp2_1f1b", {"pp": 2, "tp": 2}, schedule="1f1b", family="qwen3", tie_embeddings=False
    ),
    "pp2_cp2_1f1b": lambda: pp_grads_check("pp2_cp2_1f1b", {"pp": 2, "cp": 2}, schedule="1f1b"),
    "pp4_1f1b": lambda: pp_grads_check("pp4_1f1b", {"pp": 4}, schedule="1f1b", n_microbatches=8, n_layers=4),
    "steps_pp2_dp_shard2": lambda: pp_steps_check("steps_pp2_dp_shard2", {"pp": 2, "dp_shard": 2}),
    "qwen3_moe_pp2_dp_shard2_1f1b": lambda: pp_moe_grads_check(
        "qwen3_moe_pp2_dp_shard2_1f1b", "qwen3_moe", {"pp": 2, "dp_shard": 2}
    ),
    "deepseek_v3_pp2_ep2_1f1b": lambda: pp_moe_grads_check("deepseek_v3_pp2_ep2_1f1b", "deepseek_v3", {"pp": 2, "ep": 2}),
    "steps_deepseek_v3_pp2_ep2": lambda: pp_moe_steps_check("steps_deepseek_v3_pp2_ep2", {"pp": 2, "ep": 2}),
}
