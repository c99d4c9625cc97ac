"""``ftitan`` / ``python -m ftitan``: the command line.

    ftitan train --recipe NAME [--resume | --overwrite] [--model.n-layers 4 --optim.lr 1e-3 ...]
    ftitan rl --recipe grpo-arith [--resume | --overwrite] [--rl.max-offpolicy-steps 1 ...]
    ftitan generate --run DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P --seed S --n N]
    ftitan convert --run DIR --hf OUT          (a run's newest checkpoint -> an HF model directory)
    ftitan convert --hf DIR --run OUT          (an HF model directory -> a run directory at step 0)
    ftitan bench step [--out FILE ...]
    ftitan bench parallel [--nproc 4 --layouts dp_shard=4 dp_shard=2,tp=2 ... --out FILE]
    ftitan bench generate [--peers ... --batches 1 8 --out FILE]
    ftitan bench checkpoint [--state-mib 1024 --rounds 5 --out FILE]
    ftitan bench rl [--recipe llama3-debug --rl-steps 12 --out FILE]
    ftitan bench flexshard [--nproc 4 --rounds 5 --out FILE]
    ftitan bench attention [--seq-lens 256 1024 2048 --out FILE]
    ftitan bench remat [--policies none full save-matmuls ... --out FILE]
    ftitan bench compile [--n-layers 16 --rounds 5 --out FILE]
    ftitan bench kernels [--kernels rms_norm rope ... --out FILE]    (CUDA; --quick on CPU under TRITON_INTERPRET=1)
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import tyro

USAGE = """usage:
  ftitan train --recipe NAME [--resume | --overwrite] [dotted overrides]         (ftitan train --help)
  ftitan rl --recipe NAME [--resume | --overwrite] [dotted overrides]            (ftitan rl --help)
  ftitan generate --run DIR --prompt TEXT [options]                                (ftitan generate --help)
  ftitan convert --run DIR --hf OUT | --hf DIR --run OUT                           (ftitan convert --help)
  ftitan bench step [options]                                                      (ftitan bench step --help)
  ftitan bench parallel [options]                                                  (ftitan bench parallel --help)
  ftitan bench generate [options]                                                  (ftitan bench generate --help)
  ftitan bench checkpoint [options]                                                (ftitan bench checkpoint --help)
  ftitan bench rl [options]                                                        (ftitan bench rl --help)
  ftitan bench flexshard [options]                                                 (ftitan bench flexshard --help)
  ftitan bench attention [options]                                                 (ftitan bench attention --help)
  ftitan bench remat [options]                                                     (ftitan bench remat --help)
  ftitan bench compile [options]                                                   (ftitan bench compile --help)
  ftitan bench kernels [options]                                                   (ftitan bench kernels --help)"""


@attrs.frozen(kw_only=True)
class GenerateOptions:
    """Sample text from a trained run (its newest valid checkpoint)."""

    run: Path
    """The run directory a `ftitan train` wrote (runs/<recipe> by default)."""
    prompt: str = "def "
    """Text to continue."""
    max_new_tokens: int = 64
    """Tokens to generate per sample."""
    temperature: float = 0.8
    """0 is greedy."""
    top_k: int = 50
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 0.95
    """Keep the smallest set of tokens with this much probability."""
    seed: int = 0
    """Sampling seed: the same seed gives the same samples."""
    n: int = 1
    """Number of samples."""
    device: str = "auto"
    """Where the params, KV cache and sampling live: "auto" (CUDA when available), "cpu" or "cuda"."""


@attrs.frozen(kw_only=True)
class ConvertOptions:
    """Convert between a run directory and an HF model directory; the direction follows which exists."""

    run: Path
    """The run directory: read when it exists (-> --hf), else written (<- --hf)."""
    hf: Path
    """The HF model directory (config.json + safetensors): read when --run does not exist, else written."""


def user_error(err: BaseException) -> bool:
    """Whether ``err`` is for the user to fix (a setting, a file, a checkpoint, the machine's memory): the CLI
    prints it as one line and exits with 2. Anything else is a bug in ftitan and keeps its traceback, as does
    every error under ``FTITAN_TRACEBACK=1``."""
    if os.environ.get("FTITAN_TRACEBACK", "") not in ("", "0"):
        return False
    from ftitan.checkpoint import CheckpointError
    from ftitan.train.memory import is_out_of_memory

    kinds: list[type[BaseException]] = [ValueError, FileNotFoundError, FileExistsError, PermissionError,
                                        IsADirectoryError, NotADirectoryError, CheckpointError]  # fmt: skip
    try:
        from ftitan.train import faults

        kinds += [t for t in (getattr(faults, "RunFailure", None),) if t is not None]
    except ImportError:
        pass
    return isinstance(err, tuple(kinds)) or is_out_of_memory(err)


def _report(prog: str, err: BaseException, cfg: object = None) -> int:
    """Print ``{prog}: error: <one line>`` to stderr (under torchrun, with this rank); return exit status 2."""
    from ftitan.train.memory import is_out_of_memory, out_of_memory_message

    msg = out_of_memory_message(err, cfg) if is_out_of_memory(err) else str(err)  # type: ignore[arg-type]
    rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"{prog}: error: {rank}{' '.join(msg.split())}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def _one_line_warnings(prog: str) -> Iterator[None]:
    """ftitan's own warnings print as ``{prog}: warning: <message>``; others keep Python's form."""
    package, default = str(Path(__file__).parent), warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if not filename.startswith(package):
            return default(message, category, filename, lineno, file, line)
        print(f"{prog}: warning: {' '.join(str(message).split())}", file=sys.stderr if file is None else file)

    with warnings.catch_warnings():  # restores showwarning after
        warnings.showwarning = show
        yield


def convert_main(argv: list[str]) -> int:
    from ftitan.checkpoint.convert import hf_to_run, run_to_hf

    opts = tyro.cli(ConvertOptions, args=argv, prog="ftitan convert")
    try:
        if (opts.run / "config.json").exists():
            if (opts.hf / "config.json").exists():
                raise ValueError(f"--hf {opts.hf} already holds a model; pass a new directory to write to")
            out = run_to_hf(opts.run, opts.hf)
            print(f"wrote {out} (HF: config.json, model.safetensors, tokenizer files) from run {opts.run}")
        elif (opts.hf / "config.json").exists():
            out = hf_to_run(opts.hf, opts.run)
            print(f"wrote run directory {out} (step 0) from {opts.hf}")
        else:
            raise FileNotFoundError(f"neither --run {opts.run} (a `ftitan train` run directory) nor --hf {opts.hf} "
                                    "(an HF model directory) holds a config.json; pass the one to convert from")  # fmt: skip
    except Exception as e:
        if not user_error(e):
            raise
        return _report("ftitan convert", e)
    return 0


def train_main(argv: list[str]) -> int:
    from ftitan.config import parse_train_args
    from ftitan.train.trainer import train

    resume, overwrite = "--resume" in argv, "--overwrite" in argv
    cfg = None
    try:
        cfg = parse_train_args([a for a in argv if a not in ("--resume", "--overwrite")], prog="ftitan train")
        out = train(cfg, resume=resume, overwrite=overwrite)
    except Exception as e:  # a bad setting, file or machine: one line naming it and the fix, no traceback
        if not user_error(e):
            raise
        return _report("ftitan train", e, cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 reports
        return 0
    print(f"done: {cfg.steps} steps, final train loss {out['final_loss']:.4f}, held-out loss {out['eval_loss']:.4f}")
    print(f"run directory: {out['run_dir']} (loss.png, metrics.jsonl, tensorboard/, checkpoints/)")
    return 0


def rl_main(argv: list[str]) -> int:
    from ftitan.config import parse_train_args
    from ftitan.rl.loop import rl_train

    resume, overwrite = "--resume" in argv, "--overwrite" in argv
    cfg = None
    try:
        cfg = parse_train_args([a for a in argv if a not in ("--resume", "--overwrite")], prog="ftitan rl", rl=True)
        out = rl_train(cfg, resume=resume, overwrite=overwrite)
    except Exception as e:  # a bad setting, file or machine: one line naming it and the fix, no traceback
        if not user_error(e):
            raise
        return _report("ftitan rl", e, cfg)
    rewards = [r["reward"] for r in out["records"] if "reward" in r]
    held = [r["eval.reward"] for r in out["records"] if "eval.reward" in r]
    first, last = rewards[:10], rewards[-10:]
    print(f"done: {cfg.steps} RL steps, mean reward {sum(first) / max(len(first), 1):.3f} over the first "
          f"{len(first)} and {sum(last) / max(len(last), 1):.3f} over the last {len(last)}"
          + (f", held-out reward {held[0]:.3f} -> {held[-1]:.3f}" if held else ""))  # fmt: skip
    print(f"run directory: {out['run_dir']} (reward.png, metrics.jsonl, tensorboard/, checkpoints/, sft/)")
    return 0


def generate_main(argv: list[str]) -> int:
    from ftitan import random
    from ftitan.infer import Sampling, generate
    from ftitan.train.trainer import load_run

    opts = tyro.cli(GenerateOptions, args=argv, prog="ftitan generate")
    try:
        from ftitan.train.runtime import resolve_device

        _cfg, model, params, tok, step = load_run(opts.run, device=resolve_device(opts.device))
        if tok is None:
            raise ValueError(f"{opts.run} has no tokenizer.json (an HF import without tokenizer files); copy the "
                             "model's tokenizer.json and tokenizer_config.json into it")  # fmt: skip
        sampling = Sampling(temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p)
        prompt = tok.encode(opts.prompt)
        # the n samples are one batch (KV cache, one decode step per token); sample i draws from fold_in(key, i)
        outs = generate(model, params, [prompt] * opts.n, max_new_tokens=opts.max_new_tokens, sampling=sampling,
                        key=random.key(opts.seed), eos_id=tok.eos_id)  # fmt: skip
    except Exception as e:
        if not user_error(e):
            raise
        return _report("ftitan generate", e)
    print(f"# {opts.run} at step {step}")
    for i, new in enumerate(outs):
        print(f"--- sample {i}\n{tok.decode(prompt + new)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with _one_line_warnings(" ".join(["ftitan", *argv[:1]])):
        return _dispatch(argv)


# ``ftitan bench NAME``: the module ftitan.bench.NAME, whose ``main(argv)`` runs it
BENCHES = ("step", "parallel", "generate", "checkpoint", "flexshard", "attention", "remat", "kernels", "compile", "rl")


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["train"]:
        return train_main(argv[1:])
    if argv[:1] == ["rl"]:
        return rl_main(argv[1:])
    if argv[:1] == ["generate"]:
        return generate_main(argv[1:])
    if argv[:1] == ["convert"]:
        return convert_main(argv[1:])
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHES:  # each module's main(argv)
        return importlib.import_module(f"ftitan.bench.{argv[1]}").main(argv[2:])
    print(USAGE, file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


def _exit(rc: int) -> None:
    """Exit with ``rc``; a rank that ``torchrun`` launched (``TORCHELASTIC_RUN_ID`` set) and that ran a
    ``ftitan train`` / ``ftitan rl`` to a successful end (rc 0) leaves through ``ftitan.parallel.end_rank``:
    no interpreter finalization, in which gloo's threads could abort a finished run (its files are closed
    by then: the trainer joins its checkpoint writes, closes its metrics and leaves the process group).
    Anything else, a failed run included: ``sys.exit``."""
    if rc == 0 and "TORCHELASTIC_RUN_ID" in os.environ and sys.argv[1:2] in (["train"], ["rl"]):
        import logging

        from ftitan import parallel

        logging.shutdown()
        parallel.end_rank(rc)
    sys.exit(rc)


if __name__ == "__main__":
    _exit(main())
