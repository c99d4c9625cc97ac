"""``ftitan bench flexshard``: FlexShard's three claims, measured side by side on N gloo ranks (one thread each).

The parent launches ``torchrun --nproc-per-node N`` once; rank 0 prints one line per part, and the parent
prints one JSON object (DESIGN.md, "Benchmarks"):

- ``optimizer``: the time of one ``muon_with_adamw`` update (the step's optimizer, after the gradients
  are reduced) over the model's parts, distributed Muon (``flexshard``: every hidden matrix ``Owned``, a
  rank orthogonalizes only its own, owners balanced by Newton-Schulz cost) against the FSDP-only baseline
  (``fsdp``: every matrix row-sharded, so every rank all-gathers every Muon matrix and orthogonalizes all
  of them). Goal: ``flexshard/fsdp <= 0.30`` (>= 70% less optimizer time; 75% is the ideal on 4 ranks).
- ``trainer_optimizer``: the same update in ``ftitan train`` (on the DTensor state the rules place:
  dp_shard over each weight's model dim), the trainer's distributed Muon (``flexshard.mesh_muon``: each
  matrix orthogonalized by one owner rank, its shards sent there and its update back by two all-to-alls)
  against FSDP-only Muon on DTensors (every rank gathers and orthogonalizes every matrix). Goal:
  ``distributed/gather <= 0.30``.
- ``gather_bytes``: the bytes a rank sends to all-gather the params once (one step's gathers), per layer
  buckets in bf16 against blockwise-quantized int8 and fp8 (a byte per value plus a float32 scale per
  128 values, in the same buffer), and the all-gathers called (one per bucket). Goal: ``int8/bf16 <= 0.52``
  (and fp8's), one collective per bucket.
- ``step``: one step of the trainer's parallel step under ``dp_shard`` (``parallel.make_train_step``:
  gathers, forward, backward with its reduce-scatters, AdamW) with FlexShard's default policy (a bucket
  per layer) against ``per_leaf`` (a collective per tensor). Goal: ``per_layer/per_leaf <= 1.0`` (not
  slower), with fewer collectives (counted).

Times are medians over ``--rounds`` (after ``--warmup``) of the slowest rank (a barrier on each side).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from ftitan.bench import timing

__all__ = ["GOALS", "Options", "main", "run"]

GOALS = {"optimizer flexshard/fsdp": 0.30, "trainer_optimizer distributed/gather": 0.30,
         "gather_bytes int8/bf16": 0.52, "gather_bytes fp8/bf16": 0.52,
         "step per_layer/per_leaf": 1.0}  # fmt: skip


@attrs.frozen(kw_only=True)
class Options:
    """Options of ``ftitan bench flexshard``."""

    nproc: int = 4
    """Ranks (processes) to launch, one thread each."""
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 2048
    seq_len: int = 128
    batch_size: int = 8
    warmup: int = 1
    rounds: int = 5
    quick: bool = False
    """A tiny model and one timed round: checks the benchmark runs, measures nothing."""
    out: Path | None = None
    """Also write the JSON here."""


def _config(opts: Options) -> dict[str, Any]:
    if opts.quick:
        return {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "seq_len": 16,
                "batch_size": opts.nproc}  # fmt: skip
    return {k: getattr(opts, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len",
                                          "batch_size")}  # fmt: skip


def _model(cfg: dict[str, Any]) -> Any:
    from ftitan.models import llama

    return llama.model(llama.Config(vocab_size=cfg["vocab_size"], dim=cfg["dim"], n_layers=cfg["n_layers"],
                                    n_heads=cfg["n_heads"], n_kv_heads=cfg["n_kv_heads"], ffn_dim=3 * cfg["dim"],
                                    max_seq_len=max(cfg["seq_len"], 64)))  # fmt: skip


def _timed(fn: Any, warmup: int, rounds: int) -> list[float]:
    """Seconds of ``fn()`` on the slowest rank, per round (a barrier before and after)."""
    import torch.distributed as dist

    times = []
    for i in range(warmup + rounds):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _peer(times: list[float], **extra: Any) -> dict[str, Any]:
    return {"median_s": statistics.median(times), "times_s": times, **extra}


def _optimizer_part(cfg: dict[str, Any], warmup: int, rounds: int) -> dict[str, Any]:
    import ftitan as ft
    from ftitan import flexshard as fs
    from ftitan import parallel
    from ftitan.optim import muon_label

    params = _model(cfg).init(ft.random.key(0))
    g = torch.Generator().manual_seed(1)
    grads = ft.tree.map(lambda x: torch.randn(x.shape, generator=g) * 1e-3, params)
    group = parallel.mesh(dp_shard=int(os.environ["WORLD_SIZE"]))["dp_shard"]
    paths, leaves = ft.tree.paths(params), ft.tree.leaves(params)
    hidden = [p for p, x in zip(paths, leaves, strict=True) if muon_label(p, x) == "muon"]
    policies = {
        "fsdp": [fs.Bucket("**.*norm*", fs.Replicate(), name="norms"), *fs.per_layer(params, fs.Shard(0))],
        "flexshard": [fs.Bucket("**.*norm*", fs.Replicate(), name="norms"),
                      fs.Bucket(hidden, fs.Owned(), name="matrices"), *fs.per_layer(params, fs.Shard(0))],
    }  # fmt: skip
    out = {}
    for name, buckets in policies.items():
        plan = fs.plan(params, buckets, group)
        opt = fs.muon_with_adamw(plan, params, lr=0.02, adamw_lr=1e-3)
        local, local_grads = plan.shard(params), plan.shard(grads)
        state = opt.init(local)
        kinds = [fs.local_kind(plan, p, None) for p in hidden]
        with parallel.collectives.count_calls() as calls:
            opt.update(local_grads, state, local)
        out[name] = _peer(_timed(lambda: opt.update(local_grads, state, local), warmup, rounds),
                          gathered_matrices=kinds.count("gather"), collectives=dict(calls),
                          owned_here=sum(1 for p in hidden if plan.leaves[p].owner == plan.rank))  # fmt: skip
    return out


def _trainer_optimizer_part(cfg: dict[str, Any], warmup: int, rounds: int) -> dict[str, Any]:
    """The trainer's optimizer (``muon_with_adamw`` on its DTensor state, dp_shard over the model dim):
    distributed Muon (``flexshard.mesh_muon``: each matrix orthogonalized by its owner, two all-to-alls)
    against the trainer's former FSDP-only Muon (``ft.optim`` on DTensors: every rank gathers and
    orthogonalizes every matrix)."""
    from torch.distributed.tensor.experimental import implicit_replication

    import ftitan as ft
    from ftitan import parallel
    from ftitan.flexshard import mesh as mm

    model = _model(cfg)
    params = model.init(ft.random.key(0))
    g = torch.Generator().manual_seed(1)
    grads = ft.tree.map(lambda x: torch.randn(x.shape, generator=g) * 1e-3, params)
    layout = parallel.Layout(parallel.mesh(dp_shard=int(os.environ["WORLD_SIZE"])))
    place = lambda t: parallel.shard_params(t, model.param_axes, layout.rules, layout)  # noqa: E731
    sharded, sharded_grads = place(params), place(grads)
    kw = dict(lr=0.02, adamw_lr=1e-3)
    out = {}
    for name, opt in (("gather", ft.optim.muon_with_adamw(params, **kw)),
                      ("distributed", mm.mesh_muon_with_adamw(layout, params, **kw))):  # fmt: skip
        state = opt.init(sharded)

        def update() -> None:
            with implicit_replication():  # as parallel.make_train_step runs it
                opt.update(sharded_grads, state, sharded)

        with parallel.collectives.count_calls() as calls:
            update()
        out[name] = _peer(_timed(update, warmup, rounds), collectives=dict(calls))
    return out


def _gather_part(cfg: dict[str, Any]) -> dict[str, Any]:
    import ftitan as ft
    from ftitan import flexshard as fs
    from ftitan import parallel

    params = _model(cfg).init(ft.random.key(0))
    group = parallel.mesh(dp_shard=int(os.environ["WORLD_SIZE"]))["dp_shard"]
    out = {}
    for name, kw in (("bf16", {"gather_dtype": torch.bfloat16}), ("int8", {"quantize": "int8"}),
                     ("fp8", {"quantize": "fp8"})):  # fmt: skip
        plan = fs.plan(params, [fs.Bucket("**.*norm*", fs.Replicate(), name="norms"),
                                *fs.per_layer(params, fs.Shard(0), **kw)], group)  # fmt: skip
        local = plan.shard(params)
        with parallel.collectives.count_bytes() as sent, parallel.collectives.count_calls() as calls:
            plan.unshard(local)
        out[name] = {"bytes_per_rank": int(sent["all_gather"]), "all_gathers": int(calls["all_gather"]),
                     "buckets": sum(1 for b in plan.buckets if plan.padded[b])}  # fmt: skip
    return out


def _step_part(cfg: dict[str, Any], warmup: int, rounds: int) -> dict[str, Any]:
    """The trainer's parallel step under ``dp_shard`` (``parallel.make_train_step``, AdamW), per-layer
    buckets against per-leaf gathers."""
    import ftitan as ft
    from ftitan import parallel

    model = _model(cfg)
    params = model.init(ft.random.key(0))
    layout = parallel.Layout(parallel.mesh(dp_shard=int(os.environ["WORLD_SIZE"])))
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg["vocab_size"], (cfg["batch_size"], cfg["seq_len"] + 1), generator=g)
    batch = parallel.shard_batch({"inputs": tok[:, :-1], "targets": tok[:, 1:]}, layout)
    opt = ft.optim.adamw(1e-3, weight_decay=0.1)
    out = {}
    for name in ("per_layer", "per_leaf"):
        step = parallel.make_train_step(ft.train.next_token_loss(model), opt, layout, buckets=name)
        box = {"state": ft.train.init_state(sharded, opt)}

        def run() -> None:
            box["state"], m = step(box["state"], batch)
            float(m["loss"])

        with parallel.collectives.count_calls() as calls:
            run()
        out[name] = _peer(_timed(run, warmup, rounds), collectives=dict(calls))
    return out


def _worker(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from ftitan import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg, warmup, rounds = spec["config"], spec["warmup"], spec["rounds"]
    parts = {"optimizer": lambda: _optimizer_part(cfg, warmup, rounds),
             "trainer_optimizer": lambda: _trainer_optimizer_part(cfg, warmup, rounds),
             "gather_bytes": lambda: _gather_part(cfg),
             "step": lambda: _step_part(cfg, warmup, rounds)}  # fmt: skip
    for name, part in parts.items():
        try:
            result = part()
        except Exception as e:  # one part failing must not hide the others
            result = {"error": f"{type(e).__name__}: {e}"}
        timing.report("PART", name, result)
    parallel.shutdown()


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    out = {}
    opt, gb, st = results.get("optimizer", {}), results.get("gather_bytes", {}), results.get("step", {})
    if "flexshard" in opt and "fsdp" in opt:
        out["optimizer flexshard/fsdp"] = opt["flexshard"]["median_s"] / opt["fsdp"]["median_s"]
    tr = results.get("trainer_optimizer", {})
    if "distributed" in tr and "gather" in tr:
        out["trainer_optimizer distributed/gather"] = tr["distributed"]["median_s"] / tr["gather"]["median_s"]
    for fmt in ("int8", "fp8"):
        if fmt in gb and "bf16" in gb:
            out[f"gather_bytes {fmt}/bf16"] = gb[fmt]["bytes_per_rank"] / gb["bf16"]["bytes_per_rank"]
    if "per_layer" in st and "per_leaf" in st:
        out["step per_layer/per_leaf"] = st["per_layer"]["median_s"] / st["per_leaf"]["median_s"]
    return out


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark; the JSON-ready result."""
    if opts.nproc < 2 or opts.rounds < 1 or opts.warmup < 0:
        raise ValueError("bench flexshard: --nproc must be >= 2, --rounds >= 1 and --warmup >= 0")
    cfg = _config(opts)
    warmup, rounds = (1, 1) if opts.quick else (opts.warmup, opts.rounds)
    spec = {"config": cfg, "warmup": warmup, "rounds": rounds}
    results = timing.launch_ranks("ftitan.bench.flexshard", opts.nproc, spec, "PART", prog="bench flexshard")
    ratios = _ratios(results)
    gb = results.get("gather_bytes", {})
    errors = {name: r["error"] for name, r in results.items() if "error" in r}
    one_per_bucket = not errors and all(v["all_gathers"] == v["buckets"] for v in gb.values())
    st = results.get("step", {})
    fewer = not errors and sum(st["per_layer"]["collectives"].values()) < sum(st["per_leaf"]["collectives"].values())
    return {
        "bench": "flexshard",
        "config": {**cfg, "nproc": opts.nproc, "quick": opts.quick},
        "machine": timing.machine_info(),
        "results": results,
        "ratios": ratios,
        "goals": GOALS,
        "goal_is": "max",
        "checks": {"one_all_gather_per_bucket": one_per_bucket, "per_layer_fewer_collectives": fewer},
        "errors": errors,
        "met": all(k in ratios and ratios[k] <= v for k, v in GOALS.items()) and one_per_bucket and fewer,
    }


def main(argv: list[str] | None = None) -> int:
    return timing.cli(Options, run, argv, prog="ftitan bench flexshard", doc=__doc__)


if __name__ == "__main__":
    if (rank_spec := timing.rank_spec()) is not None:
        from ftitan import parallel

        _worker(rank_spec)
        parallel.end_rank()  # no interpreter finalization for gloo's threads to abort in (docs/parallelism.md)
    else:
        sys.exit(main())
