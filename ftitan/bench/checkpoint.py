"""``ftitan bench checkpoint`` / ``python -m ftitan.bench.checkpoint``: how long a save blocks training.

Saves a ~1 GiB train state (fp32 params of a ~90M-parameter Llama-shaped
model plus its two Adam moments, random values) with each writer of
:class:`ftitan.checkpoint.Checkpointer`, side by side in one process:

- ``torch-checkpointing``: staged into shared memory, written by a subprocess;
- ``dcp``: staged by ``torch.distributed.checkpoint``, written from a thread;
- ``sync``: written, fsynced and hashed before ``save`` returns (the reference).

Each round saves once with every writer (the starting writer rotates), after
``warmup`` untimed saves each (the first spawns the writer subprocess and
allocates its staging memory). Per save, ``blocked_s`` is how long
``save()`` held the caller, i.e. the training loop (the previous save is
waited for first, outside the clock, as a loop that saves less often than a
save takes to write would), and ``commit_s`` the time until that checkpoint
was committed. Medians are reported; the goal judges
``blocked_s(async) / blocked_s(sync)``: at most 0.10 (``goal_is: "max"``).
Prints one JSON object (see DESIGN.md, "Benchmarks"); ``--out FILE`` also
writes it.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from ftitan import tree
from ftitan.bench import timing

__all__ = ["Options", "main", "run", "synthetic_state"]

PEERS = ("torch-checkpointing", "dcp", "sync")
GOALS = {"torch-checkpointing/sync": 0.10, "dcp/sync": 0.10}  # upper bounds: blocked async / blocked sync
DIM, FFN = 768, 2048  # the Llama-shaped model's width
QUICK = {"state_mib": 8, "dim": 64, "ffn": 128}


@attrs.frozen(kw_only=True)
class Options:
    """Options of ``ftitan bench checkpoint``."""

    peers: tuple[str, ...] = PEERS
    """Which writers to time (``sync`` is the reference the ratios divide by)."""
    state_mib: int = 1024
    """Size of the saved state (params + 2 Adam moments, fp32), MiB."""
    warmup: int = 2
    """Untimed saves per writer first (the first spawns a writer and allocates its staging memory)."""
    rounds: int = 5
    """Timed rounds (one save per writer each); medians are reported."""
    dir: str = ""
    """Where the checkpoints go (a temp dir under it, removed after; "": the system's temp dir)."""
    quick: bool = False
    """A tiny state (a smoke run, not a measurement)."""
    out: Path | None = None
    """Also write the JSON to this file."""


def synthetic_state(state_mib: int, *, dim: int = DIM, ffn: int = FFN, seed: int = 0) -> dict[str, Any]:
    """A train state of about ``state_mib`` MiB: ``step``, fp32 ``params`` of Llama-shaped layers (attention
    ``dim x dim`` x4, MLP ``ffn x dim`` x3, a norm) and the Adam moments ``mu`` / ``nu`` of each, random."""
    layer = {"wq": (dim, dim), "wk": (dim, dim), "wv": (dim, dim), "wo": (dim, dim), "w1": (ffn, dim),
             "w3": (ffn, dim), "w2": (dim, ffn), "norm": (dim,)}  # fmt: skip
    per_layer = sum(torch.Size(s).numel() for s in layer.values()) * 3 * 4  # params + mu + nu, fp32
    n_layers = max(1, round(state_mib * 2**20 / per_layer))
    g = torch.Generator().manual_seed(seed)

    def draw() -> dict[str, Any]:
        return {str(i): {k: torch.randn(s, generator=g) for k, s in layer.items()} for i in range(n_layers)}

    return {"step": torch.tensor(0), "params": draw(), "opt_state": {"mu": draw(), "nu": draw()}}


def _nbytes(state: Any) -> int:
    return sum(x.numel() * x.element_size() for x in tree.leaves(state))


def _time(peers: list[str], state: Any, root: Path, *, warmup: int, rounds: int) -> dict[str, dict[str, Any]]:
    from ftitan.checkpoint import Checkpointer

    savers = {p: Checkpointer(root / p, backend=p, keep=1, subprocess_min_bytes=0) for p in peers}
    blocked: dict[str, list[float]] = {p: [] for p in peers}
    commit: dict[str, list[float]] = {p: [] for p in peers}
    step = 0
    try:
        for p in peers:
            for _ in range(warmup):
                step += 1
                savers[p].save(step, state)
                savers[p].wait()
        for r in range(rounds):
            k = r % len(peers)
            for p in peers[k:] + peers[:k]:
                step += 1
                savers[p].wait()  # the previous save: off the clock
                t0 = time.perf_counter()
                savers[p].save(step, state)
                t1 = time.perf_counter()
                savers[p].wait()
                t2 = time.perf_counter()
                blocked[p].append(t1 - t0)
                commit[p].append(t2 - t0)
                state["step"].add_(1)  # the next save holds other values, as in training
    finally:
        for s in savers.values():
            s.close()
    return {p: {"blocked_s": statistics.median(blocked[p]), "commit_s": statistics.median(commit[p]),
                "blocked_times_s": blocked[p], "commit_times_s": commit[p]} for p in peers}  # fmt: skip


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result."""
    from ftitan.checkpoint import BACKENDS

    bad = [p for p in opts.peers if p not in BACKENDS]
    if bad or "sync" not in opts.peers:
        raise ValueError(f"--peers={opts.peers!r}: expected writers from {BACKENDS}, sync among them (the reference)")
    if opts.state_mib < 1 or opts.rounds < 1 or opts.warmup < 0:
        raise ValueError("--state-mib and --rounds must be >= 1, --warmup >= 0")
    size = QUICK if opts.quick else {"state_mib": opts.state_mib, "dim": DIM, "ffn": FFN}
    state = synthetic_state(size["state_mib"], dim=size["dim"], ffn=size["ffn"])
    root = Path(tempfile.mkdtemp(prefix="ftitan-bench-checkpoint-", dir=opts.dir or None))
    try:
        results = _time(list(opts.peers), state, root, warmup=opts.warmup, rounds=opts.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = _nbytes(state)
    for r in results.values():
        r["staged_gb_per_s"] = nbytes / r["blocked_s"] / 1e9
    ratios = {f"{p}/sync": results[p]["blocked_s"] / results["sync"]["blocked_s"] for p in opts.peers if p != "sync"}
    goals = {k: v for k, v in GOALS.items() if k in ratios}
    return {
        "bench": "checkpoint",
        "config": {**size, "state_bytes": nbytes, "leaves": len(tree.leaves(state)), "warmup": opts.warmup,
                   "rounds": opts.rounds, "quick": opts.quick, "dir": opts.dir or tempfile.gettempdir()},  # fmt: skip
        "machine": timing.machine_info(),
        "results": results,
        "ratios": ratios,
        "goals": goals,
        "goal_is": "max",  # a ratio meets its goal when it is at most the goal
        "met": bool(goals) and all(ratios[k] <= v for k, v in goals.items()),
    }


def main(argv: list[str] | None = None) -> int:
    return timing.cli(Options, run, argv, prog="ftitan bench checkpoint", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
