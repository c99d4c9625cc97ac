"""``ftitan bench parallel``: step time and bytes sent per step of each parallel layout, on N ranks.

The parent process measures the single-process step (the baseline peer),
then launches ``torchrun --nproc-per-node N`` once; the ranks run every
layout in turn (same model, same global batch, AdamW), timing steps after
warm-up with a barrier around each, and counting the bytes each rank sends
in one more (eager) step through ``ftitan.parallel.collectives`` (the
step's gathers, reductions, all-to-alls and sends; the optimizer's DTensor
norm reductions, a few scalars, are not counted). Layouts with ``ep`` use a
Qwen3-MoE model of the same size, compared with its own single-process run;
layouts with ``pp`` run 1F1B over 4 micro-batches.

Layouts with ``ep`` run once per expert-parallel token exchange in
``ep_exchanges`` (``ftitan.parallel.expert.exchange``), alternating step by
step in the same ranks: ``"padded"`` (the default: fixed-size, no host
sync, compiles) under the layout's name, ``"sync"`` (the previous exchange,
a count all-to-all and a host sync per MoE layer) as ``"<layout> [sync]"``,
with the ratio ``"<layout>/<layout> [sync]"`` (the GPU goal for
``ep=2,dp_shard=2`` is >= 1.2; on 2 shared cores the figure is noise-bound).

Prints one JSON object (DESIGN.md, "Benchmarks"): per layout the median
step time, tokens/s, bytes sent per rank per step (by collective), and the
ratio of its tokens/s to the single process. There is no speed goal: on a
2-core CPU, N ranks share the cores, so the figures show communication
volume and overhead, not scaling.
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
import tyro

from ftitan.bench import timing

__all__ = ["Options", "main", "parse_layout", "run"]

DEFAULT_LAYOUTS = (
    "dp_replicate=4",
    "dp_shard=4",
    "dp_shard=2,tp=2",
    "tp=4",
    "tp=2,cp=2",
    "ep=2,dp_shard=2",
    "pp=2,dp_shard=2",
)


@attrs.frozen(kw_only=True)
class Options:
    """Options of ``ftitan bench parallel``."""

    nproc: int = 4
    """Ranks (processes) to launch."""
    layouts: tuple[str, ...] = DEFAULT_LAYOUTS
    """Layouts as ``axis=degree`` lists whose product is ``nproc`` (axes: dp_replicate, dp_shard, ep, cp, tp, pp)."""
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 2048
    seq_len: int = 128
    batch_size: int = 8
    warmup: int = 1
    rounds: int = 3
    ep_exchanges: tuple[str, ...] = ("padded", "sync")
    """Expert-parallel token exchanges to measure on layouts with ep (ftitan.parallel.expert.EXCHANGES)."""
    quick: bool = False
    """A tiny model and one timed round: checks the benchmark runs, measures nothing."""
    out: Path | None = None
    """Also write the JSON here."""


def parse_layout(text: str) -> dict[str, int]:
    """``"dp_shard=2,tp=2"`` -> ``{"dp_shard": 2, "tp": 2}``."""
    from ftitan.parallel import AXES

    out = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        axis, _, degree = part.partition("=")
        if axis not in AXES or not degree.isdigit():
            raise ValueError(f"bench parallel: layout {text!r}: {part!r} is not axis=degree with axis in {AXES}")
        out[axis] = int(degree)
    return out


def _config(opts: Options) -> dict[str, Any]:
    if opts.quick:
        return {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "vocab_size": 256, "seq_len": 16,
                "batch_size": 8}  # fmt: skip
    return {k: getattr(opts, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len",
                                          "batch_size")}  # fmt: skip


def _model(cfg: dict[str, Any], *, moe: bool) -> Any:
    from ftitan.models import llama, qwen3_moe

    common = dict(vocab_size=cfg["vocab_size"], dim=cfg["dim"], n_layers=cfg["n_layers"], n_heads=cfg["n_heads"],
                  n_kv_heads=cfg["n_kv_heads"], max_seq_len=max(cfg["seq_len"], 64))  # fmt: skip
    if moe:
        return qwen3_moe.model(qwen3_moe.Config(**common, head_dim=cfg["dim"] // cfg["n_heads"], ffn_dim=2 * cfg["dim"],
                                                n_experts=8, top_k=2, expert_dim=cfg["dim"]))  # fmt: skip
    return llama.model(llama.Config(**common, ffn_dim=3 * cfg["dim"]))


def _batch(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg["vocab_size"], (cfg["batch_size"], cfg["seq_len"] + 1), generator=g)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def _optimizer() -> Any:
    import ftitan as ft

    return ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(lr=1e-3, weight_decay=0.1))


def _single(cfg: dict[str, Any], *, moe: bool, warmup: int, rounds: int) -> dict[str, Any]:
    import ftitan as ft

    model, opt, batch = _model(cfg, moe=moe), _optimizer(), _batch(cfg)
    step = ft.train.make_train_step(ft.train.next_token_loss(model), opt, update_buffers=model.update_buffers)
    state = ft.train.init_state(model.init(ft.random.key(0)), opt)
    times = []
    for i in range(warmup + rounds):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        float(m["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return _result(cfg, times, {})


def _result(cfg: dict[str, Any], times: list[float], sent: dict[str, int]) -> dict[str, Any]:
    median = statistics.median(times)
    return {"median_s": median, "times_s": times, "tokens_per_s": cfg["batch_size"] * cfg["seq_len"] / median,
            "bytes_sent_per_rank": sum(sent.values()), "bytes_by_collective": dict(sent)}  # fmt: skip


def _exchange_name(text: str, exchange: str) -> str:
    return text if exchange == "padded" else f"{text} [{exchange}]"


def _worker_layout(
    cfg: dict[str, Any], degrees: dict[str, int], warmup: int, rounds: int, exchanges: tuple[str, ...] = ("padded",)
) -> dict[str, dict[str, Any]]:
    """``{exchange: result}``: the layout's step timed once per ep exchange (one, without ep), alternating."""
    import torch.distributed as dist

    import ftitan as ft
    from ftitan import parallel
    from ftitan.parallel import expert

    from ftitan.config.schema import ParallelConfig
    from ftitan.train.runtime import Runtime

    model, opt, batch = _model(cfg, moe=degrees.get("ep", 1) > 1), _optimizer(), _batch(cfg)
    # the trainer's runtime: pipeline stages (4 micro-batches) when pp > 1
    rt = Runtime(parallel.Layout(parallel.mesh(**degrees)), ParallelConfig(**degrees, pp_microbatches=4))
    layout = rt.layout
    params = rt.init_params(model, ft.random.key(0))
    step = rt.make_step(model, ft.train.next_token_loss(model), opt, accum_steps=1, compile=False,
                        update_buffers=model.update_buffers)  # fmt: skip
    if degrees.get("ep", 1) == 1:
        exchanges = ("padded",)  # no MoE exchange: one row
    local = parallel.shard_batch(batch, layout)
    states = {ex: ft.train.init_state(params, opt) for ex in exchanges}
    times: dict[str, list[float]] = {ex: [] for ex in exchanges}
    for i in range(warmup + rounds):
        for ex in exchanges:  # alternating: drift on a shared machine hits every exchange alike
            dist.barrier()
            t0 = time.perf_counter()
            with expert.exchange(ex):
                states[ex], m = step(states[ex], local)
                float(m["loss"])
            dist.barrier()
            if i >= warmup:
                times[ex].append(time.perf_counter() - t0)
    out = {}
    for ex in exchanges:
        with parallel.collectives.count_bytes() as sent, expert.exchange(ex):
            states[ex], _ = step(states[ex], local)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, dict(sent))
        out[ex] = _result(cfg, times[ex], dict(sent))
        out[ex]["bytes_sent_max_rank"] = max(sum(s.values()) for s in everyone)
    return out


def _worker(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from ftitan import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    exchanges = tuple(spec.get("ep_exchanges", ("padded",)))
    for text in spec["layouts"]:
        try:
            results = _worker_layout(spec["config"], parse_layout(text), spec["warmup"], spec["rounds"], exchanges)
        except Exception as e:  # one layout failing must not hide the others
            results = {"padded": {"error": f"{type(e).__name__}: {e}"}}
        for ex, result in results.items():
            timing.report("LAYOUT", _exchange_name(text, ex), result)
    parallel.shutdown()


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark; the JSON-ready result."""
    cfg = _config(opts)
    warmup, rounds = (1, 1) if opts.quick else (opts.warmup, opts.rounds)
    for text in opts.layouts:
        n = 1
        for d in parse_layout(text).values():
            n *= d
        if n != opts.nproc:
            raise ValueError(f"bench parallel: layout {text!r} has {n} ranks, not --nproc {opts.nproc}")
    torch.set_num_threads(min(opts.nproc, os.cpu_count() or 1))
    results: dict[str, Any] = {"single": _single(cfg, moe=False, warmup=warmup, rounds=rounds)}
    if any(parse_layout(t).get("ep", 1) > 1 for t in opts.layouts):
        results["single-moe"] = _single(cfg, moe=True, warmup=warmup, rounds=rounds)
    from ftitan.parallel.expert import EXCHANGES

    bad = [e for e in opts.ep_exchanges if e not in EXCHANGES]
    if bad or not opts.ep_exchanges:
        raise ValueError(f"bench parallel: --ep-exchanges {opts.ep_exchanges}: expected some of {EXCHANGES}")
    spec = {"layouts": list(opts.layouts), "config": cfg, "warmup": warmup, "rounds": rounds,
            "ep_exchanges": list(opts.ep_exchanges)}  # fmt: skip
    results.update(timing.launch_ranks("ftitan.bench.parallel", opts.nproc, spec, "LAYOUT", prog="bench parallel"))
    ratios = {}
    for text in opts.layouts:
        base = "single-moe" if parse_layout(text).get("ep", 1) > 1 else "single"
        if "tokens_per_s" in results.get(text, {}):
            ratios[f"{text}/{base}"] = results[text]["tokens_per_s"] / results[base]["tokens_per_s"]
        sync = _exchange_name(text, "sync")
        if base == "single-moe" and "tokens_per_s" in results.get(text, {}) and "tokens_per_s" in results.get(sync, {}):
            ratios[f"{text}/{sync}"] = results[text]["tokens_per_s"] / results[sync]["tokens_per_s"]
    return {"bench": "parallel", "config": {**cfg, "nproc": opts.nproc, "quick": opts.quick, "optimizer": "adamw"},
            "machine": timing.machine_info(), "results": results, "ratios": ratios, "goals": {},
            "met": all("error" not in results.get(t, {"error": "missing"}) for t in opts.layouts)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    opts = tyro.cli(Options, args=argv, prog="ftitan bench parallel", description=__doc__.split("\n\n")[0])
    result = run(opts)
    timing.emit(result, opts.out)
    return 0 if result["met"] else 1


if __name__ == "__main__":
    if (rank_spec := timing.rank_spec()) is not None:
        from ftitan import parallel

        _worker(rank_spec)
        parallel.end_rank()  # no interpreter finalization for gloo's threads to abort in (docs/parallelism.md)
    else:
        sys.exit(main())
