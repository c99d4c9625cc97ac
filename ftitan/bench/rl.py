"""``ftitan bench rl`` / ``python -m ftitan.bench.rl``: what the batch-invariant mode costs, and async vs sync RL.

Three measurements, side by side in one process (see DESIGN.md, "Benchmarks"):

- ``generation``: :func:`ftitan.infer.generate` of ``batch`` prompts (``prompt_len`` tokens, sampled at
  temperature 1 with log-probs, ``new_tokens`` new ones each) with the model as configured (``default``)
  and in the batch-invariant mode (``batch_invariant``: ``ftitan.config.batch_invariant``), interleaved
  by :func:`ftitan.bench.timing.time_steps`. Tokens/s counts the new tokens. ``generation_compiled``:
  the same with the decode steps compiled by inductor (``generate(compile=True)``; not with
  ``--no-compile`` or ``--quick``), what a serving generator runs.
- ``trainer``: one GRPO train step (``make_train_step(grpo_loss_fn(model))``: forward and backward of the
  policy loss, AdamW) on ``batch`` rows of ``seq_len`` tokens, default vs batch-invariant, compiled with
  inductor unless ``--no-compile``. Tokens/s counts the rows' tokens.
- ``rl``: whole ``ftitan rl`` runs of ``rl_steps`` steps from one SFT warm start (made first, untimed),
  synchronous (``--rl.max-offpolicy-steps 0``) and asynchronous (``1``: a generator thread samples the
  next batch while the trainer trains; ``async_process``: the generator in its own process, its start
  and policy load included), eager; after an untimed short run of sync and async, two timed runs of
  each, interleaved (forward, then backward); steps/s of each (mean wall time), their ratios to sync, and
  every run's ledger checked: every rollout trained at most once, none both trained and dropped
  (asserted; the counts are reported, summed over the timed runs).

Goals (``goal_is: "max"``, each a cost ratio invariant/default of seconds per step): compiled generation
<= 1.5, trainer <= 1.5. Eager generation's ratio is reported, not judged: eagerly every op of a decode
step is a kernel call on a few small tensors, and the invariant formulas (``exp``/``log`` polynomials,
tree sums, blocked attention) are several times more ops; a generator compiles them. The async speed-up
(goal >= 1.3) needs a generator and a trainer that do not share two CPU cores; it is reported here and
judged on a GPU. Prints one JSON object; ``--out FILE`` also writes it.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from ftitan.bench import timing

__all__ = ["Options", "main", "run"]

# eager generation is reported, not judged: a generator compiles its decode steps (vLLM, or generate(compile=...))
GOALS = {"generation_compiled batch_invariant/default": 1.5, "trainer batch_invariant/default": 1.5}
ASYNC_GOAL = 1.3  # async steps/s over sync: judged on a GPU (reported here)
# the RL runs: (--rl.max-offpolicy-steps, --rl.worker)
MODES = {"sync": (0, "thread"), "async": (1, "thread"), "async_process": (1, "process")}


@attrs.frozen(kw_only=True)
class Options:
    """Options of ``ftitan bench rl``."""

    recipe: str = "llama3-debug"
    """The model whose generation and train step are timed (the recipe's --model)."""
    batch: int = 16
    """Prompts generated / rows trained per step."""
    prompt_len: int = 32
    """Tokens per prompt (generation)."""
    new_tokens: int = 32
    """New tokens per prompt (generation)."""
    seq_len: int = 128
    """Tokens per training row."""
    warmup: int = 1
    """Untimed calls per peer first (compilation)."""
    rounds: int = 3
    """Timed rounds; medians are reported."""
    compile: bool = True
    """Compile the train step with inductor (both modes)."""
    rl_steps: int = 12
    """Steps of each whole RL run (sync and async); 0 skips that part."""
    quick: bool = False
    """A tiny model and few steps (a smoke run, not a measurement)."""
    out: Path | None = None
    """Also write the JSON to this file."""


def _model_cfg(opts: Options) -> Any:
    from ftitan.config import get_recipe
    from ftitan.config.transforms import compose, with_dim, with_layers, with_vocab

    cfg = get_recipe(opts.recipe).model
    if opts.quick:
        cfg = compose(with_layers(1), with_vocab(256), with_dim(64, ffn_dim=128))(cfg)
    return cfg


def _generation(opts: Options, cfgs: dict[str, Any], *, compile: bool = False) -> dict[str, Any]:
    from ftitan import random
    from ftitan.infer import Sampling, generate
    from ftitan.models import registry

    g = torch.Generator().manual_seed(0)
    base = registry.model_for(cfgs["default"])
    params = base.init(random.key(0))
    prompts = torch.randint(1, cfgs["default"].vocab_size, (opts.batch, opts.prompt_len), generator=g).tolist()

    def step(model: Any) -> Any:
        return lambda: generate(model, params, prompts, max_new_tokens=opts.new_tokens, sampling=Sampling(),
                                key=random.key(1), logprobs=True, compile=compile)  # fmt: skip

    steps = {name: step(registry.model_for(c)) for name, c in cfgs.items()}
    warmup = max(opts.warmup, 1) if compile else opts.warmup  # compiled: the first call compiles
    return timing.time_steps(steps, tokens_per_step=opts.batch * opts.new_tokens, warmup=warmup,
                             rounds=opts.rounds)  # fmt: skip


def _trainer(opts: Options, cfgs: dict[str, Any]) -> dict[str, Any]:
    from ftitan import optim, random, train
    from ftitan.models import registry
    from ftitan.rl.losses import grpo_loss_fn

    g = torch.Generator().manual_seed(0)
    v = cfgs["default"].vocab_size
    inputs = torch.randint(1, v, (opts.batch, opts.seq_len), generator=g)
    targets = torch.randint(1, v, (opts.batch, opts.seq_len), generator=g)
    targets[:, : opts.seq_len // 4] = -100  # the prompt part is not trained on
    batch = {"inputs": inputs, "targets": targets, "advantages": torch.randn(opts.batch, generator=g)}
    params = registry.model_for(cfgs["default"]).init(random.key(0))
    opt = optim.adamw(1e-4, weight_decay=0.0)

    def make(c: Any) -> Any:
        model = registry.model_for(c)
        step = train.make_train_step(grpo_loss_fn(model), opt)
        step = torch.compile(step, fullgraph=True) if opts.compile and not opts.quick else step
        state = train.init_state(params, opt)
        return lambda: step(state, batch)[1]["loss"].item()  # the same state each call: a step from one point

    steps = {name: make(c) for name, c in cfgs.items()}
    return timing.time_steps(steps, tokens_per_step=opts.batch * opts.seq_len, warmup=opts.warmup,
                             rounds=opts.rounds)  # fmt: skip


def _rl(opts: Options, root: Path) -> dict[str, Any]:
    from ftitan.config import parse_train_args
    from ftitan.rl.loop import rl_train

    common = ["--recipe", "grpo-arith", "--compile", "False", "--rl.eval-prompts", "0", "--optim.warmup", "1",
              "--ckpt-every", "0"]  # fmt: skip
    if opts.quick:
        common += ["--rl.prompts", "2", "--rl.group-size", "4"]
    warm = parse_train_args([*common, "--run-dir", str(root / "warm"), "--steps", "1"], rl=True)
    rl_train(warm, progress=False)  # the SFT stage, once: every run starts from it
    runs = 0

    def one(name: str, steps: int) -> tuple[float, Any]:
        nonlocal runs
        runs += 1
        k, worker = MODES[name]
        cfg = parse_train_args([*common, "--run-dir", str(root / f"{name}-{runs}"), "--steps", str(steps),
                                "--rl.init-run", str(root / "warm" / "sft"), "--rl.max-offpolicy-steps", str(k),
                                "--rl.worker", worker], rl=True)  # fmt: skip
        t0 = time.perf_counter()
        res = rl_train(cfg, progress=False)
        return time.perf_counter() - t0, res

    for name in ("sync", "async"):  # untimed: first-call costs (imports, allocator, thread start)
        one(name, 2)
    walls: dict[str, list[float]] = {name: [] for name in MODES}
    out: dict[str, Any] = {}
    for order in (tuple(MODES), tuple(reversed(MODES))):  # interleaved, each mode first once
        for name in order:
            wall, res = one(name, opts.rl_steps)
            walls[name].append(wall)
            ledger = res["ledger"]
            trained = ledger.trained_ids  # (the ledger raises on a second use; counted here again all the same)
            queued = ledger.made_ids - set(trained) - set(ledger.dropped_ids)  # the final checkpoint's queue
            reused = len(trained) - len(set(trained))
            if reused or set(ledger.dropped_ids) & set(trained):
                raise AssertionError(f"bench rl ({name}): a rollout was trained on twice, or trained and dropped")
            lags = [r["rl.lag"] for r in res["records"] if "rl.lag" in r]
            prev = out.get(name, {"rollouts_trained": 0, "rollouts_dropped_stale": 0, "rollouts_left_queued": 0,
                                  "rollouts_reused": 0, "max_lag": 0.0})  # fmt: skip
            out[name] = {"rollouts_trained": prev["rollouts_trained"] + len(trained),
                         "rollouts_dropped_stale": prev["rollouts_dropped_stale"] + len(ledger.dropped_ids),
                         "rollouts_left_queued": prev["rollouts_left_queued"] + len(queued),
                         "rollouts_reused": prev["rollouts_reused"] + reused,
                         "max_lag": max([prev["max_lag"], *lags])}  # fmt: skip
    for name, w in walls.items():
        out[name].update(runs=len(w), wall_s=statistics.mean(w), wall_times_s=w,
                         steps_per_s=opts.rl_steps / statistics.mean(w))
    out["async/sync_steps_per_s"] = out["async"]["steps_per_s"] / out["sync"]["steps_per_s"]
    out["async_process/sync_steps_per_s"] = out["async_process"]["steps_per_s"] / out["sync"]["steps_per_s"]
    return out


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result."""
    from ftitan.config import batch_invariant

    if opts.batch < 1 or opts.rounds < 1 or opts.warmup < 0 or opts.rl_steps < 0:
        raise ValueError("--batch and --rounds must be >= 1, --warmup and --rl-steps >= 0")
    base = _model_cfg(opts)
    cfgs = {"default": base, "batch_invariant": batch_invariant(base)}
    parts = {"generation": _generation(opts, cfgs)}
    if opts.compile and not opts.quick:  # the decode steps compiled with inductor (the prefill stays eager)
        parts["generation_compiled"] = _generation(opts, cfgs, compile=True)
    parts["trainer"] = _trainer(opts, cfgs)
    ratios = {f"{part} batch_invariant/default": r["results"]["batch_invariant"]["median_s"]
              / r["results"]["default"]["median_s"] for part, r in parts.items()}  # fmt: skip
    rl = None
    if opts.rl_steps:  # the runs' own lines (the SFT stage's evaluation) to stderr: stdout is the JSON
        with tempfile.TemporaryDirectory(prefix="ftitan-bench-rl-") as root, contextlib.redirect_stdout(sys.stderr):
            rl = _rl(opts, Path(root))
    return {
        "bench": "rl",
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in attrs.asdict(opts).items()},
                   "model": type(base).__module__, "dim": base.dim, "n_layers": base.n_layers,
                   "vocab_size": base.vocab_size},  # fmt: skip
        "machine": timing.machine_info(),
        "results": {**parts, "rl": rl},
        "ratios": ratios,
        "goals": {k: v for k, v in GOALS.items() if k in ratios},
        "goal_is": "max",  # a cost ratio meets its goal when it is at most the goal
        "met": all(ratios[k] <= v for k, v in GOALS.items() if k in ratios),
        "reported": {"async/sync_steps_per_s": None if rl is None else rl["async/sync_steps_per_s"],
                     "async_process/sync_steps_per_s": None if rl is None else rl["async_process/sync_steps_per_s"],
                     "async_goal_on_gpu": ASYNC_GOAL},  # fmt: skip
    }


def main(argv: list[str] | None = None) -> int:
    return timing.cli(Options, run, argv, prog="ftitan bench rl", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
