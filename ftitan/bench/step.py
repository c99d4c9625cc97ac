"""``ftitan bench step`` / ``python -m ftitan.bench.step``: one training step, peers side by side.

Measures tokens/s of a full fwd + bwd + AdamW step of one Llama 3 config
(dim 512, 8 layers, 8 heads, 2 KV heads, seq 256, batch 4, vocab 8192, fp32)
for, in the same process, alternating after warm-up:

- ``ftitan-compiled``: ``torch.compile(make_train_step(..., donate=True), fullgraph=True)``
- ``ftitan-eager``: the same step, uncompiled
- ``hf-eager`` / ``hf-compiled``: ``transformers.LlamaForCausalLM`` +
  ``torch.optim.AdamW`` (the model under ``torch.compile`` for the latter)
- ``torchtitan-eager`` / ``torchtitan-compiled``: TorchTitan 0.3.0's own
  Llama 3 with SDPA attention (``pip install -e .[bench]``), compiled per
  block as TorchTitan does

Every peer uses the same architecture, batch and AdamW hyperparameters;
torch's AdamW runs its ``fused`` CPU kernel (TorchTitan's default and the
fastest torch offers). Achieved model FLOP/s are reported against a GEMM peak
measured in the same run. Prints one JSON object (see DESIGN.md,
"Benchmarks"); ``--out FILE`` also writes it.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from ftitan.bench import peers, timing

__all__ = ["Options", "ftitan_step", "main", "run"]

# the goals this benchmark judges (issue: functional core, item 8)
GOALS = {
    "ftitan-compiled/hf-eager": 1.2,
    "ftitan-compiled/best-compiled-peer": 1.0,
}


@attrs.frozen(kw_only=True)
class Options:
    """Options of ``ftitan bench step``."""

    peers: tuple[str, ...] = (
        "ftitan-compiled",
        "ftitan-eager",
        "hf-eager",
        "hf-compiled",
        "torchtitan-eager",
        "torchtitan-compiled",
    )
    """Which peers to run (torchtitan-* need the ``bench`` extra)."""
    warmup: int = 2
    """Untimed calls per peer before timing (the first compiles)."""
    rounds: int = 5
    """Timed round-robin rounds; medians are reported."""
    threads: int = 0
    """torch threads (0: keep torch's default)."""
    quick: bool = False
    """A tiny config (a smoke run, not a measurement)."""
    out: Path | None = None
    """Also write the JSON to this file."""


QUICK_CONFIG = dict(peers.CORE_CONFIG, vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=32)


def _llama_config(cfg: dict[str, Any]) -> Any:
    from ftitan.models import llama

    return llama.Config(
        vocab_size=cfg["vocab_size"],
        dim=cfg["dim"],
        n_layers=cfg["n_layers"],
        n_heads=cfg["n_heads"],
        n_kv_heads=cfg["n_kv_heads"],
        ffn_dim=cfg["ffn_dim"],
        norm_eps=peers.DEFAULT_NORM_EPS,
        rope_theta=cfg["rope_theta"],
        rope_scaling=None,
        max_seq_len=cfg["seq_len"],
        tie_embeddings=False,
        attn_impl="sdpa",
    )


def ftitan_step(cfg: dict[str, Any], *, compile: bool, seed: int = 0) -> Callable[[], float]:
    """The ftitan peer: the pure step, state carried between calls by the caller's loop."""
    import ftitan as ft
    from ftitan.models import llama

    model = llama.model(_llama_config(cfg))
    params = model.init(ft.random.key(seed))
    opt = ft.optim.adamw(
        peers.DEFAULT_LR, b1=peers.ADAMW_BETAS[0], b2=peers.ADAMW_BETAS[1], eps=peers.ADAMW_EPS,
        weight_decay=peers.ADAMW_WEIGHT_DECAY,
    )
    # donated, as the trainer runs it: params and moments updated in place, like the peers' torch.optim
    step = ft.train.make_train_step(ft.train.next_token_loss(model), opt, donate=True)
    if compile:
        step = torch.compile(step, fullgraph=True)
    tokens = peers.make_batch(cfg, seed=seed)
    batch = {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    state = ft.train.init_state(params, opt)

    def run_one() -> float:
        nonlocal state
        state, metrics = step(state, batch)
        return float(metrics["loss"])

    return run_one


def _build(name: str, cfg: dict[str, Any]) -> Callable[[], float]:
    family, _, mode = name.rpartition("-")
    compile = mode == "compiled"
    if mode not in ("eager", "compiled"):
        raise ValueError(f"unknown peer {name!r}; peers end in -eager or -compiled")
    if family == "ftitan":
        return ftitan_step(cfg, compile=compile)
    if family == "hf":
        return peers.hf_llama_step(cfg, compile=compile, adamw_impl="fused")
    if family == "torchtitan":
        return peers.torchtitan_llama_step(cfg, compile=compile, adamw_impl="fused")
    raise ValueError(f"unknown peer {name!r}; known families: ftitan, hf, torchtitan")


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    tps = {k: v["tokens_per_s"] for k, v in results.items()}
    out: dict[str, float] = {}
    if "ftitan-compiled" not in tps:
        return out
    ours = tps["ftitan-compiled"]
    for peer in sorted(tps):
        if peer != "ftitan-compiled":
            out[f"ftitan-compiled/{peer}"] = ours / tps[peer]
    compiled_peers = [tps[p] for p in ("hf-compiled", "torchtitan-compiled") if p in tps]
    if compiled_peers:
        out["ftitan-compiled/best-compiled-peer"] = ours / max(compiled_peers)
    return out


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    cfg = dict(QUICK_CONFIG if opts.quick else peers.CORE_CONFIG)
    skipped = {}
    names = list(opts.peers)
    if importlib.util.find_spec("torchtitan") is None:
        for n in [n for n in names if n.startswith("torchtitan")]:
            names.remove(n)
            skipped[n] = "torchtitan is not installed: pip install -e '.[bench]'"
    steps = {n: _build(n, cfg) for n in names}
    measured = timing.time_steps(
        steps, tokens_per_step=cfg["batch_size"] * cfg["seq_len"], warmup=opts.warmup, rounds=opts.rounds
    )
    peak = timing.gemm_peak_flops()
    flops_per_token = _llama_model_flops(cfg)
    results = measured["results"]
    for r in results.values():
        r["model_flops_per_s"] = r["tokens_per_s"] * flops_per_token
        r["mfu_vs_gemm_peak"] = r["model_flops_per_s"] / peak["flops_per_s"]
    ratios = _ratios(results)
    goals = {k: v for k, v in GOALS.items() if k in ratios}
    return {
        "bench": "step",
        "config": cfg | {"dtype": "float32", "optimizer": "adamw", "quick": opts.quick},
        "machine": timing.machine_info(),
        "gemm_peak": peak,
        "model_flops_per_token": flops_per_token,
        "results": results,
        "skipped": skipped,
        "ratios": ratios,
        "goals": goals,
        "met": bool(goals) and all(ratios[k] >= v for k, v in goals.items()),
    }


def _llama_model_flops(cfg: dict[str, Any]) -> float:
    from ftitan.models import llama

    return llama.model(_llama_config(cfg)).flops_per_token(cfg["seq_len"])


def main(argv: list[str] | None = None) -> int:
    return timing.cli(Options, run, argv, prog="ftitan bench step", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
