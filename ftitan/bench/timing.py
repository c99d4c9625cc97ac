"""Side-by-side step timing, GEMM peak and machine description for benchmarks.

Peers are timed in one process, interleaved: every peer is warmed up first,
then each round calls every peer once (the starting peer rotates from round
to round), so slow drift on a shared machine (other jobs, thermal, frequency)
hits all peers alike. Per-peer statistics are medians; the ratios between
peers are what benchmark goals should judge.

Pure stdlib + torch. Every result is a plain, JSON-serializable dict.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ftitan import _cache

__all__ = [
    "cli",
    "emit",
    "launch_ranks",
    "rank_spec",
    "report",
    "time_steps",
    "ratios",
    "gemm_peak_flops",
    "GemmProbe",
    "machine_info",
    "cpu_flags",
]


def _sync() -> None:
    # CPU kernels run synchronously; on an accelerator wait for queued work so
    # the wall clock measures the step, not the launch.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_steps(
    steps: Mapping[str, Callable[[], Any]],
    *,
    tokens_per_step: int | Mapping[str, int],
    warmup: int = 2,
    rounds: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Time several zero-argument step callables side by side.

    Each peer is called ``warmup`` times (untimed; covers compilation and
    allocator warm-up), then ``rounds`` rounds follow in which every peer is
    called once and timed. Round ``r`` starts with peer ``r % len(steps)`` so
    that no peer always runs right after the same neighbour.

    ``tokens_per_step`` is one int for all peers or a mapping name -> int.

    Returns ``{"warmup", "rounds", "order", "results": {name: {...}}}`` where
    each result holds ``median_s`` (seconds per step), ``min_s``, ``max_s``,
    ``times_s`` (every timed call, in call order), ``tokens_per_step`` and
    ``tokens_per_s = tokens_per_step / median_s``.
    """
    if not steps:
        raise ValueError("time_steps needs at least one step callable")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    names = list(steps)
    if isinstance(tokens_per_step, Mapping):
        missing = [n for n in names if n not in tokens_per_step]
        if missing:
            raise ValueError(f"tokens_per_step lacks peers {missing}")
        tps = {n: int(tokens_per_step[n]) for n in names}
    else:
        tps = {n: int(tokens_per_step) for n in names}

    for name in names:
        for _ in range(warmup):
            steps[name]()
        _sync()

    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            _sync()
            t0 = clock()
            steps[name]()
            _sync()
            times[name].append(clock() - t0)

    results: dict[str, dict[str, Any]] = {}
    for name in names:
        ts = times[name]
        med = statistics.median(ts)
        results[name] = {
            "median_s": med,
            "min_s": min(ts),
            "max_s": max(ts),
            "times_s": list(ts),
            "tokens_per_step": tps[name],
            "tokens_per_s": tps[name] / med if med > 0 else float("inf"),
        }
    return {"warmup": warmup, "rounds": rounds, "order": names, "results": results}


def ratios(
    results: Mapping[str, Mapping[str, Any]],
    pairs: list[tuple[str, str]],
    *,
    key: str = "tokens_per_s",
) -> dict[str, float]:
    """``{"a/b": results[a][key] / results[b][key]}`` for each ``(a, b)`` pair.

    ``results`` is the ``"results"`` dict of :func:`time_steps`.
    """
    return {f"{a}/{b}": float(results[a][key]) / float(results[b][key]) for a, b in pairs}


def gemm_peak_flops(
    n: int = 2048,
    dtype: torch.dtype = torch.float32,
    *,
    repeats: int = 10,
    warmup: int = 2,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Achieved FLOP/s of an ``n x n @ n x n`` matmul (``2 n^3`` FLOPs), measured once rather than beside
    steps: a :class:`GemmProbe` called ``warmup`` untimed and ``repeats`` timed times, with the current
    torch thread count, the faster library's figure (:meth:`GemmProbe.result`'s keys; ``flops_per_s`` is
    the figure to divide by). For an MFU denominator on a machine without a published peak."""
    if n < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"gemm_peak_flops: n={n} and repeats={repeats} must be >= 1, warmup={warmup} >= 0")
    probe = GemmProbe(n, dtype, device=device)
    for _ in range(warmup + repeats):
        probe()
    return probe.result(skip=warmup)


class GemmProbe:
    """The GEMM peak as one more peer of :func:`time_steps`: each call times ``repeats`` ``n x n @ n x n``
    matmuls and keeps the fastest, so the peak is sampled in every round, beside the steps it divides,
    instead of once after them (a shared machine's load drifts by tens of percent within a run).

    On the CPU each call times the GEMM libraries torch reaches (``ftitan.kernels.onednn``, whose picks a model
    with ``kernels`` other than "torch" runs its linear layers and CPU attention on): ``aten::mm`` (MKL's
    ``sgemm`` for float32), oneDNN's inner product ("onednn") and, for float32 where it computes float32,
    oneDNN's matmul ("onednn-matmul"); the peak is the fastest one's, so a step that uses any is divided by
    the best GEMM the machine gave in the same round.

    :meth:`result` (also :func:`gemm_peak_flops`'s): ``flops_per_s`` is ``2 n^3`` over the median of
    the per-call best times (``rounds``: how many calls were timed), of the faster library;
    ``by_library`` holds each library's.
    """

    def __init__(self, n: int, dtype: torch.dtype, *, device: str | torch.device = "cpu", repeats: int = 3):
        if n < 1 or repeats < 1:
            raise ValueError(f"GemmProbe: n={n} and repeats={repeats} must be >= 1")
        from ftitan.kernels import onednn

        g = torch.Generator(device="cpu").manual_seed(0)
        self.a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        self.b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        self.out = torch.empty(n, n, device=device, dtype=dtype)
        b_t = self.b.t()  # a @ b as oneDNN's x @ w.T: w = b.T, a view
        self.libraries: dict[str, Callable[[], Any]] = {"aten": lambda: torch.mm(self.a, self.b, out=self.out)}
        if self.a.device.type == "cpu" and onednn.available():
            self.libraries["onednn"] = lambda: onednn.gemm_in("onednn", "nt", self.a, b_t)  # oneDNN itself
            if dtype == torch.float32 and onednn.float32_exact("nt", self.a, b_t):  # its matmul, where float32
                self.libraries["onednn-matmul"] = lambda: onednn.gemm_in("onednn-matmul", "nt", self.a, b_t)
        self.n, self.repeats = n, repeats
        self.best_s: dict[str, list[float]] = {name: [] for name in self.libraries}  # one entry per call

    def __call__(self) -> None:
        for name, gemm in self.libraries.items():
            ts = []
            for _ in range(self.repeats):
                _sync()
                t0 = time.perf_counter()
                gemm()
                _sync()
                ts.append(time.perf_counter() - t0)
            self.best_s[name].append(min(ts))

    def result(self, skip: int = 0) -> dict[str, Any]:
        """The peak over the calls after the first ``skip`` (the untimed warm-up calls)."""
        medians = {name: statistics.median(ts[skip:]) for name, ts in self.best_s.items() if ts[skip:]}
        if not medians:
            raise ValueError("GemmProbe.result: no timed calls (call the probe, e.g. as a time_steps peer)")
        fastest = min(medians, key=medians.__getitem__)
        flops = 2.0 * self.n**3
        return {
            "n": self.n,
            "dtype": str(self.a.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "repeats": self.repeats,
            "rounds": len(self.best_s[fastest]) - skip,
            "interleaved": True,
            "library": fastest,
            "median_s": medians[fastest],
            "flops_per_s": flops / medians[fastest],
            "by_library": {name: flops / med for name, med in medians.items()},
        }


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (e.g. ``avx512_bf16``, ``amx_bf16``); empty elsewhere."""
    from ftitan.kernels import onednn

    return set(onednn.cpuinfo().get("flags", "").split())


def _cpu_model() -> str:
    from ftitan.kernels import onednn

    return onednn.cpuinfo().get("model name") or platform.processor() or platform.machine() or "unknown"


def machine_info() -> dict[str, Any]:
    """``{"cpu", "threads", "cores", "torch", "python", "platform", "gpu"}`` (``gpu``: CUDA device 0's name).

    ``threads`` is ``torch.get_num_threads()`` (what intra-op kernels use),
    ``cores`` is ``os.cpu_count()``.
    """
    return {
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def emit(result: Mapping[str, Any], out: Path | None) -> None:
    """Print a benchmark's JSON object; with ``out``, also write it there (atomically: tmp + rename)."""
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out)


def cli(options: type, run: Callable[[Any], Mapping[str, Any]], argv: list[str] | None, *, prog: str, doc: str) -> int:
    """A benchmark's command line: parse ``options`` (tyro; ``doc``'s first paragraph is the help),
    keep inductor's cache under ftitan's cache root unless set (``ftitan._cache``), ``run``, print (and
    ``--out``) the JSON."""
    import tyro

    opts = tyro.cli(options, args=argv, prog=prog, description=doc.split("\n\n")[0])
    _cache.set_defaults()
    emit(run(opts), opts.out)
    return 0


SPEC_ENV = "FTITAN_BENCH_SPEC"  # a multi-rank benchmark's spec, JSON, for its ranks


def launch_ranks(module: str, nproc: int, spec: Mapping[str, Any], tag: str, *, prog: str) -> dict[str, Any]:
    """``python -m module`` on ``nproc`` gloo ranks (one ``torchrun --standalone`` launch, one thread each),
    ``spec`` handed to them as JSON (:func:`rank_spec`); the results rank 0 printed with :func:`report`
    under ``tag``, by name. Raises naming ``prog`` with the launch's stderr, and the results that came before,
    if it failed or printed none."""
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT from C++) prints every thread's Python stack
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", SPEC_ENV: json.dumps(spec)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", module]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    results: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        if line.startswith(f"{tag} "):
            r = json.loads(line[len(tag) + 1 :])
            results[r.pop("name")] = r
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{prog}: torchrun failed (rc {proc.returncode}) after the results {sorted(results)}:"
                           f"\n{proc.stderr[-4000:]}")  # fmt: skip
    return results


def rank_spec() -> dict[str, Any] | None:
    """The spec :func:`launch_ranks` handed this process, when it is one of the launched ranks; else None."""
    text = os.environ.get(SPEC_ENV)
    return json.loads(text) if text is not None and "RANK" in os.environ else None


def report(tag: str, name: str, result: Mapping[str, Any]) -> None:
    """Rank 0 prints one result of a multi-rank benchmark for :func:`launch_ranks`."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"{tag} " + json.dumps({"name": name, **result}), flush=True)
