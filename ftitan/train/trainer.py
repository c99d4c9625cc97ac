"""The training loop: data -> step -> metrics -> checkpoint, written so a reader sees it.

``train(cfg)`` runs one ``TrainConfig``, composed of the packages that own
each part: the runtime (device, process group, layout: :mod:`ftitan.train.runtime`),
the data pipeline (:mod:`ftitan.data.pipeline`), the model and its optimizer
(:func:`ftitan.optim.from_config`), the pure train step, the metrics sink
(:mod:`ftitan.train.metrics`) and the run directory with its checkpoints
(:class:`ftitan.checkpoint.RunDir`). ``resume=True`` continues from the
newest valid checkpoint and sees exactly the batches an uninterrupted run
would have seen.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ftitan import data, optim, random, tree
from ftitan.checkpoint.run import RunDir, load_run
from ftitan.config.io import config_from_dict, config_to_dict
from ftitan.config.schema import OptimConfig, TrainConfig
from ftitan.data.pipeline import TrainBatches, loader_state_like
from ftitan.models import registry
from ftitan.train import runtime
from ftitan.train.losses import next_token_loss
from ftitan.train.metrics import MetricsSink, Throughput, plot_losses, to_record
from ftitan.train.state import TrainState, init_state

__all__ = ["build_optimizer", "config_from_dict", "config_to_dict", "evaluate", "load_run", "train"]


def build_optimizer(o: OptimConfig, steps: int, params: Any, *, frozen: tuple[str, ...] = ()) -> optim.Transform:
    """Kept for callers of the old name: :func:`ftitan.optim.from_config`."""
    return optim.from_config(o, steps, params, frozen=frozen)


@torch.no_grad()
def evaluate(batch_loss: Callable[[Any, Any], float], params: Any, batches: Iterable[Any]) -> float:
    """Mean of ``batch_loss(params, batch)`` over ``batches`` (held-out rows, in order).

    ``batch_loss(params, batch) -> float``: e.g. ``Runtime.eval_loss`` bound to a loss function
    (MoE: without the balancing term).
    """
    losses = [batch_loss(params, batch) for batch in batches]
    return sum(losses) / len(losses)


def _data(cfg: TrainConfig, rt: runtime.Runtime, run: RunDir) -> data.pipeline.RunData:
    """Rank 0 writes the run directory and prepares the data (tokenizer, token caches); the others read them."""
    if rt.is_main:
        run.create(config_to_dict(cfg))
        prepared = data.pipeline.prepare(cfg, run.path)
    rt.barrier()
    if not rt.is_main:
        prepared = data.pipeline.prepare(cfg, run.path)
    return prepared


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg``; returns the final metrics and where things were written."""
    from tqdm import tqdm

    rt = runtime.setup(cfg.parallel, device=cfg.device)  # device, torchrun world, layout; degrees checked first
    run, cfg_dict = RunDir.of(cfg), config_to_dict(cfg)
    prepared = _data(cfg, rt, run)

    model = registry.model_for(cfg.model)
    full_params = model.init(random.key(cfg.seed))
    opt = optim.from_config(cfg.optim, cfg.steps, full_params, frozen=model.frozen)
    loss_fn = next_token_loss(model)
    step_fn = rt.make_step(model, loss_fn, opt, accum_steps=cfg.accum_steps, compile=cfg.compile,
                           update_buffers=model.update_buffers)  # fmt: skip
    state: TrainState = init_state(rt.place(full_params, model), opt, rng=random.key(cfg.seed))
    # what a checkpoint holds: full tensors (shapes only here; meta allocates nothing)
    full_like = init_state(tree.map(lambda x: x.to("meta"), full_params), opt, rng=random.key(cfg.seed))
    loader, start = loader_state_like(cfg), 0
    if resume and (found := run.resume({"state": full_like, "loader": loader})) is not None:
        restored, start = found  # full tensors: this rank takes its stage and blocks, on its device
        state, loader = rt.from_full(restored["state"], state), restored["loader"]
    batches = TrainBatches(prepared.train, cfg.data.batch_size, state=loader, device=rt.device)
    sink = MetricsSink(run.path, keep_until=start) if rt.is_main else None

    def held_out_loss() -> float:
        evals = batches.eval(prepared.eval, cfg.eval_batches)
        return evaluate(functools.partial(rt.eval_loss, model, loss_fn), state.params, evals)

    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not (progress and rt.is_main),
               unit="step")  # fmt: skip
    last: dict[str, Any] = {}
    speed = Throughput(cfg.data.batch_size * cfg.data.seq_len)
    for i in bar:
        state, m = step_fn(state, rt.local_batch(next(batches)))  # data -> step: nothing waits for the device
        step = i + 1
        speed.step()
        if step % cfg.log_every == 0 or step == cfg.steps:  # record steps alone read metrics back
            last = {"step": step, **to_record(m), "tokens_per_s": speed.read()}
            if sink is not None:
                sink.log(last)
            load = {"load": f"{last['moe.max_load']:.2f}"} if "moe.max_load" in last else {}
            bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}", lr=f"{last['lr']:.1e}",
                            **load)  # fmt: skip
        t_side = time.perf_counter()
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            ev = held_out_loss()
            if sink is not None:
                sink.log({"step": step, "eval_loss": ev})
                bar.write(f"step {step}: held-out loss {ev:.4f}")
        if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps:
            full_state = rt.to_full(state, full_like)  # collective under a layout
            if rt.is_main:
                run.save(step, {"state": full_state, "loader": batches.state}, keep=cfg.keep, cfg_dict=cfg_dict)
            rt.barrier()
        speed.exclude(time.perf_counter() - t_side)  # evaluation and checkpoints are not training time
    bar.close()
    records = sink.records if sink is not None else []
    if sink is not None:
        sink.close()
        plot_losses(records, run.path / "loss.png", f"{cfg.recipe}: {cfg.steps} steps")
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    rt.close()
    return {
        "run_dir": str(run.path),
        "final_loss": last.get("loss", math.nan),
        "eval_loss": evals[-1] if evals else math.nan,
        "records": records,
        "model": model,
        "params": state.params,  # DTensors under a parallel layout
        "tokenizer": prepared.tokenizer,
    }
