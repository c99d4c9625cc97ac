"""``ftitan bench generate``: greedy decode tokens/s, peers side by side on the same weights.

One Llama 3 config (the ``llama3-debug`` model by default), ``batch`` prompts
of ``prompt_len`` random tokens, ``new_tokens`` greedy tokens each (EOS
ignored), fp32, for batch 1 and 8, in one process, interleaved after warm-up:

- ``ftitan-compiled``: ``ftitan.infer.generate(..., compile=True)`` (KV cache
  tree, decode step under ``torch.compile``)
- ``hf``: ``transformers.LlamaForCausalLM.generate`` (its dynamic KV cache)
- ``vllm-ftitan``: vLLM with the ftitan model (``ftitan.vllm``: the same pure
  functions, vLLM's paged attention)
- ``vllm-builtin``: vLLM with its own ``LlamaForCausalLM`` on the same weights

Decode tokens/s = ``batch * (new_tokens - 1) / (t(new_tokens) - t(1))``: the
time of a whole generation minus that of one producing only the first token
(prefill), so prompt processing is not counted; ``null`` (unmeasured, its
ratios null and ``met`` false) when the difference is not positive, as a
loaded machine can time it for a tiny model. Every peer's tokens are
compared (``same_tokens``). Goals: ftitan-compiled >= 2x hf, vllm-ftitan >=
0.9x vllm-builtin, at each batch size. The native peers are measured first,
then the vLLM ones (see ``_groups``).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from ftitan.bench import timing

__all__ = ["GOALS", "Options", "main", "run"]

GOALS = {"ftitan-compiled/hf": 2.0, "vllm-ftitan/vllm-builtin": 0.9}  # judged at every batch size
PEERS = ("ftitan-compiled", "hf", "vllm-ftitan", "vllm-builtin")


@attrs.frozen(kw_only=True)
class Options:
    """Options of ``ftitan bench generate``."""

    peers: tuple[str, ...] = PEERS
    """Which peers to run (vllm-* need the ``vllm`` extra)."""
    batches: tuple[int, ...] = (1, 8)
    """Batch sizes to measure."""
    prompt_len: int = 32
    """Tokens per prompt."""
    new_tokens: int = 64
    """Greedy tokens generated per prompt."""
    warmup: int = 1
    """Untimed generations per peer before timing (the first compiles)."""
    rounds: int = 3
    """Timed round-robin rounds; medians are reported."""
    threads: int = 0
    """torch threads (0: keep torch's default)."""
    quick: bool = False
    """A tiny model and short generations (a smoke run, not a measurement)."""
    out: Path | None = None
    """Also write the JSON to this file."""


def _config(quick: bool) -> Any:
    from ftitan.models import llama

    cfg = llama.Config.debug()
    return attrs.evolve(cfg, vocab_size=512, dim=64, n_layers=2, n_heads=2, ffn_dim=128) if quick else cfg


def _prompts(cfg: Any, batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=g).tolist()


Generate = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, new tokens) -> new tokens of each


def _ftitan(model: Any, params: Any) -> Generate:
    from ftitan.infer import generate

    return lambda prompts, n: generate(model, params, prompts, max_new_tokens=n, compile=True)


def _hf(cfg: Any, params: Any) -> Generate:
    import transformers

    from ftitan.models import hf

    hcfg = transformers.LlamaConfig(**{k: v for k, v in hf.config_to_hf(cfg).items() if k != "architectures"})
    m = transformers.LlamaForCausalLM._from_config(hcfg, attn_implementation="sdpa").eval()
    m.load_state_dict(hf.to_hf(params, cfg), strict=not cfg.tie_embeddings)

    def run(prompts: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
        return out[:, ids.shape[1] :].tolist()

    return run


def _vllm(directory: Path, *, builtin: bool, max_batch: int) -> Generate:
    from ftitan import vllm as ftvllm
    from ftitan.vllm._env import import_vllm

    vllm = import_vllm()  # points vLLM's caches into .cache/ first, as engine() does
    settings = dict(dtype="float32", max_num_seqs=max_batch, enforce_eager=True)
    if builtin:  # vLLM's own LlamaForCausalLM on the same directory and engine settings
        llm = vllm.LLM(model=str(directory), skip_tokenizer_init=True, kv_cache_memory_bytes=256 << 20, seed=0,
                       **settings)  # fmt: skip
    else:
        llm = ftvllm.engine(directory, **settings)

    def run(prompts: list[list[int]], n: int) -> list[list[int]]:
        greedy = vllm.SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        return [c.tokens for c in ftvllm.complete(llm, prompts, greedy)]

    return run


def _peers(names: list[str], cfg: Any, params: Any, model: Any, workdir: Path, max_batch: int) -> dict[str, Generate]:
    from ftitan.models import hf

    built: dict[str, Generate] = {}
    for name in names:
        if name == "ftitan-compiled":
            built[name] = _ftitan(model, params)
        elif name == "hf":
            built[name] = _hf(cfg, params)
        elif name in ("vllm-ftitan", "vllm-builtin"):
            directory = workdir / "hf"
            if not (directory / "config.json").exists():
                hf.save_hf(params, cfg, directory)
            built[name] = _vllm(directory, builtin=name == "vllm-builtin", max_batch=max_batch)
        else:
            raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    return built


def _measure(peers: dict[str, Generate], prompts: list[list[int]], opts: Options, n: int) -> dict[str, Any]:
    """Time whole generations of ``n`` and of 1 token per peer; decode tokens/s from the difference."""
    calls: dict[str, Callable[[], Any]] = {}
    for name, gen in peers.items():
        calls[f"{name}@{n}"] = lambda gen=gen: gen(prompts, n)
        calls[f"{name}@1"] = lambda gen=gen: gen(prompts, 1)
    timed = timing.time_steps(calls, tokens_per_step=len(prompts), warmup=opts.warmup, rounds=opts.rounds)["results"]
    results = {}
    for name, gen in peers.items():
        full, prefill = timed[f"{name}@{n}"]["median_s"], timed[f"{name}@1"]["median_s"]
        results[name] = {
            # null when the n-token generation timed no slower than the 1-token one (noise on a loaded machine):
            # unmeasured, not an absurd rate
            "decode_tokens_per_s": len(prompts) * (n - 1) / (full - prefill) if full > prefill else None,
            "generation_s": full,
            "prefill_s": prefill,
            "tokens": gen(prompts, n),
        }
    return results


def _groups(names: list[str]) -> list[list[str]]:
    """Peers measured side by side: the native ones, then the vLLM ones. An in-process vLLM engine
    changes the whole process (its CPU worker binds the OpenMP threads, replaces
    ``torch.set_num_threads``), which slowed the native peers by up to a third, so they run before
    any engine exists; each goal compares peers of one group."""
    native = [n for n in names if not n.startswith("vllm")]
    return [g for g in (native, [n for n in names if n.startswith("vllm")]) if g]


def _ratios(by_batch: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Each goal's ratio per batch size where both its peers ran; ``None`` where either rate is unmeasured."""
    out: dict[str, float | None] = {}
    for batch, results in by_batch.items():
        for pair in GOALS:
            a, b = pair.split("/")
            if a in results and b in results:
                ra, rb = results[a]["decode_tokens_per_s"], results[b]["decode_tokens_per_s"]
                out[f"{pair}@{batch}"] = ra / rb if ra is not None and rb is not None else None
    return out


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result."""
    import ftitan as ft

    if opts.threads:
        torch.set_num_threads(opts.threads)
    cfg = _config(opts.quick)
    n = 8 if opts.quick else opts.new_tokens
    model = ft.models.registry.model_for(cfg)
    params = model.init(ft.random.key(0))
    names, skipped = list(opts.peers), {}
    if importlib.util.find_spec("vllm") is None:
        for name in [p for p in names if p.startswith("vllm")]:
            names.remove(name)
            skipped[name] = "vllm is not installed: see docs/inference.md (the vllm extra)"
    by_batch: dict[str, dict[str, Any]] = {f"b{b}": {} for b in opts.batches}
    with tempfile.TemporaryDirectory(prefix="ftitan-bench-generate-") as tmp:
        for group in _groups(names):
            peers = _peers(group, cfg, params, model, Path(tmp), max(opts.batches))
            for batch in opts.batches:
                by_batch[f"b{batch}"] |= _measure(peers, _prompts(cfg, batch, opts.prompt_len), opts, n)
    for results in by_batch.values():  # every peer must decode the same greedy tokens
        first = next(iter(results.values()))["tokens"]
        for r in results.values():
            r["same_tokens_as_first_peer"] = r.pop("tokens") == first
    ratios = _ratios(by_batch)
    goals = {k: GOALS[k.split("@")[0]] for k in ratios}
    same = all(r["same_tokens_as_first_peer"] for res in by_batch.values() for r in res.values())
    return {
        "bench": "generate",
        "config": {"model": attrs.asdict(cfg), "prompt_len": opts.prompt_len, "new_tokens": n,
                   "batches": list(opts.batches), "dtype": "float32", "sampling": "greedy", "quick": opts.quick},
        "machine": timing.machine_info(),
        "results": by_batch,
        "skipped": skipped,
        "same_tokens": same,
        "ratios": ratios,
        "goals": goals,
        "met": bool(goals) and same and all(ratios[k] is not None and ratios[k] >= v for k, v in goals.items()),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return timing.cli(Options, run, argv, prog="ftitan bench generate", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
