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

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ftitan import data, parallel, random
from ftitan.checkpoint.run import RunDir, RunDirError, load_run
from ftitan.config.io import config_from_dict, config_to_dict
from ftitan.config.schema import TrainConfig
from ftitan.data.pipeline import eval_rows, loader_state_like, train_batches
from ftitan.models import lora
from ftitan.train import faults, memory, nonfinite, post, runtime
from ftitan.train.metrics import MetricsSink, Throughput, plot_losses, to_record
from ftitan.train.precision import MixedPrecision
from ftitan.train.state import TrainState, init_state

__all__ = ["config_from_dict", "config_to_dict", "evaluate", "load_run", "train"]


@torch.no_grad()
def evaluate(batch_loss: Callable[[Any, Any], float], params: Any, batches: Iterable[Any]) -> float:
    """Mean of ``batch_loss(params, batch)`` over ``batches`` (held-out rows, in order).

    ``batch_loss(params, batch) -> float``: e.g. ``Runtime.eval_loss`` bound to a loss function
    (MoE: without the balancing term).
    """
    losses = [batch_loss(params, batch) for batch in batches]
    return sum(losses) / len(losses)


def _data(cfg: TrainConfig, rt: runtime.Runtime, run: RunDir, *, resume: bool, overwrite: bool) -> data.pipeline.RunData:
    """Rank 0 writes the run directory and prepares the data (tokenizer, token caches); the others read them.
    A directory holding another run is refused first (``--overwrite``: rank 0 clears it)."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite: pick one (--resume continues the run in --run-dir, --overwrite "
                          "deletes it and starts over)")  # fmt: skip
    # every rank checks (the same files, the same answer) before rank 0 clears or writes anything
    stale = overwrite or run.check_reuse(config_to_dict(cfg), resume=resume)
    rt.barrier()
    if stale and rt.is_main:
        removed = run.clear()
        if removed and not overwrite:
            warnings.warn(f"{run.path}: held a run with another model or data and no checkpoint yet; its "
                          f"{', '.join(removed)} were deleted, to be made again for this run", stacklevel=2)
    if rt.is_main:
        run.create(config_to_dict(cfg))
        prepared = data.pipeline.prepare(cfg, run.path)
    rt.barrier()
    if not rt.is_main:
        prepared = data.pipeline.prepare(cfg, run.path, write=False)
    return prepared


def _initial_params(cfg: TrainConfig, rt: runtime.Runtime, model: Any) -> Any:
    """Each rank materializes only its own blocks, on its device: drawn from the seed, or read from
    ``--init.hf`` (with ``--lora.rank``: the checkpoint's weights as the frozen base, adapters drawn
    from the seed)."""
    key = random.key(cfg.seed)
    if not cfg.init.hf:
        return rt.init_params(model, key)
    if not cfg.lora.rank:
        return rt.load_hf(model, cfg.init.hf)
    base = rt.load_hf(post.base_model_of(cfg), cfg.init.hf)
    if rt.layout is None:
        return lora.add_adapters(model.config, base, key)
    # the adapters are small: drawn whole on each rank (around the base's shapes), then each keeps its blocks
    drawn = lora.add_adapters(model.config, post.base_model_of(cfg).init(key, device="meta"), key, device=rt.device)
    lora_axes = model.param_axes["lora"]
    return {"base": base, "lora": parallel.shard_params(drawn["lora"], lora_axes, rt.layout.rules, rt.layout)}


def _task_evaluator(cfg: TrainConfig, rt: runtime.Runtime, model: Any,
                    prepared: data.pipeline.RunData) -> Callable[[Any], dict[str, float]] | None:  # fmt: skip
    """With ``--data.chat task:NAME`` on one process: ``params -> {"eval.exact_match", "eval.parse_rate"}``
    of greedy answers to ``--data.task-eval-items`` held-out questions (``ftitan.train.exact_match``)."""
    if not cfg.data.chat.startswith(data.sft.TASK_PREFIX) or not cfg.data.task_eval_items or rt.layout is not None:
        return None
    from ftitan.data import tasks
    from ftitan.train.exact_match import exact_match_eval

    name = cfg.data.chat.removeprefix(data.sft.TASK_PREFIX)
    items = tasks.task_items(cfg.data.task_eval_items, seed=cfg.seed, split="eval", task=name)
    tok, template = prepared.tokenizer, prepared.template

    def answer_tokens(item: dict[str, Any]) -> int:  # the reference answer with its end marker
        whole = template.render(item["messages"])
        prompt = template.render(item["messages"][:-1], add_generation_prompt=True)
        return len(tok.encode(whole)) - len(tok.encode(prompt))

    longest = max(answer_tokens(it) for it in items) + 4  # and a few tokens more

    def score(params: Any) -> dict[str, float]:
        scores = exact_match_eval(model, params, tok, template, items, max_new_tokens=longest, batch_size=50)
        return {f"eval.{k}": v for k, v in scores.items()}

    return score


@contextlib.contextmanager
def _determinism(on: bool) -> Iterator[None]:
    """``torch.use_deterministic_algorithms`` for the run (warn-only: an op without a deterministic kernel
    warns instead of failing), as the process had it again after. Without it the inductor-compiled step
    on CPU is not reproducible: reruns' losses differ in the 7th digit from step ~20 on (measured; eager
    runs were bit-identical either way)."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if on:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


@faults.reports_peer_failures  # under torchrun: a dead or hung peer ends this rank with one line, not a hang
def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg``; returns the final metrics and where things were written (see :func:`_train`).
    With ``cfg.deterministic`` (the default) a rerun gives bit-identical losses, compiled or not."""
    with _determinism(cfg.deterministic):
        return _train(cfg, resume=resume, overwrite=overwrite, progress=progress)


def _train(cfg: TrainConfig, *, resume: bool, overwrite: bool, progress: bool) -> dict[str, Any]:
    """Run ``cfg``; returns the final metrics and where things were written.

    ``resume``: continue the run in ``cfg.run_dir`` from its newest valid checkpoint (a directory
    without one starts at step 0). ``overwrite``: delete the run there first. A directory holding
    another run (other model or data, or checkpoints without ``resume``) is refused
    (:class:`ftitan.checkpoint.RunDirError`)."""
    from tqdm import tqdm

    # device, torchrun world, layout (degrees checked first); on the CPU the host memory a step frees is kept
    rt = runtime.setup(cfg.parallel, device=cfg.device, malloc_retain=cfg.malloc_retain,
                       gemm_library=cfg.gemm_library)
    memory.check_fits(cfg, rt.device)  # params + grads + optimizer state, from meta shapes: before any work
    run, cfg_dict = RunDir.of(cfg), config_to_dict(cfg)
    prepared = _data(cfg, rt, run, resume=resume, overwrite=overwrite)

    model = post.model_of(cfg)  # the family's model; with --lora.rank, with adapters (only they are trained)
    rt.use_placement(cfg.flexshard.placement, model)  # FlexShard's storage of the weights over dp_shard
    shapes = model.init(random.key(cfg.seed), device="meta")  # the whole model's shapes; allocates nothing
    opt, trainable = post.optimizer_of(cfg, model, shapes, rt.layout), post.trainable_of(cfg)
    loss_fn = post.loss_of(cfg, model)  # next-token loss (pretraining, SFT), or DPO
    mp = cfg.mixed_precision
    precision = MixedPrecision.from_names(mp.param, mp.compute, mp.reduce).for_model(model)
    step_fn = rt.make_step(model, loss_fn, opt, accum_steps=cfg.accum_steps, compile=cfg.compile,
                           update_buffers=model.update_buffers, precision=precision, trainable=trainable,
                           buckets=cfg.flexshard.buckets, quantize=cfg.flexshard.quantize or None,
                           **runtime.step_options(cfg.model))  # fmt: skip
    params = _initial_params(cfg, rt, model)
    reference = post.reference_of(cfg, model, params, lambda: _initial_params(cfg, rt, model))  # DPO only
    state: TrainState = init_state(params, opt, rng=random.key(cfg.seed), trainable=trainable)
    whole = init_state(shapes, opt, rng=random.key(cfg.seed), trainable=trainable)  # what a checkpoint holds (meta)
    loader, start = loader_state_like(cfg), 0
    if rt.is_main:
        run.remove_unfinished()  # temp dirs of saves a killed run cut short
    if resume and (found := run.resume({"state": state, "loader": loader}, whole={"state": whole, "loader": loader},
                                       into=True)):  # fmt: skip
        restored, start = found  # each rank read only its stage's blocks, whatever layout saved them, into its state
        state, loader = restored["state"], restored["loader"]
    if start > cfg.steps:
        raise RunDirError(f"--steps={cfg.steps}: the run in {run.path} is already at step {start}; pass --steps "
                          f"above {start} to train further (or --overwrite to start over)")  # fmt: skip
    batches = train_batches(prepared, cfg, loader, device=rt.device, data_rank=rt.data_rank())
    evals = eval_rows(prepared, cfg, device=rt.device, data_rank=rt.data_rank())
    if reference is not None:  # held-out pairs: their reference log-probs once
        evals = [reference(b) for b in evals]
    sink = MetricsSink(run.path, keep_until=start) if rt.is_main else None
    if sink is not None and prepared.stats and start == 0:  # SFT data: conversations, truncated, packing fill
        sink.log({"step": 0, **prepared.stats})
    if rt.is_main and prepared.stats.get("data.truncated"):
        warnings.warn(f"--data.truncate: {prepared.stats['data.truncated']:.0f} conversations were cut to "
                      f"--data.seq-len + 1 = {cfg.data.seq_len + 1} tokens", stacklevel=2)  # fmt: skip

    def held_out_loss() -> float:
        # in the compute dtype the step trains in
        batch_loss = functools.partial(rt.eval_loss, model, loss_fn, rows_local=batches.rows_local, precision=precision)
        return evaluate(batch_loss, state.params, evals)

    task_eval = _task_evaluator(cfg, rt, model, prepared)
    if task_eval is not None and sink is not None and start == 0:  # the untrained model's score, to compare
        sink.log({"step": 0, **task_eval(state.params)})
    saver = run.checkpointer(cfg.checkpoint, keep=cfg.keep, cfg_dict=cfg_dict)  # every rank: its own writer
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not (progress and rt.is_main),
               unit="step")  # fmt: skip
    last: dict[str, Any] = {}
    speed = Throughput(cfg.data.batch_size * cfg.data.seq_len)
    try:
        for i in bar:
            batch = rt.local_batch(next(batches), rows_local=batches.rows_local)
            if reference is not None:  # DPO: the frozen reference's log-probs of this batch
                batch = reference(batch)
            state, m = step_fn(state, batch)  # data -> step: nothing waits for the device
            step = i + 1
            speed.step()
            if (cfg.log_every and step % cfg.log_every == 0) or step == cfg.steps:  # only record steps read back
                last = {"step": step, **to_record(m), "tokens_per_s": speed.read()}
                guard = nonfinite.read(state)  # the non-finite guard's counters, read back with the metrics
                last.update(guard.metrics())
                if sink is not None:
                    sink.log(last)
                load = {"load": f"{last['moe.max_load']:.2f}"} if "moe.max_load" in last else {}
                bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}",
                                lr=f"{last['lr']:.1e}", **load)  # fmt: skip
                guard.check(cfg.optim, step=step, run_dir=run, settle=saver.wait)  # halted: stop, naming it
            t_side = time.perf_counter()
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                record = {"step": step, "eval_loss": held_out_loss()}
                if task_eval is not None:  # --data.chat task:NAME: greedy answers to held-out questions
                    record.update(task_eval(state.params))
                if sink is not None:
                    sink.log(record)
                    scores = "".join(f", {k.removeprefix('eval.')} {v:.3f}" for k, v in record.items()
                                     if k.startswith("eval."))  # fmt: skip
                    bar.write(f"step {step}: held-out loss {record['eval_loss']:.4f}{scores}")
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps:
                # never checkpoint a non-finite state: a halted guard or a NaN param stops the run (one read back)
                nonfinite.read(state, params=True).check(cfg.optim, step=step, run_dir=run, settle=saver.wait)
                loader = batches.global_state(rt.gather_by_data_rank)  # every rank's rows' position: collective
                saver.save(step, {"state": state, "loader": loader})  # each rank its blocks; blocks while staging
            speed.exclude(time.perf_counter() - t_side)  # evaluation and checkpoints are not training time
        bar.close()
        saver.close()  # every rank's last save committed before train returns
    except BaseException:
        saver.abort()  # a dead peer must not keep this rank waiting on its save
        raise
    batches.close()
    records = sink.records if sink is not None else []
    if sink is not None:
        sink.close()
        plot_losses(records, run.path / "loss.png", f"{cfg.recipe}: {cfg.steps} steps")
    held_out = [r["eval_loss"] for r in records if "eval_loss" in r]
    rt.close()
    return {
        "run_dir": str(run.path),
        "start_step": start,  # where this call began: the resumed checkpoint's step, else 0
        # a resumed run that had nothing left to do reports what its metrics recorded
        "final_loss": last.get("loss", next((r["loss"] for r in reversed(records) if "loss" in r), math.nan)),
        "eval_loss": held_out[-1] if held_out else math.nan,
        "records": records,
        "model": model,
        "params": state.params,  # DTensors under a parallel layout
        "tokenizer": prepared.tokenizer,
    }
