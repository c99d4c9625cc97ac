"""``ftitan bench step`` / ``python -m ftitan.bench.step``: one training step, peers side by side.

Measures tokens/s of a full fwd + bwd + AdamW step of one Llama 3 config
(dim 512, 8 layers, 8 heads, 2 KV heads, seq 256, batch 4, vocab 8192, fp32)
for, in the same process, alternating after warm-up:

- ``ftitan-compiled``: ``torch.compile(make_train_step(..., donate=True), fullgraph=True)``, the
  model config's choices by ``--kernels``, ``--attn-impl`` and ``--fuse-projections`` (q/k/v and
  gate/up stacked in the params, one GEMM each; default on)
- ``ftitan-compiled-streaming``: the compiled step fed by the streaming loader
  (sharded JSONL, tokenized ahead by its background thread) instead of one
  pre-tokenized batch; the output's ``loader`` is that loader's own tokens/s
- ``ftitan-eager``: the same step, uncompiled
- ``hf-eager`` / ``hf-compiled``: ``transformers.LlamaForCausalLM`` +
  ``torch.optim.AdamW`` (the model under ``torch.compile`` for the latter)
- ``torchtitan-eager`` / ``torchtitan-compiled``: TorchTitan 0.3.0's own
  Llama 3 with SDPA attention (``pip install -e .[bench]``), compiled per
  block as TorchTitan does

Every peer uses the same architecture, batch and AdamW hyperparameters;
torch's AdamW runs its ``fused`` kernel (TorchTitan's default and the
fastest torch offers). On the CPU the process keeps the host memory a step
frees for the next one (``ft.train.retain_freed_memory``, as ``ftitan train``
does; ``--no-malloc-retain``: glibc's defaults), every peer alike.
Achieved model FLOP/s are reported against a GEMM peak sampled in every
round beside the steps (in the compute dtype; the median of each round's
best of 3) and, on a GPU whose dense bf16 peak is published (H100/H200:
989 TFLOP/s), against that peak: MFU.

``ftitan-compiled-bf16`` / ``hf-compiled-bf16``: a bf16 row beside the fp32
one (bf16 forward and backward, fp32 masters and AdamW state), judged against
a bf16 GEMM peak of its own; on a CPU only where it has AVX512-BF16.
Prints one JSON object (see DESIGN.md, "Benchmarks"); ``--out FILE`` also
writes it.

``--device cuda --mixed-precision bf16 --model llama3-8b-2layers`` is the GPU
measurement (fp32 master weights and AdamW state, bf16 forward and backward:
``ftitan.train.MixedPrecision`` for ftitan, ``torch.autocast`` for HF). On the
CPU the 1B / 8B shapes do not fit with fp32 optimizer state; ``--quick``
shrinks any shape to a smoke-test size.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from ftitan.bench import peers, timing

__all__ = ["Options", "ftitan_step", "main", "run"]

# the goals this benchmark judges (issue: functional core, item 8; kernels and compile, item 5)
GOALS = {
    "ftitan-compiled/hf-eager": 1.2,
    "ftitan-compiled/best-compiled-peer": 1.05,
    "ftitan-compiled/gemm-peak": 0.85,  # model FLOP/s over the same run's interleaved GEMM peak
    "ftitan-compiled-streaming/ftitan-compiled": 0.95,  # the streaming loader costs the step <= 5% (real runs, 4)
}
BF16 = "-bf16"  # peer suffix: the same peer with bf16 compute (fp32 masters), a row beside the fp32 goal
MFU_GOAL_8B = 0.45  # of the device's dense bf16 peak, on the 8B shape (issue: real runs, item 5)


@attrs.frozen(kw_only=True)
class Options:
    """Options of ``ftitan bench step``."""

    peers: tuple[str, ...] = (
        "ftitan-compiled",
        "ftitan-compiled-streaming",
        "ftitan-eager",
        "hf-eager",
        "hf-compiled",
        "torchtitan-eager",
        "torchtitan-compiled",
        "ftitan-compiled-bf16",
        "hf-compiled-bf16",
    )
    """Which peers to run (torchtitan-* need the ``bench`` extra). A ``-bf16`` peer is its fp32 peer with
    bf16 compute (ftitan's MixedPrecision, HF's autocast), judged against a bf16 GEMM peak; on a CPU it
    runs where the CPU has AVX512-BF16 (elsewhere bf16 GEMMs are emulated and it is skipped)."""
    warmup: int = 2
    """Untimed calls per peer before timing (the first compiles)."""
    rounds: int = 8
    """Timed round-robin rounds (the GEMM peak is sampled in each, beside the steps); medians are reported."""
    threads: int = 0
    """torch threads (0: keep torch's default)."""
    quick: bool = False
    """A tiny config (a smoke run, not a measurement)."""
    model: str = "core"
    """The shape: "core" (dim 512, 8 layers, CPU-sized), "llama3-1b" or "llama3-8b-2layers" (Llama 3 8B's
    layer and vocabulary, 2 layers: what fits one GPU beside its fp32 AdamW state)."""
    device: str = "auto"
    """"auto" (CUDA when available), "cpu" or "cuda"."""
    mixed_precision: str = "fp32"
    """Compute dtype of the forward and backward: "fp32" or "bf16" (master weights stay fp32)."""
    kernels: str = "triton"
    """The ftitan peers' model kernels (``--model.kernels``, as ``ftitan train --kernels``): "triton"
    (``ftitan.kernels``: Triton on CUDA; on the CPU the linear layers' GEMMs in oneDNN and the other
    kernels' references) or "torch" (plain ops); not "torch": gradients by the step's autograd path."""
    attn_impl: str = "gemm"
    """The ftitan peers' attention (``--model.attn-impl``, ``ftitan.nn.attention``): "gemm" (causal query
    blocks as GEMMs on the CPU, faster there than SDPA's flash kernel up to 1024 tokens a row; "sdpa"
    elsewhere), "sdpa", "math", "flex" or "auto". The HF and TorchTitan peers run SDPA."""
    float8: str = ""
    """FP8 training of the ftitan peers' block projections: "tensorwise" or "rowwise" (torchao's recipes,
    ``ftitan train --float8``; float8 GEMMs on CUDA 8.9+, emulated elsewhere), "" none. Model FLOP/s are
    still judged against the compute dtype's GEMM peak."""
    fuse_projections: bool = True
    """The ftitan peers' params hold q/k/v and gate/up stacked (``--model.fuse-projections``,
    ``ftitan.models.fused``): one wider GEMM each, forward and backward. The HF and TorchTitan peers keep
    their separate projections."""
    gemm_library: str = "auto"
    """On the CPU with ``--kernels triton``: the ftitan peers' linear and attention GEMMs in the fastest library
    per shape ("auto", as ``ftitan train --gemm-library``), or all in "aten", "onednn" or "onednn-matmul" (to compare
    them; ``ftitan.kernels.onednn.LIBRARIES``)."""
    malloc_retain: bool = True
    """On the CPU: glibc keeps the memory a step frees for the next one (``ft.train.retain_freed_memory``, as
    ``ftitan train`` does), for every peer alike (one process); False: glibc's defaults."""
    seq_len: int = 0
    """Override the shape's sequence length (0: the shape's own)."""
    batch_size: int = 0
    """Override the shape's rows per step (0: the shape's own)."""
    out: Path | None = None
    """Also write the JSON to this file."""


QUICK_PROBE = 256  # the GEMM probe's size under --quick
QUICK_CONFIG = dict(peers.CORE_CONFIG, vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=32)
# Llama 3.2 1B and Llama 3 8B (2 of its 32 layers) as published; batch x seq: 16k tokens a step
SHAPES: dict[str, dict[str, Any]] = {
    "core": peers.CORE_CONFIG,
    "llama3-1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      seq_len=2048, batch_size=8, rope_theta=500000.0),
    "llama3-8b-2layers": dict(vocab_size=128256, dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                              seq_len=4096, batch_size=4, rope_theta=500000.0),
}  # fmt: skip
# published dense bf16 peaks (no sparsity), by a substring of torch.cuda.get_device_name()
DEVICE_BF16_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def ftitan_step(
    cfg: dict[str, Any],
    *,
    compile: bool,
    seed: int = 0,
    device: str | torch.device = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    batches: Iterator[dict[str, torch.Tensor]] | None = None,
    kernels: str = "torch",
    float8: str = "",
    attn_impl: str = "sdpa",
    fuse_projections: bool = False,
) -> Callable[[], float]:
    """The ftitan peer: the pure step, state carried between calls by the caller's loop.

    ``batches``: draw each step's batch from this loader (e.g. the streaming one) instead of reusing
    one pre-tokenized batch: the step time then includes whatever the loader makes the step wait.
    ``kernels``: the model config's; other than "torch", gradients by the autograd path, as
    ``ftitan train`` takes them (``ftitan.kernels`` step aside for their references under ``torch.func``).
    ``float8``: the model config's recipe (``ftitan.nn.float8``), likewise on the autograd path.
    ``attn_impl``: the model config's (``ftitan.nn.attention``).
    ``fuse_projections``: the model config's (``ftitan.models.fused``: q/k/v and gate/up stacked, one GEMM each).
    """
    import ftitan as ft
    from ftitan.models import llama
    from ftitan.train.runtime import gradient_path, step_options

    fast_paths = ft.config.compose(ft.config.with_kernels(kernels), ft.config.with_float8(float8),
                                   ft.config.with_attn_impl(attn_impl),
                                   ft.config.with_model_fields(fuse_projections=fuse_projections))  # fmt: skip
    model = llama.model(fast_paths(_llama_config(cfg)))
    params = model.init(ft.random.key(seed), device=device)
    opt = ft.optim.adamw(
        peers.DEFAULT_LR, b1=peers.ADAMW_BETAS[0], b2=peers.ADAMW_BETAS[1], eps=peers.ADAMW_EPS,
        weight_decay=peers.ADAMW_WEIGHT_DECAY,
    )
    precision = ft.train.MixedPrecision(compute_dtype=compute_dtype).for_model(model)
    # donated, as the trainer runs it: params and moments updated in place, like the peers' torch.optim
    step = ft.train.make_train_step(ft.train.next_token_loss(model), opt, donate=True, precision=precision,
                                    grad_impl=gradient_path(**step_options(model.config)))  # fmt: skip
    if compile:
        step = torch.compile(step, fullgraph=True)
    tokens = peers.make_batch(cfg, seed=seed, device=device)
    batch = {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    state = ft.train.init_state(params, opt)

    def run_one() -> float:
        nonlocal state
        b = batch if batches is None else {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        state, metrics = step(state, b)
        return float(metrics["loss"])

    run_one.close = getattr(batches, "close", lambda: None)  # type: ignore[attr-defined]
    return run_one


STREAMING_PEER = "ftitan-compiled-streaming"


def streaming_loader(cfg: dict[str, Any], directory: Path) -> tuple[Any, Any]:
    """A sharded JSONL corpus (stdlib documents, 4 shards) under ``directory`` and a BPE trained on it:
    ``(source, tokenizer)`` for the streaming loader."""
    import json

    import ftitan as ft

    docs = [d for _, d in zip(range(4000), ft.data.stdlib_corpus())]
    for k in range(4):
        (directory / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[k::4]))
    tok = ft.data.train_tokenizer(docs[:1000], min(cfg["vocab_size"], 8192))
    return ft.data.shards(directory), tok


def _streaming(cfg: dict[str, Any], source: Any, tok: Any) -> Iterator[dict[str, torch.Tensor]]:
    import ftitan as ft

    state = ft.data.init_stream_state(0, cfg["batch_size"])
    return ft.data.prefetch(ft.data.stream_batches(source, tok, state, seq_len=cfg["seq_len"],
                                                   batch_size=cfg["batch_size"]))  # fmt: skip


def _build(name: str, cfg: dict[str, Any], device: torch.device, dtype: torch.dtype,
           loader: tuple[Any, Any] | None = None, **fast: Any) -> Callable[[], float]:  # fmt: skip
    """Peer ``name``'s step; ``fast``: the ftitan peers' model-config choices (``ftitan_step``'s ``kernels``,
    ``float8``, ``attn_impl``, ``fuse_projections``)."""
    if name.endswith(BF16):
        return _build(name.removesuffix(BF16), cfg, device, torch.bfloat16, loader, **fast)
    if name == STREAMING_PEER:
        assert loader is not None
        return ftitan_step(cfg, compile=True, device=device, compute_dtype=dtype, batches=_streaming(cfg, *loader),
                           **fast)
    family, _, mode = name.rpartition("-")
    compile = mode == "compiled"
    if mode not in ("eager", "compiled"):
        raise ValueError(f"unknown peer {name!r}; peers end in -eager or -compiled")
    if family == "ftitan":
        return ftitan_step(cfg, compile=compile, device=device, compute_dtype=dtype, **fast)
    if family == "hf":
        autocast = dtype if dtype != torch.float32 else None
        return peers.hf_llama_step(cfg, compile=compile, adamw_impl="fused", device=device, autocast_dtype=autocast)
    if family == "torchtitan":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError("the torchtitan peer runs fp32 on the CPU only (its SDPA Llama build)")
        return peers.torchtitan_llama_step(cfg, compile=compile, adamw_impl="fused")
    raise ValueError(f"unknown peer {name!r}; known families: ftitan, hf, torchtitan")


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    """Peer ratios within a row (fp32, or the ``-bf16`` peers), and each row's ftitan-compiled over its
    own GEMM peak (``<row's ftitan-compiled>/gemm-peak``: model FLOP/s / peak FLOP/s)."""
    out: dict[str, float] = {}
    for peer in ("ftitan-compiled", "ftitan-compiled" + BF16):
        if peer in results:
            out[f"{peer}/gemm-peak"] = results[peer]["mfu_vs_gemm_peak"]
    bf16 = {k: v["tokens_per_s"] for k, v in results.items() if k.endswith(BF16)}
    if "ftitan-compiled" + BF16 in bf16:
        for peer in sorted(set(bf16) - {"ftitan-compiled" + BF16}):
            out[f"ftitan-compiled{BF16}/{peer}"] = bf16["ftitan-compiled" + BF16] / bf16[peer]
    tps = {k: v["tokens_per_s"] for k, v in results.items() if not k.endswith(BF16)}
    if "ftitan-compiled" not in tps:
        return out
    ours = tps["ftitan-compiled"]
    if "ftitan-compiled" + BF16 in bf16:  # what bf16 compute buys the step
        out[f"ftitan-compiled{BF16}/ftitan-compiled"] = bf16["ftitan-compiled" + BF16] / ours
    for peer in sorted(tps):
        if peer not in ("ftitan-compiled", STREAMING_PEER):
            out[f"ftitan-compiled/{peer}"] = ours / tps[peer]
    if STREAMING_PEER in tps:  # the streaming loader's cost to the step
        out[f"{STREAMING_PEER}/ftitan-compiled"] = tps[STREAMING_PEER] / ours
    compiled_peers = [tps[p] for p in ("hf-compiled", "torchtitan-compiled") if p in tps]
    if compiled_peers:
        out["ftitan-compiled/best-compiled-peer"] = ours / max(compiled_peers)
    return out


def _config(opts: Options) -> dict[str, Any]:
    if opts.model not in SHAPES:
        raise ValueError(f"--model={opts.model!r}: expected one of {tuple(SHAPES)}")
    cfg = dict(QUICK_CONFIG if opts.quick else SHAPES[opts.model])
    for key in ("seq_len", "batch_size"):
        if getattr(opts, key) < 0:
            raise ValueError(f"--{key.replace('_', '-')}={getattr(opts, key)}: must be >= 0 (0: the shape's own)")
        cfg[key] = getattr(opts, key) or cfg[key]
    return cfg


def _device_peak(device: torch.device) -> dict[str, Any] | None:
    """The device's published dense bf16 peak, when it is one we know."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in DEVICE_BF16_PEAKS.items():
        if key in name:
            return {"device": name, "dtype": "bfloat16", "flops_per_s": flops}
    return None


def _skipped(names: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    skipped = {}
    for n in [n for n in names if n.endswith(BF16)]:
        if dtype != torch.float32:
            skipped[n] = f"--mixed-precision {str(dtype).removeprefix('torch.')}: every peer already computes in it"
        elif device.type == "cpu" and "avx512_bf16" not in timing.cpu_flags():
            skipped[n] = "this CPU has no AVX512-BF16: its bf16 GEMMs are emulated, so the row would measure that"
        elif n.removesuffix(BF16) not in ("ftitan-compiled", "ftitan-eager", "hf-eager", "hf-compiled"):
            skipped[n] = "bf16 rows are built for the ftitan and hf peers"
    for n in [n for n in names if n.startswith("torchtitan")]:
        if importlib.util.find_spec("torchtitan") is None:
            skipped[n] = "torchtitan is not installed: pip install -e '.[bench]'"
        elif device.type != "cpu" or dtype != torch.float32:
            skipped[n] = "the torchtitan peer is built for fp32 on the CPU (SDPA Llama); run it with --device cpu"
    return skipped


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result."""
    from ftitan.train.runtime import resolve_device

    if opts.threads:
        torch.set_num_threads(opts.threads)
    from ftitan.kernels import onednn
    from ftitan.kernels.op import check_kernels

    check_kernels(opts.kernels, "--kernels")
    from ftitan.nn.float8 import check_recipe

    check_recipe(opts.float8, "--float8")
    if opts.mixed_precision not in DTYPES:
        raise ValueError(f"--mixed-precision={opts.mixed_precision!r}: expected one of {tuple(DTYPES)}")
    from ftitan.nn.attention import IMPLS

    if opts.attn_impl not in IMPLS:
        raise ValueError(f"--attn-impl={opts.attn_impl!r}: expected one of {IMPLS}")
    from ftitan.config.validate import GEMM_LIBRARIES

    if opts.gemm_library not in GEMM_LIBRARIES:
        raise ValueError(f"--gemm-library={opts.gemm_library!r}: expected one of {GEMM_LIBRARIES}")
    onednn.pin(None if opts.gemm_library == "auto" else opts.gemm_library)
    device, dtype, cfg = resolve_device(opts.device), DTYPES[opts.mixed_precision], _config(opts)
    malloc = {}
    if device.type == "cpu" and opts.malloc_retain:
        from ftitan.train.memory import retain_freed_memory

        malloc = retain_freed_memory()  # process-wide: every peer's freed buffers stay in the heap
    names = list(opts.peers)
    skipped = _skipped(names, device, dtype)
    with tempfile.TemporaryDirectory(prefix="ftitan-bench-") as tmp:
        loader = streaming_loader(cfg, Path(tmp)) if STREAMING_PEER in names else None
        steps: dict[str, Callable[[], Any]] = {
            n: _build(n, cfg, device, dtype, loader, kernels=opts.kernels, float8=opts.float8,
                      attn_impl=opts.attn_impl, fuse_projections=opts.fuse_projections)  # fmt: skip
            for n in names
            if n not in skipped
        }
        # the GEMM peaks, sampled in every round beside the steps (their rows' denominators)
        # --quick is a smoke run: a small probe (a 2048^3 bf16 GEMM where the CPU lacks AVX512-BF16 is emulated,
        # ~15 minutes of the quick bf16 run on an AVX2 EPYC)
        size = QUICK_PROBE if opts.quick else 8192 if device.type == "cuda" else 2048
        probes = {dtype: timing.GemmProbe(size, dtype, device=device)}
        if any(n.endswith(BF16) for n in steps):
            probes[torch.bfloat16] = timing.GemmProbe(probes[dtype].n, torch.bfloat16, device=device)
        steps |= {_PROBE + str(d): p for d, p in probes.items()}
        measured = timing.time_steps(
            steps, tokens_per_step=cfg["batch_size"] * cfg["seq_len"], warmup=opts.warmup, rounds=opts.rounds
        )
        for d in probes:
            measured["results"].pop(_PROBE + str(d))
        loader_speed = None
        if loader is not None:
            from ftitan.data import loader_throughput

            loader_speed = loader_throughput(*loader, seq_len=cfg["seq_len"], batch_size=cfg["batch_size"])
        for fn in steps.values():
            close = getattr(fn, "close", None)
            if close is not None:
                close()
    peaks = {d: p.result(skip=opts.warmup) for d, p in probes.items()}
    peak = peaks[dtype]
    device_peak = _device_peak(device)
    flops_per_token = _llama_model_flops(cfg)
    results = measured["results"]
    for name, r in results.items():
        row_dtype = torch.bfloat16 if name.endswith(BF16) else dtype
        r["compute_dtype"] = str(row_dtype).removeprefix("torch.")
        r["model_flops_per_s"] = r["tokens_per_s"] * flops_per_token
        r["mfu_vs_gemm_peak"] = r["model_flops_per_s"] / peaks[row_dtype]["flops_per_s"]
        if device_peak is not None:
            r["mfu_vs_device_peak"] = r["model_flops_per_s"] / device_peak["flops_per_s"]
    ratios = _ratios(results)
    goals = {k: v for k, v in GOALS.items() if k in ratios}
    if opts.quick or opts.model != "core" or device.type != "cpu":  # the GEMM-peak goal is the CPU core shape's
        goals.pop("ftitan-compiled/gemm-peak", None)
    if device_peak is not None and "ftitan-compiled" in results:
        ratios["ftitan-compiled/device-peak"] = results["ftitan-compiled"]["mfu_vs_device_peak"]  # MFU
        if opts.model == "llama3-8b-2layers" and not opts.quick:
            goals["ftitan-compiled/device-peak"] = MFU_GOAL_8B
    return {
        "bench": "step",
        "config": cfg | {"model": "quick" if opts.quick else opts.model, "dtype": "float32",
                         "compute_dtype": str(dtype).removeprefix("torch."), "device": str(device),
                         "optimizer": "adamw", "quick": opts.quick, "kernels": opts.kernels,
                         "attn_impl": opts.attn_impl, "float8": opts.float8,
                         "fuse_projections": opts.fuse_projections, "gemm_library": opts.gemm_library,
                         "malloc_retain": malloc},  # fmt: skip
        "machine": timing.machine_info(),
        "gemm_peak": peak,
        "gemm_peak_bf16": peaks.get(torch.bfloat16) if dtype != torch.bfloat16 else None,  # the -bf16 rows' peak
        "device_peak": device_peak,
        "loader": loader_speed,
        "gemm_libraries": onednn.choices(),  # the library each GEMM kind and shape ran in (ftitan.kernels.onednn)
        "model_flops_per_token": flops_per_token,
        "results": results,
        "skipped": skipped,
        "ratios": ratios,
        "goals": goals,
        "met": bool(goals) and all(ratios[k] >= v for k, v in goals.items()),
    }


_PROBE = "gemm-peak:"  # the GEMM probes' names among time_steps' peers


def _llama_model_flops(cfg: dict[str, Any]) -> float:
    from ftitan.models import llama

    return llama.model(_llama_config(cfg)).flops_per_token(cfg["seq_len"])


def main(argv: list[str] | None = None) -> int:
    return timing.cli(Options, run, argv, prog="ftitan bench step", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
