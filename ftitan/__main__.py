"""``ftitan`` / ``python -m ftitan``: the command line.

    ftitan train --recipe NAME [--resume] [--model.n-layers 4 --optim.lr 1e-3 ...]
    ftitan generate --run DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P --seed S --n N]
    ftitan convert --run DIR --hf OUT          (a run's newest checkpoint -> an HF model directory)
    ftitan convert --hf DIR --run OUT          (an HF model directory -> a run directory at step 0)
    ftitan bench step [--out FILE ...]
    ftitan bench parallel [--nproc 4 --layouts dp_shard=4 dp_shard=2,tp=2 ... --out FILE]
    ftitan bench generate [--peers ... --batches 1 8 --out FILE]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import attrs
import tyro

USAGE = """usage:
  ftitan train --recipe NAME [--resume] [dotted overrides, e.g. --optim.lr 1e-3]   (ftitan train --help)
  ftitan generate --run DIR --prompt TEXT [options]                                (ftitan generate --help)
  ftitan convert --run DIR --hf OUT | --hf DIR --run OUT                           (ftitan convert --help)
  ftitan bench step [options]                                                      (ftitan bench step --help)
  ftitan bench parallel [options]                                                  (ftitan bench parallel --help)
  ftitan bench generate [options]                                                  (ftitan bench generate --help)"""


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
    except (FileNotFoundError, ValueError) as e:
        print(f"ftitan convert: error: {e}", file=sys.stderr)
        return 2
    return 0


def train_main(argv: list[str]) -> int:
    from ftitan.config import parse_train_args
    from ftitan.train.trainer import train

    resume = "--resume" in argv
    try:
        cfg = parse_train_args([a for a in argv if a != "--resume"], prog="ftitan train")
    except ValueError as e:  # a bad setting: say which flag and how to fix it, no traceback
        print(f"ftitan train: error: {e}", file=sys.stderr)
        return 2
    out = train(cfg, resume=resume)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 reports
        return 0
    print(f"done: {cfg.steps} steps, final train loss {out['final_loss']:.4f}, held-out loss {out['eval_loss']:.4f}")
    print(f"run directory: {out['run_dir']} (loss.png, metrics.jsonl, tensorboard/, checkpoints/)")
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
    except (FileNotFoundError, ValueError) as e:
        print(f"ftitan generate: error: {e}", file=sys.stderr)
        return 2
    print(f"# {opts.run} at step {step}")
    for i, new in enumerate(outs):
        print(f"--- sample {i}\n{tok.decode(prompt + new)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        return train_main(argv[1:])
    if argv[:1] == ["generate"]:
        return generate_main(argv[1:])
    if argv[:1] == ["convert"]:
        return convert_main(argv[1:])
    if argv[:2] == ["bench", "step"]:
        from ftitan.bench.step import main as bench_step

        return bench_step(argv[2:])
    if argv[:2] == ["bench", "parallel"]:
        from ftitan.bench.parallel import main as bench_parallel

        return bench_parallel(argv[2:])
    if argv[:2] == ["bench", "generate"]:
        from ftitan.bench.generate import main as bench_generate

        return bench_generate(argv[2:])
    print(USAGE, file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
