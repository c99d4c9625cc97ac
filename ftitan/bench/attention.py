"""``ftitan bench attention`` / ``python -m ftitan.bench.attention``: FlexAttention mask builds and forward,
and the CPU training backends.

For each sequence length ``T`` (B rows, H query heads over KV key/value
heads) it times, side by side and interleaved (``timing.time_steps``,
medians):

- block-mask builds (``create_block_mask`` of ``ftitan.nn.flex``'s mask
  functions): the static kinds (``causal``, ``window``), which
  ``nn.attention`` builds once per shape and then finds in its cache
  (``cached`` is that lookup), and the per-batch kinds (``document``: packed
  rows from segment ids, ``prefix_rows``: a prefix-LM with one length per
  row), which it builds on every call; ``dense_document`` is the (B, T, T)
  mask of the documents that SDPA takes where FlexAttention cannot run;
- the forward pass (``torch.no_grad``; FlexAttention has no CPU backward) of
  ``flex`` vs ``sdpa`` for a causal and a packed-document mask. ``flex`` is
  compiled (``torch.compile(fullgraph=True)``, inductor's FlexAttention
  kernel; the compile is warm-up, not timed) unless ``--no-compile``, when
  it is FlexAttention's eager form, which materializes the scores.
  ``sdpa`` with documents takes the (B, T, T) mask materialized from the
  same mask function, as ``nn.attention`` does.

- a training call (forward and backward, ``torch.autograd.grad`` of the
  output against a fixed cotangent) of ``gemm`` vs ``sdpa`` for the masks a
  CPU training run uses (``causal``, ``window``, ``document``), compiled like
  ``flex`` (``--no-compile``: eager); ``gemm_ran`` records per mask whether
  ``gemm`` ran its blocks at that length or SDPA (``nn.gemm_applies``: up to
  ``GEMM_MAX_SEQ`` keys, longer rows only with a window).

``ratios`` are ``flex/sdpa`` forward times and ``gemm/sdpa`` training
times (below 1: the first faster). There is no goal: on CPU this reports
the cost of the masks and of each backend; FlexAttention's speed is a GPU
matter. Prints one JSON object (see DESIGN.md,
"Benchmarks"); ``--out FILE`` also writes it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from ftitan import nn
from ftitan.bench import timing
from ftitan.nn import flex

__all__ = ["Options", "main", "run"]

QUICK = {"seq_lens": (128, 300), "batch": 2, "heads": 4, "kv_heads": 2, "head_dim": 16}


@attrs.frozen(kw_only=True)
class Options:
    """Options of ``ftitan bench attention``."""

    seq_lens: tuple[int, ...] = (256, 1024, 2048)
    """Sequence lengths T (queries = keys)."""
    batch: int = 2
    """Rows B."""
    heads: int = 8
    """Query heads H."""
    kv_heads: int = 2
    """Key/value heads KV (GQA: H / KV query heads read each)."""
    head_dim: int = 64
    """Head dimension."""
    window: int = 128
    """Sliding window of the ``window`` block mask."""
    docs: int = 4
    """Documents per packed row (``document`` masks; random lengths)."""
    compile: bool = True
    """Compile flex (inductor) for the forward timings; False: FlexAttention's eager form."""
    warmup: int = 2
    """Untimed calls per peer first (flex's compile happens here)."""
    rounds: int = 5
    """Timed rounds; medians are reported."""
    threads: int = 0
    """``torch.set_num_threads`` for the run (0: torch's default; 1 is steadier on a shared machine)."""
    quick: bool = False
    """A tiny run (T 128 and 300, B 2, 4/2 heads of 16) for tests."""
    out: Path | None = None
    """Also write the JSON here."""


def _segments(b: int, t: int, docs: int, g: torch.Generator) -> torch.Tensor:  # (B, T) int document ids
    """Rows of ``docs`` documents of random lengths (cut points drawn without replacement)."""
    rows = []
    for _ in range(b):
        cuts = torch.randperm(t - 1, generator=g)[: docs - 1] + 1 if docs > 1 else torch.zeros(0, dtype=torch.long)
        rows.append(torch.bucketize(torch.arange(t), cuts.sort().values, right=True))
    return torch.stack(rows)


def _ms(result: dict[str, Any]) -> dict[str, float]:
    return {name: r["median_s"] * 1e3 for name, r in result["results"].items()}


def _builds(b: int, t: int, opts: Options, seg: torch.Tensor, prefix: torch.Tensor) -> dict[str, Any]:
    """Median ms of each kind's ``create_block_mask``, of the static cache's lookup and of a dense mask."""
    masks = {
        "causal": flex.mask_of(b, t, t, causal=True),
        "window": flex.mask_of(b, t, t, causal=True, window=opts.window),
        "document": flex.mask_of(b, t, t, causal=True, segments=seg),
        "prefix_rows": flex.mask_of(b, t, t, causal=True, prefix=prefix),
    }
    steps: dict[str, Callable[[], Any]] = {
        name: (lambda m=m: flex.create_block_mask(m.mod, m.batch, None, t, t, device="cpu"))
        for name, m in masks.items()
    }
    steps["cached"] = lambda: flex.block_mask(masks["causal"], device=torch.device("cpu"))
    steps["dense_document"] = lambda: flex.dense(masks["document"])  # the (B, T, T) mask SDPA falls back to
    got = timing.time_steps(steps, tokens_per_step=b * t, warmup=opts.warmup, rounds=opts.rounds)
    return {"ms": _ms(got), "per_batch": ["document", "prefix_rows"], "static": ["causal", "window"]}


def _forward(b: int, t: int, opts: Options, seg: torch.Tensor, g: torch.Generator) -> dict[str, float]:
    """Median ms of flex and sdpa forward, causal and with packed documents."""
    q = torch.randn(b, t, opts.heads, opts.head_dim, generator=g)
    k, v = (torch.randn(b, t, opts.kv_heads, opts.head_dim, generator=g) for _ in range(2))

    def step(impl: str, docs: bool) -> Callable[[], Any]:
        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
            return nn.attention(q, k, v, impl=impl, segments=seg if docs else None)

        if impl == "flex" and opts.compile:
            fn = torch.compile(fn, fullgraph=True, dynamic=False)
        return lambda: fn(q, k, v, seg)

    steps = {f"{impl}-{kind}": step(impl, kind == "document") for kind in ("causal", "document")
             for impl in ("flex", "sdpa")}  # fmt: skip
    with torch.no_grad():
        return _ms(timing.time_steps(steps, tokens_per_step=b * t, warmup=opts.warmup, rounds=opts.rounds))


TRAIN_KINDS = ("causal", "window", "document")


def _train(
    b: int, t: int, opts: Options, seg: torch.Tensor, g: torch.Generator
) -> tuple[dict[str, float], dict[str, bool]]:
    """Median ms of a forward and backward of gemm and sdpa, for each of :data:`TRAIN_KINDS`, and for each
    whether ``gemm`` ran its blocks (``nn.gemm_applies``) or SDPA."""
    q = torch.randn(b, t, opts.heads, opts.head_dim, generator=g, requires_grad=True)
    k, v = (torch.randn(b, t, opts.kv_heads, opts.head_dim, generator=g, requires_grad=True) for _ in range(2))
    cotangent = torch.randn(q.shape, generator=g)
    masks = {"causal": {}, "window": {"window": opts.window}, "document": {"segments": seg}}

    def step(impl: str, kind: str) -> Callable[[], Any]:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return nn.attention(q, k, v, impl=impl, **masks[kind])

        if opts.compile:  # the forward compiled, its backward with it; the grad call stays outside the graph
            attend = torch.compile(attend, fullgraph=True, dynamic=False)
        return lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), cotangent)

    if opts.compile:  # six graphs of one code object a length: the lengths before are timed, drop theirs
        torch._dynamo.reset()
    steps = {f"{impl}-{kind}": step(impl, kind) for kind in TRAIN_KINDS for impl in ("gemm", "sdpa")}
    ran = {kind: nn.gemm_applies(q, k, window=masks[kind].get("window")) for kind in TRAIN_KINDS}
    return _ms(timing.time_steps(steps, tokens_per_step=b * t, warmup=opts.warmup, rounds=opts.rounds)), ran


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result."""
    size = QUICK if opts.quick else {k: getattr(opts, k) for k in QUICK}
    if min(size["seq_lens"]) < 2 or opts.rounds < 1 or opts.warmup < 0 or opts.docs < 1:
        raise ValueError("--seq-lens must be >= 2, --rounds and --docs >= 1, --warmup >= 0")
    if size["heads"] % size["kv_heads"]:
        raise ValueError(f"--heads {size['heads']} must be a multiple of --kv-heads {size['kv_heads']}")
    if opts.threads < 0:
        raise ValueError(f"--threads {opts.threads} must be >= 0 (0: torch's default)")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    shape = attrs.evolve(opts, **{k: v for k, v in size.items() if k != "seq_lens"})
    g = torch.Generator().manual_seed(0)
    b = shape.batch
    results, ratios = {}, {}
    for t in size["seq_lens"]:
        seg = _segments(b, t, min(opts.docs, t), g)
        prefix = torch.randint(0, t, (b,), generator=g)
        fwd = _forward(b, t, shape, seg, g)
        train, ran = _train(b, t, shape, seg, g)
        results[f"T={t}"] = {"block_mask": _builds(b, t, shape, seg, prefix), "forward_ms": fwd, "train_ms": train,
                             "gemm_ran": ran}  # fmt: skip
        for kind in ("causal", "document"):
            ratios[f"flex/sdpa {kind} T={t}"] = fwd[f"flex-{kind}"] / fwd[f"sdpa-{kind}"]
        for kind in TRAIN_KINDS:
            ratios[f"gemm/sdpa train {kind} T={t}"] = train[f"gemm-{kind}"] / train[f"sdpa-{kind}"]
    return {
        "bench": "attention",
        "config": {**size, "window": opts.window, "docs": opts.docs, "compile": opts.compile, "dtype": "float32",
                   "threads": torch.get_num_threads(),
                   "warmup": opts.warmup, "rounds": opts.rounds, "quick": opts.quick},  # fmt: skip
        "machine": timing.machine_info(),
        "results": results,
        "ratios": ratios,
        "goals": {},
        "met": None,  # no goal: this reports costs
    }


def main(argv: list[str] | None = None) -> int:
    return timing.cli(Options, run, argv, prog="ftitan bench attention", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
