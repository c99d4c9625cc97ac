"""Pipeline-parallel parity checks, merged into the ``_parity.py`` launch (4 gloo ranks).

Each check runs the pipeline grad function (``parallel.pipeline_grad``) on
this rank's stage and compares the loss and every stage's gradients (or 3
training steps) with a single-process run; results are reduced to rank 0
(max over ranks), which prints them. Run alone:
``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py pp2_dp_shard2_1f1b``.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

import ftitan as ft
from ftitan import parallel
from ftitan.models import llama
from ftitan.parallel import collectives as C

# the launch script's directory is on sys.path (torchrun runs tests/parallel/_parity.py)
from _parity import MODELS, batch_for, max_diff, tiny_llama

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
}
