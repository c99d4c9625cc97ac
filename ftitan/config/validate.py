"""Whole-run checks: ``validate(cfg)`` raises ``ValueError`` naming the CLI flag and the fix.

Each field is checked alone where it can be (``--optim.lr``), then the
cross-field rules (``--model.vocab-size`` vs ``--data.vocab-size``). The
model's own checks (``llama.Config.__attrs_post_init__``) are re-run and
re-worded to name ``--model.<field>``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import attrs
import torch

from ftitan.config.schema import TrainConfig
from ftitan.config.transforms import model_error, with_float8
from ftitan.kernels import onednn
from ftitan.kernels.op import KERNELS

__all__ = ["MIN_VOCAB", "OPTIMIZERS", "SCHEDULES", "validate"]

OPTIMIZERS: tuple[str, ...] = ("adamw", "muon")  # what ftitan.optim.from_config builds
SCHEDULES: tuple[str, ...] = ("cosine", "wsd", "constant")
PP_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")
NONFINITE: tuple[str, ...] = ("skip", "stop", "off")  # --optim.nonfinite (ftitan.optim.from_config)
MIN_VOCAB = 257  # byte-level BPE: 256 byte tokens plus at least one merge / special token


def _fail(flag: str, value: object, fix: str) -> ValueError:
    return ValueError(f"{flag}={value!r}: {fix}")


def _floats(obj: object, names: tuple[str, ...] = ()) -> list[tuple[str, float]]:
    """``[("--optim.lr", 3e-3), ...]``: every float field of a config tree, as its CLI flag."""
    out: list[tuple[str, float]] = []
    for field in attrs.fields(type(obj)):
        value, path = getattr(obj, field.name), (*names, field.name.replace("_", "-"))
        if attrs.has(type(value)):
            out.extend(_floats(value, path))
        elif isinstance(value, float):
            out.append(("--" + ".".join(path), value))
    return out


def _check_finite(cfg: TrainConfig) -> None:
    for flag, value in _floats(cfg):  # no setting means anything at inf or nan (both pass `> 0`)
        if not math.isfinite(value):
            raise _fail(flag, value, "must be a finite number")


def _check_run_dir(cfg: TrainConfig) -> None:
    """The run directory can be written, checked before any work (every rank: read-only checks)."""
    flag, template = "--run-dir", cfg.run_dir
    try:
        path = template.format(recipe=cfg.recipe)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise _fail(flag, template, f"only {{recipe}} is filled in ({type(e).__name__}: {e}); write a literal "
                    "brace as {{ or }}") from None  # fmt: skip
    if not path.strip():
        raise _fail(flag, template, "name a directory for the run's files (default runs/{recipe}); an empty one would "
                    "write them into the current directory")  # fmt: skip
    run = Path(path)
    for p, what in ((run, "the run directory"), (run / "checkpoints", "its checkpoints directory")):
        if p.exists() and not p.is_dir():
            raise _fail(flag, template, f"{what} {p} is a file; move the file away or pass another --run-dir")
    existing = next(p for p in (run, *run.parents) if p.exists())  # the deepest part that exists, to create in
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _fail(flag, template, f"{existing} is not writable by this user; pass a --run-dir you can write to")


def _check_model(cfg: TrainConfig) -> None:
    try:
        attrs.evolve(cfg.model)  # re-runs llama.Config.__attrs_post_init__
    except ValueError as e:
        raise model_error(e) from e


def _check_optim(cfg: TrainConfig) -> None:
    o = cfg.optim
    if o.name not in OPTIMIZERS:
        raise _fail("--optim.name", o.name, f"expected one of {OPTIMIZERS}")
    if o.schedule not in SCHEDULES:
        raise _fail("--optim.schedule", o.schedule, f"expected one of {SCHEDULES}")
    if not o.lr > 0:
        raise _fail("--optim.lr", o.lr, "the learning rate must be > 0")
    if o.warmup < 0:
        raise _fail("--optim.warmup", o.warmup, "warmup steps must be >= 0")
    if o.warmup > cfg.steps or (o.warmup == cfg.steps and o.schedule != "constant"):
        raise _fail("--optim.warmup", o.warmup, f"warmup must be below --steps={cfg.steps} (the {o.schedule} decay "
                    "follows it); lower it or raise --steps")  # fmt: skip
    if not 0 <= o.final_lr_fraction <= 1:
        raise _fail("--optim.final-lr-fraction", o.final_lr_fraction, "must lie in [0, 1]")
    if not o.weight_decay >= 0:
        raise _fail("--optim.weight-decay", o.weight_decay, "must be >= 0")
    for flag, beta in (("--optim.b1", o.b1), ("--optim.b2", o.b2)):
        if not 0 <= beta < 1:
            raise _fail(flag, beta, "an Adam beta must lie in [0, 1)")
    if not o.clip >= 0:
        raise _fail("--optim.clip", o.clip, "must be >= 0 (0 disables clipping)")
    if o.nonfinite not in NONFINITE:
        raise _fail("--optim.nonfinite", o.nonfinite, f"expected one of {NONFINITE}")
    if o.max_nonfinite < 1:
        raise _fail("--optim.max-nonfinite", o.max_nonfinite, "stop after at least 1 non-finite step in a row")


def _check_checkpoint(cfg: TrainConfig) -> None:
    import importlib.util

    from ftitan.checkpoint import BACKENDS

    c = cfg.checkpoint
    if c.backend not in BACKENDS:
        raise _fail("--checkpoint.backend", c.backend, f"expected one of {BACKENDS}")
    if c.backend == "torch-checkpointing" and importlib.util.find_spec("torch_checkpointing") is None:
        raise _fail("--checkpoint.backend", c.backend, "torch-checkpointing is not installed: pip install "
                    "torch-checkpointing==0.1.1, or use --checkpoint.backend dcp or sync")  # fmt: skip
    if not c.commit_timeout > 0:
        raise _fail("--checkpoint.commit-timeout", c.commit_timeout, "seconds to wait for every rank's files; must "
                    "be > 0")  # fmt: skip
    if not c.subprocess_min_mib >= 0:
        raise _fail("--checkpoint.subprocess-min-mib", c.subprocess_min_mib, "must be >= 0 (0: always the writer "
                    "process)")  # fmt: skip


def _check_parallel(cfg: TrainConfig) -> None:
    p = cfg.parallel
    try:
        p.dims().check(int(os.environ.get("WORLD_SIZE", "1")))  # each degree an int >= 1, product = world size
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("--") else f"--{e}") from None  # name the flag
    if p.pp_schedule not in PP_SCHEDULES:
        raise _fail("--parallel.pp-schedule", p.pp_schedule, f"expected one of {PP_SCHEDULES}")
    if not p.timeout_s > 0:  # (finite: _check_finite)
        raise _fail("--parallel.timeout-s", p.timeout_s, "seconds to wait for the other ranks; must be > 0")
    if p.pp_microbatches < 0:
        raise _fail("--parallel.pp-microbatches", p.pp_microbatches, "must be >= 0 (0: 2 * pp)")
    data_ranks = p.dp_replicate * p.dp_shard * p.ep
    if cfg.data.batch_size % data_ranks:
        raise _fail("--data.batch-size", cfg.data.batch_size,
                    f"must be divisible by dp_replicate * dp_shard * ep = {data_ranks} (each reads its own rows)")
    if p.pp > 1:
        if p.pp > cfg.model.n_layers:
            raise _fail("--parallel.pp", p.pp, f"more pipeline stages than the model's {cfg.model.n_layers} layers")
        local, n = cfg.data.batch_size // data_ranks, p.pp_microbatches or 2 * p.pp
        if local % n:
            raise _fail("--parallel.pp-microbatches", n, f"each rank's batch of {local} rows (--data.batch-size / "
                        f"{data_ranks} data-parallel ranks) must split into that many micro-batches; use a divisor "
                        f"of {local}, or a larger batch")  # fmt: skip
    if p.pp > 1 and cfg.mixed_precision.compute != "fp32":
        raise _fail("--mixed-precision.compute", cfg.mixed_precision.compute, "pipeline parallel runs in fp32 for "
                    "now; use --mixed-precision.compute fp32 with --parallel.pp > 1")  # fmt: skip
    # the expert all-to-all has static sizes (ftitan.parallel.expert's padded exchange): ep > 1 compiles
    if cfg.compile is True and p.pp > 1:  # regional compiles a stage's blocks
        raise _fail("--compile", cfg.compile, "with --parallel.pp > 1 the step runs eagerly (pipeline sends and "
                    "receives run in Python); pass --compile regional or --compile False")  # fmt: skip
    if p.cp > 1 and cfg.data.seq_len % (2 * p.cp):
        raise _fail("--data.seq-len", cfg.data.seq_len, f"context parallel needs a multiple of 2 * cp = {2 * p.cp}")


def _check_data(cfg: TrainConfig) -> None:
    d = cfg.data
    if d.corpus != "stdlib":
        from ftitan.data import shards

        try:
            shards(d.corpus, field=d.jsonl_field)
        except (ValueError, FileNotFoundError) as e:
            raise _fail("--data.corpus", d.corpus, f"use 'stdlib', or .parquet / .jsonl / .txt files, a directory of "
                        f"them or a glob ({e})") from None  # fmt: skip
    if d.tokenizer:
        _check_tokenizer(cfg)
        return
    if d.vocab_size < MIN_VOCAB:
        raise _fail("--data.vocab-size", d.vocab_size, f"byte-level BPE needs >= {MIN_VOCAB} (256 bytes + merges)")
    if d.seq_len < 1:
        raise _fail("--data.seq-len", d.seq_len, "must be >= 1")
    if d.batch_size < 1:
        raise _fail("--data.batch-size", d.batch_size, "must be >= 1")


PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
GEMM_LIBRARIES: tuple[str, ...] = ("auto", *onednn.LIBRARIES)  # --gemm-library (ftitan.kernels.onednn.pin)


def _check_compile_and_remat(cfg: TrainConfig) -> None:
    from ftitan.train.remat import check_policy

    if cfg.compile not in (True, False, "regional"):
        raise _fail("--compile", cfg.compile, "expected True (the whole step), False (eager) or 'regional' (each "
                    "block compiled once)")  # fmt: skip
    if cfg.remat:
        check_policy(cfg.remat, field="--remat")
    if cfg.kernels and cfg.kernels not in KERNELS:
        raise _fail("--kernels", cfg.kernels, f"expected one of {KERNELS} ('triton': ftitan.kernels on CUDA, their "
                    "references and oneDNN or MKL GEMMs on the CPU), or '' for the model's "
                    "--model.kernels")  # fmt: skip
    if cfg.gemm_library not in GEMM_LIBRARIES:
        raise _fail("--gemm-library", cfg.gemm_library, f"expected one of {GEMM_LIBRARIES} ('auto': the fastest of "
                    "MKL, oneDNN's inner product and oneDNN's matmul for each GEMM shape, probed once per "
                    "machine)")  # fmt: skip
    check_policy(getattr(cfg.model, "remat", "none"), field="--model.remat")
    if cfg.float8:
        try:
            with_float8(cfg.float8)(cfg.model)
        except ValueError as e:
            raise (e if str(e).startswith("--float8") else ValueError(f"--float8={cfg.float8!r}: {e}")) from None


def _check_runtime(cfg: TrainConfig) -> None:
    from ftitan.train.runtime import resolve_backend, resolve_device  # the runtime's own rules, checked early

    _check_compile_and_remat(cfg)

    device = resolve_device(cfg.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    resolve_backend(cfg.parallel.backend, device)
    recipe = getattr(cfg.model, "float8", "")
    if recipe and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise _fail("--float8", recipe, f"float8 GEMMs need a GPU of compute capability 8.9 or newer (H100, H200, "
                    f"L4, ...); this one is {torch.cuda.get_device_capability(device)}; drop --float8")  # fmt: skip
    if getattr(cfg.model, "float8_experts", False) and device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (9, 0):
            raise _fail("--model.float8-experts", True, "float8 grouped GEMMs (torch._scaled_grouped_mm) need a GPU of "
                        f"compute capability 9.0 or newer (H100, H200, B200); this one is "
                        f"{torch.cuda.get_device_capability(device)}; drop --model.float8-experts")  # fmt: skip
    from ftitan.parallel.shard import BUCKETS

    if cfg.flexshard.buckets not in BUCKETS:
        raise _fail("--flexshard.buckets", cfg.flexshard.buckets, f"expected one of {BUCKETS} (a collective per "
                    "layer's dp_shard leaves, or per leaf)")  # fmt: skip
    if cfg.flexshard.quantize not in ("", "int8", "fp8"):
        raise _fail("--flexshard.quantize", cfg.flexshard.quantize, "expected 'int8', 'fp8' or '' (gathers in the "
                    "compute dtype)")  # fmt: skip
    if cfg.flexshard.muon not in ("distributed", "gather"):
        raise _fail("--flexshard.muon", cfg.flexshard.muon, "expected 'distributed' (Newton-Schulz on each matrix's "
                    "owner rank) or 'gather' (every rank orthogonalizes every matrix)")  # fmt: skip
    if cfg.flexshard.placement not in ("shard", "block"):
        raise _fail("--flexshard.placement", cfg.flexshard.placement, "expected 'shard' (rows of each weight's model "
                    "dim) or 'block' (whole heads and experts per dp_shard rank)")  # fmt: skip
    if cfg.optim.muon_blocks not in ("", "heads"):
        raise _fail("--optim.muon-blocks", cfg.optim.muon_blocks, "expected 'heads' (per-head Muon on attention "
                    "projections) or '' (whole matrices)")  # fmt: skip
    if cfg.optim.muon_blocks and cfg.optim.name != "muon":
        raise _fail("--optim.muon-blocks", cfg.optim.muon_blocks, f"applies to Muon, and --optim.name is "
                    f"{cfg.optim.name!r}; add --optim.name muon or drop it")  # fmt: skip
    if cfg.flexshard.quantize and cfg.parallel.pp > 1:
        raise _fail("--flexshard.quantize", cfg.flexshard.quantize, "pipeline stages gather in the compute dtype "
                    "for now: drop it under --parallel.pp > 1")  # fmt: skip
    if cfg.flexshard.quantize and cfg.flexshard.buckets != "per_layer":
        raise _fail("--flexshard.quantize", cfg.flexshard.quantize, "quantizes the per-layer bucketed gathers: "
                    "use --flexshard.buckets per_layer")  # fmt: skip
    mp = cfg.mixed_precision
    for field in ("param", "compute", "reduce"):
        value = getattr(mp, field)
        if value not in PRECISIONS:
            raise _fail(f"--mixed-precision.{field}", value, f"expected one of {PRECISIONS}")
    if mp.param != "fp32":
        raise _fail("--mixed-precision.param", mp.param, "master params and optimizer state stay fp32 "
                    "(lower --mixed-precision.compute instead)")  # fmt: skip
    if cfg.init.hf and not (Path(cfg.init.hf) / "config.json").is_file():
        raise _fail("--init.hf", cfg.init.hf, "expected an HF checkpoint directory holding config.json and "
                    "*.safetensors (a transformers save_pretrained directory)")  # fmt: skip


def _check_tokenizer(cfg: TrainConfig) -> None:
    from ftitan.data import pretrained_tokenizer

    try:
        tok = pretrained_tokenizer(cfg.data.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise _fail("--data.tokenizer", cfg.data.tokenizer, f"expected an HF tokenizer directory ({e})") from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise _fail("--data.tokenizer", cfg.data.tokenizer, f"its {tok.vocab_size} tokens do not fit the model's "
                    f"--model.vocab-size={cfg.model.vocab_size}; raise it or use the model's own tokenizer")  # fmt: skip


def _check_loop(cfg: TrainConfig) -> None:
    if cfg.steps < 1:
        raise _fail("--steps", cfg.steps, "train for at least 1 step")
    if cfg.accum_steps < 1:
        raise _fail("--accum-steps", cfg.accum_steps, "must be >= 1")
    for flag, value in (("--eval-every", cfg.eval_every), ("--ckpt-every", cfg.ckpt_every),
                        ("--log-every", cfg.log_every)):  # fmt: skip
        if value < 0:
            raise _fail(flag, value, "an interval must be >= 0 (0: only at the end)")
    if cfg.eval_batches < 1:
        raise _fail("--eval-batches", cfg.eval_batches, "evaluate at least 1 batch")
    if cfg.keep < 1:
        raise _fail("--keep", cfg.keep, "keep at least 1 checkpoint")


def _check_cross(cfg: TrainConfig) -> None:
    m, d = cfg.model, cfg.data
    if m.vocab_size != d.vocab_size and not d.tokenizer:
        raise ValueError(
            f"--model.vocab-size={m.vocab_size} != --data.vocab-size={d.vocab_size}: the tokenizer's vocabulary "
            f"must match the embedding; set both to the same value"
        )
    if d.seq_len > m.max_seq_len:
        raise _fail("--data.seq-len", d.seq_len, f"exceeds --model.max-seq-len={m.max_seq_len}; lower one or raise the other")
    if d.batch_size % cfg.accum_steps:
        raise _fail(
            "--data.batch-size", d.batch_size,
            f"not divisible by --accum-steps={cfg.accum_steps}; each micro-batch must be whole",
        )  # fmt: skip


DPO_LOSSES: tuple[str, ...] = ("sigmoid", "ipo")  # --dpo.loss-type (ftitan.train.dpo)


def _check_post_training(cfg: TrainConfig) -> None:
    """SFT (--data.chat), DPO (--data.preference), LoRA (--lora.*)."""
    d, lo, dpo, p = cfg.data, cfg.lora, cfg.dpo, cfg.parallel
    if d.chat and d.preference:
        raise _fail("--data.preference", d.preference, "one objective a run: --data.chat (SFT) or --data.preference "
                    "(DPO); drop one")  # fmt: skip
    post = "--data.chat" if d.chat else "--data.preference" if d.preference else ""
    if post and d.corpus != "stdlib":
        raise _fail("--data.corpus", d.corpus, f"{post} is this run's data; drop --data.corpus")
    if post and p.pp > 1:
        raise _fail("--parallel.pp", p.pp, f"{post}: packed conversations do not run through pipeline stages yet; "
                    "use --parallel.pp 1 (dp, tp, cp and ep split them)")  # fmt: skip
    from ftitan.data import sft, tasks

    for flag, spec, known in (("--data.chat", d.chat, tasks.TASKS), ("--data.preference", d.preference,
                                                                       sft.PREFERENCE_TASKS)):  # fmt: skip
        if spec.startswith(sft.TASK_PREFIX) and spec.removeprefix(sft.TASK_PREFIX) not in known:
            raise _fail(flag, spec, f"no such synthetic task; known: {', '.join('task:' + t for t in sorted(known))}")
        if spec and not spec.startswith(sft.TASK_PREFIX) and not Path(spec).is_file():
            raise _fail(flag, spec, "no such file; pass a .jsonl file, or task:NAME for a synthetic task")
    if d.task_eval_items < 0:
        raise _fail("--data.task-eval-items", d.task_eval_items, "must be >= 0 (0: no exact-match evaluation)")
    if not isinstance(lo.rank, int) or lo.rank < 0:
        raise _fail("--lora.rank", lo.rank, "must be an int >= 0 (0: full fine-tuning)")
    if lo.alpha < 0:
        raise _fail("--lora.alpha", lo.alpha, "must be >= 0 (0: 2 * rank)")
    if lo.rank and p.pp > 1:
        raise _fail("--lora.rank", lo.rank, "LoRA does not run through pipeline stages; use --parallel.pp 1")
    if d.preference and p.world_size > 1:
        raise _fail("--data.preference", d.preference, "DPO runs on one process for now; drop the --parallel.* "
                    "degrees")  # fmt: skip
    if dpo.loss_type not in DPO_LOSSES:
        raise _fail("--dpo.loss-type", dpo.loss_type, f"expected one of {DPO_LOSSES}")
    if dpo.beta <= 0:
        raise _fail("--dpo.beta", dpo.beta, "must be > 0")
    if not 0 <= dpo.label_smoothing < 0.5:
        raise _fail("--dpo.label-smoothing", dpo.label_smoothing, "must be in [0, 0.5)")
    if dpo.label_smoothing and dpo.loss_type == "ipo":
        raise _fail("--dpo.label-smoothing", dpo.label_smoothing, "applies to --dpo.loss-type sigmoid only")


RL_AGGS = ("token-mean", "seq-mean-token-mean")


def _check_rl(cfg: TrainConfig) -> None:
    """``ftitan rl`` (--rl.*)."""
    rl = cfg.rl
    if not rl.env:
        return
    from ftitan.rl.envs import ENVS

    if rl.env not in ENVS:
        raise _fail("--rl.env", rl.env, f"no such environment; known: {', '.join(sorted(ENVS))}")
    if not rl.sft_steps and not rl.init_run:
        raise _fail("--rl.sft-steps", rl.sft_steps, "RL starts from a policy: pass --rl.sft-steps N (an SFT stage on "
                    "the environment's demonstrations first) or --rl.init-run DIR (a run's checkpoint, e.g. a "
                    "sft-debug run)")  # fmt: skip
    if rl.init_run and not (Path(rl.init_run) / "checkpoints").is_dir():
        raise _fail("--rl.init-run", rl.init_run, "no run directory with checkpoints there; pass a directory "
                    "`ftitan train` wrote")  # fmt: skip
    if rl.sft_steps < 0:
        raise _fail("--rl.sft-steps", rl.sft_steps, "must be >= 0")
    if rl.group_size < 2 and rl.advantage_scale == "std":
        raise _fail("--rl.group-size", rl.group_size, "group-normalized advantages need >= 2 samples per prompt")
    for flag, value in (("--rl.prompts", rl.prompts), ("--rl.max-new-tokens", rl.max_new_tokens),
                        ("--rl.group-size", rl.group_size)):  # fmt: skip
        if value < 1:
            raise _fail(flag, value, "must be >= 1")
    if rl.loss_agg not in RL_AGGS:
        raise _fail("--rl.loss-agg", rl.loss_agg, f"expected one of {RL_AGGS}")
    if rl.advantage_scale not in ("std", "none"):
        raise _fail("--rl.advantage-scale", rl.advantage_scale, "expected 'std' (GRPO) or 'none' (Dr. GRPO)")
    if not 0 <= rl.clip_low < 1 or rl.clip_high < 0:
        raise _fail("--rl.clip-low", rl.clip_low, "clip_low must be in [0, 1) and --rl.clip-high >= 0")
    if rl.kl_coef < 0 or rl.tis_cap < 0:
        raise _fail("--rl.kl-coef", rl.kl_coef, "--rl.kl-coef and --rl.tis-cap must be >= 0")
    if not 0 <= rl.overlong_cache <= rl.max_new_tokens:
        raise _fail("--rl.overlong-cache", rl.overlong_cache, f"must be in [0, --rl.max-new-tokens={rl.max_new_tokens}]")
    if rl.max_offpolicy_steps < 0:
        raise _fail("--rl.max-offpolicy-steps", rl.max_offpolicy_steps, "must be >= 0 (0: synchronous)")
    if rl.generator not in ("native", "vllm"):
        raise _fail("--rl.generator", rl.generator, "expected 'native' (ftitan.infer.generate) or 'vllm' (the "
                    "in-process vLLM engine)")  # fmt: skip
    if rl.compile_generator not in ("", "inductor", "aot_eager", "eager"):
        raise _fail("--rl.compile-generator", rl.compile_generator, "expected 'inductor', 'aot_eager', 'eager' (a "
                    "torch.compile backend for the decode steps) or '' (eager generation)")  # fmt: skip
    if rl.compile_generator and rl.generator != "native":
        raise _fail("--rl.compile-generator", rl.compile_generator, "compiles ftitan.infer.generate's decode steps; "
                    "vLLM compiles its own: drop it with --rl.generator vllm")  # fmt: skip
    if rl.worker not in ("thread", "process"):
        raise _fail("--rl.worker", rl.worker, "expected 'thread' (the async generator in this process) or 'process' "
                    "(a separate one)")  # fmt: skip
    if rl.generator == "vllm" and rl.max_offpolicy_steps and rl.worker != "process":
        raise _fail("--rl.generator", rl.generator, "async rollouts from vLLM run its engine in a generator process: "
                    "add --rl.worker process (or --rl.max-offpolicy-steps 0 for the in-process engine)")  # fmt: skip
    if cfg.parallel.world_size > 1:
        raise _fail("--parallel", "degrees > 1", "ftitan rl runs on one process for now; drop the --parallel.* degrees")
    if cfg.lora.rank:
        raise _fail("--lora.rank", cfg.lora.rank, "ftitan rl trains full weights for now; drop --lora.rank")
    if cfg.data.chat or cfg.data.preference:
        raise _fail("--data.chat", cfg.data.chat or cfg.data.preference, "an RL run's data is its environment "
                    "(--rl.env); drop --data.chat / --data.preference")  # fmt: skip


def _check_fuse_projections(cfg: TrainConfig) -> None:
    """--model.fuse-projections: no tp or ep, an elementwise optimizer, full fine-tuning, no RL (the trainer's tree
    holds wqkv / w13, which the head splits of tensor parallelism, Muon's whole-matrix update, LoRA's targets and
    the generator's weight sync do not read; ep is not tested with it)."""
    if not getattr(cfg.model, "fuse_projections", False):
        return
    flag, why = "--model.fuse-projections", None
    p = cfg.parallel
    if max(p.tp, p.ep) > 1:
        why = ("runs without tensor or expert parallelism (dp, cp and pp run it): tensor parallelism splits q/k/v "
               "by heads; drop it or --parallel.tp/ep")  # fmt: skip
    elif cfg.optim.name.startswith("muon"):
        why = (f"--optim.name {cfg.optim.name} orthogonalizes each matrix, and wqkv / w13 are several; drop it or "
               "use --optim.name adamw")  # fmt: skip
    elif cfg.lora.rank:
        why = "LoRA adapts the separate q/k/v and gate/up projections; drop it or --lora.rank"
    elif cfg.rl.env:
        why = "the RL generator loads the separate projections; drop it for --rl.env runs"
    if why:
        raise _fail(flag, True, why)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check a run; return it unchanged, or raise ``ValueError("--flag=value: fix")``."""
    _check_finite(cfg)
    _check_model(cfg)
    _check_loop(cfg)
    _check_runtime(cfg)
    _check_optim(cfg)
    _check_data(cfg)
    _check_parallel(cfg)
    _check_post_training(cfg)
    _check_rl(cfg)
    _check_fuse_projections(cfg)
    _check_checkpoint(cfg)
    _check_cross(cfg)
    _check_run_dir(cfg)
    return cfg
