"""The RL loop behind ``ftitan rl``: rollouts -> advantages -> ``make_train_step``, with checkpoints.

``rl_train(cfg)`` runs one ``TrainConfig`` whose ``rl.env`` names an environment (:data:`ftitan.rl.ENVS`).
Each step is function composition over the run's one pure model::

    ro = collect(step, params)                     # P prompts x G samples (or tool episodes), scored
    batch = {**ro.batch, "advantages": group_advantages(ro.rewards, G)}   # + ref_logp, old_logp
    state, metrics = rl_step(state, batch)         # make_train_step(grpo_loss_fn(model, ...), optimizer)

- The policy starts from another run's checkpoint (``--rl.init-run``: e.g. a ``sft-debug`` run), or
  else from an SFT stage on the environment's demonstrations (``--rl.sft-steps``: an ordinary
  ``ftitan train`` run in ``RUN_DIR/sft``), with that run's tokenizer and chat template.
- Synchronous (``--rl.max-offpolicy-steps 0``): step ``n`` samples from the params after ``n`` updates;
  the ratio is 1 at the update and the generator/trainer mismatch is corrected by truncated importance
  sampling (``--rl.tis-cap``). Everything a step draws (prompts, samples) is a function of
  ``(seed, step)``, so a resumed run is bit-identical to an uninterrupted one.
- Asynchronous (``k >= 1``): a generator thread samples the next batches while the trainer trains
  (:class:`ftitan.rl.asynchronous.AsyncRollouts`); ratios use the generator's log-probs, the trained
  params are pushed to it after each step, batches more than ``k`` steps stale are dropped and counted,
  and no rollout is trained on twice or lost (its ids are accounted for).
- Every step logs reward mean/std, response length, clip fraction, entropy, the generator/trainer
  mismatch KL and tokens/s of generation and of training to ``metrics.jsonl`` / TensorBoard; each
  evaluation answers held-out prompts greedily (``eval.reward``); ``reward.png`` at the end.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from ftitan import random, tree
from ftitan.checkpoint.run import RunDir, RunDirError, load_run
from ftitan.config.io import config_to_dict
from ftitan.config.schema import OptimConfig, RLConfig, TrainConfig
from ftitan.data.chat import ChatTemplate, load_chat_template
from ftitan.infer import generate
from ftitan.rl.asynchronous import AsyncRollouts, Ledger, ProcessRollouts
from ftitan.rl.envs import ENVS, ToolEnv, demonstrations
from ftitan.rl.losses import group_advantages, grpo_loss_fn, keep_informative_groups, overlong_penalty
from ftitan.rl.rollout import Rollouts, episode_rollout, rollout, vllm_generate_fn
from ftitan.train import faults, nonfinite, post, runtime
from ftitan.train.losses import IGNORE_INDEX
from ftitan.train.metrics import MetricsSink, plot_rewards, to_record
from ftitan.train.precision import MixedPrecision
from ftitan.train.state import init_state

__all__ = ["Policy", "batch_spec", "collect", "rl_state_like", "rl_train", "sft_stage_config"]

SFT_DIR = "sft"  # the SFT stage's run directory, inside the RL run's
DEMOS = "demos.jsonl"  # the SFT stage's conversations, in SFT_DIR


class Policy:
    """The warm start: model, params, tokenizer and chat template."""

    def __init__(self, model: Any, params: Any, tokenizer: Any, template: ChatTemplate) -> None:
        self.model, self.params, self.tokenizer, self.template = model, params, tokenizer, template
        self.generate_fn: Callable[..., Any] = generate  # the generator: native, or vLLM (rollout.vllm_generate_fn)
        self.source: Path | None = None  # the run directory it was loaded from


def sft_stage_config(cfg: TrainConfig, run: Path) -> TrainConfig:
    """The SFT stage of an RL run: ``ftitan train`` on ``rl.env``'s demonstrations (``RUN/sft/demos.jsonl``),
    ``rl.sft_steps`` steps of AdamW at ``rl.sft_lr`` (warmup a tenth, cosine), into ``RUN/sft``."""
    n = cfg.rl.sft_steps
    return attrs.evolve(
        cfg, recipe=f"{cfg.recipe}/sft", rl=RLConfig(), run_dir=str(run / SFT_DIR), steps=n,
        data=attrs.evolve(cfg.data, chat=str(run / SFT_DIR / DEMOS), task_eval_items=0),
        optim=OptimConfig(name="adamw", lr=cfg.rl.sft_lr, warmup=max(1, n // 10), schedule="cosine", weight_decay=0.1),
        eval_every=0, ckpt_every=n, log_every=min(10, n), eval_batches=2,
    )  # fmt: skip


def _copy_run_files(src: Path, dst: Path) -> None:
    """The tokenizer and chat template of the warm start, so that ``ftitan generate --run`` reads this run."""
    from ftitan.checkpoint.convert import TOKENIZER_FILES

    for name in (*TOKENIZER_FILES, "tokenizer_size.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _warm_start(cfg: TrainConfig, run: Path, device: torch.device, *, progress: bool) -> Policy:
    """The policy RL starts from: the SFT stage's result (run first, or resumed), or ``--rl.init-run``'s."""
    if not cfg.rl.init_run:
        from ftitan.train.trainer import train

        src = run / SFT_DIR
        src.mkdir(parents=True, exist_ok=True)
        demos = src / DEMOS
        if not demos.is_file():  # the env's demonstrations: made once, deterministic in the seed
            tmp = demos.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps({"messages": list(m)}) + "\n"
                                   for m in demonstrations(ENVS[cfg.rl.env], 4000, seed=cfg.seed)))  # fmt: skip
            tmp.replace(demos)
        train(sft_stage_config(cfg, run), resume=True, progress=progress)  # a finished stage loads, nothing more
    else:
        src = Path(cfg.rl.init_run)
    _copy_run_files(src, run)
    return _load_policy(cfg, src, device)


def _load_policy(cfg: TrainConfig, src: Path, device: torch.device) -> Policy:
    """The policy in run directory ``src``'s newest checkpoint, its model in ``rl.batch_invariant`` mode
    when asked, its generator compiled under ``rl.compile_generator`` (the trainer's and a generator
    process's: the same)."""
    saved, model, params, tok, _ = load_run(src, device=device)
    if saved.model != cfg.model:
        raise ValueError(f"--rl.init-run {src}: its model differs from this run's --model.* (e.g. n_layers "
                         f"{saved.model.n_layers} vs {cfg.model.n_layers}); pass that run's model flags or a recipe "
                         f"with its model")  # fmt: skip
    if tok is None:
        raise ValueError(f"--rl.init-run {src}: has no tokenizer.json; RL needs the warm start's tokenizer")
    if saved.lora.rank:
        raise ValueError(f"--rl.init-run {src}: a LoRA run; RL trains full weights for now: merge it first "
                         f"(ftitan convert --run {src} --hf OUT, then --rl.init-run from a run of OUT)")  # fmt: skip
    if cfg.rl.batch_invariant:  # generator and trainer both run the invariant ops: their log-probs agree bit for bit
        from ftitan.config.transforms import batch_invariant
        from ftitan.models import registry

        model = registry.model_for(batch_invariant(model.config))
    policy = Policy(model, params, tok, load_chat_template(src))
    policy.source = src
    if cfg.rl.compile_generator:  # decode steps compiled once per batch size and slot bucket, then reused
        backend = cfg.rl.compile_generator
        policy.generate_fn = functools.partial(generate, compile=True if backend == "inductor" else backend)
    return policy


def _vllm_generator(cfg: TrainConfig, policy: Policy) -> Any:
    """The in-process vLLM engine on ``policy``'s pure model (its weights pushed before each batch), made
    ``policy``'s generator; returns the engine (``ftitan.vllm.close`` it)."""
    from ftitan import vllm as fv

    llm = fv.engine((policy.model, policy.params), dtype="float32", max_model_len=cfg.data.seq_len + 1,
                    kv_cache_bytes=64 << 20)  # fmt: skip
    policy.generate_fn = vllm_generate_fn(llm)
    return llm


def _process_make(cfg: TrainConfig, src: str, device: str) -> Callable[[Any, int], dict[str, torch.Tensor]]:
    """In a generator process (``--rl.worker process``): the policy rebuilt from the warm start's run
    directory, and :func:`collect` over it (with its own vLLM engine under ``--rl.generator vllm``)."""
    policy = _load_policy(cfg, Path(src), torch.device(device))
    if cfg.rl.generator != "vllm":
        return functools.partial(collect, cfg, policy, seed=cfg.seed)
    import atexit

    from ftitan import vllm as fv

    llm = _vllm_generator(cfg, policy)
    atexit.register(fv.close, llm)

    def make(params: Any, index: int) -> dict[str, torch.Tensor]:
        fv.push_weights(llm, params)
        return collect(cfg, policy, params, index, seed=cfg.seed)

    return make


def _pad_rows(batch: dict[str, torch.Tensor], width: int, rows: int) -> dict[str, torch.Tensor]:
    """``batch``'s (N, T) fields right-padded to ``(rows, width)`` (padding rows train nothing), (N,) fields
    to ``rows``: one shape every step, so the compiled step compiles once."""
    out = {}
    for k, v in batch.items():
        fill = IGNORE_INDEX if k == "targets" else -1 if k == "ids" else 0
        full = torch.full((rows, *((width,) if v.dim() == 2 else ())), fill, dtype=v.dtype)
        if v.dim() == 2:
            if v.shape[1] > width:
                raise ValueError(f"a rollout of {v.shape[1] + 1} tokens does not fit --data.seq-len {width}: raise "
                                 f"--data.seq-len or lower --rl.max-new-tokens")  # fmt: skip
            full[: v.shape[0], : v.shape[1]] = v
        else:
            full[: v.shape[0]] = v
        out[k] = full
    return out


def collect(cfg: TrainConfig, policy: Policy, params: Any, index: int, *, seed: int) -> dict[str, torch.Tensor]:
    """Batch ``index`` of a run: ``rl.prompts`` prompts x ``rl.group_size`` samples from ``params``, scored, with
    group advantages, as fixed-shape rows (``(P * G, seq_len)``), plus its statistics as 0-d tensors.

    Prompts and samples are functions of ``(seed, index, round)``; with ``rl.dynamic_sampling`` groups whose
    rewards are all equal are dropped and up to ``rl.max_refills`` more rounds sample new prompts to refill
    the batch (rows left empty train nothing). Sample ids are ``index * P * G * (max_refills + 1) + ...``:
    unique across the run."""
    rl, env = cfg.rl, ENVS[cfg.rl.env]
    g, p = rl.group_size, rl.prompts
    per_round = p * g
    kept: list[Rollouts] = []
    n_groups, rounds, t0, made = 0, 0, time.perf_counter(), 0
    rewards_all = []
    for rounds in range(rl.max_refills + 1 if rl.dynamic_sampling else 1):
        prompts = env.prompts(p, seed=seed * 1_000_003 + index * 101 + rounds, split="train")
        key = random.fold_in(random.fold_in(random.key(seed), index), rounds)
        first = (index * (rl.max_refills + 1) + rounds) * per_round
        ro = _sample(cfg, policy, params, prompts, key=key, group_size=g, first_id=first)
        made += int(ro.lengths.sum())
        rewards = ro.rewards
        if rl.overlong_cache:
            rewards = rewards + overlong_penalty(ro.lengths, max_len=rl.max_new_tokens, cache=rl.overlong_cache)
        rewards_all.append(rewards)
        keep = keep_informative_groups(rewards, g) if rl.dynamic_sampling else torch.ones(p, dtype=torch.bool)
        take = keep.repeat_interleave(g).nonzero().flatten()[: (p - n_groups) * g]  # up to the groups missing
        if len(take):
            adv = group_advantages(rewards, g, scale=rl.advantage_scale)
            kept.append(Rollouts({k: v[take] for k, v in {**ro.batch, "advantages": adv}.items()}, rewards[take],
                                 ro.lengths[take], [ro.ids[i] for i in take.tolist()], []))  # fmt: skip
            n_groups += len(take) // g
        if n_groups >= p:
            break
    gen_s = time.perf_counter() - t0
    width = cfg.data.seq_len
    fields = [{**r.batch, "rewards": r.rewards, "lengths": r.lengths, "ids": torch.tensor(r.ids, dtype=torch.int64)}
              for r in kept]  # fmt: skip
    spec = batch_spec(cfg)
    padded = [_pad_rows(f, width, f["ids"].shape[0]) for f in fields]  # each round's rows to the width
    cat = {k: torch.cat([f[k] for f in padded]) if padded else torch.zeros((0, *spec[k][0][1:]), dtype=spec[k][1])
           for k in ("inputs", "targets", "gen_logp", "advantages", "rewards", "lengths", "ids")}  # fmt: skip
    batch = _pad_rows(cat, width, per_round)  # and to P * G rows: rows left empty (no informative group) train nothing
    sampled = torch.cat(rewards_all)
    batch.update({
        "index": torch.tensor(index, dtype=torch.int64), "reward_mean": sampled.mean(), "reward_std": sampled.std(correction=0),
        "response_length": torch.cat([r.lengths for r in kept]).float().mean() if kept else torch.tensor(0.0),
        "groups_kept": torch.tensor(float(n_groups)), "rounds": torch.tensor(float(rounds + 1)),
        "gen_tokens_per_s": torch.tensor(made / max(gen_s, 1e-9)),
    })  # fmt: skip
    return batch


def _sample(cfg: TrainConfig, policy: Policy, params: Any, prompts: list[Any], *, key: torch.Tensor | None,
            group_size: int, first_id: int = 0) -> Rollouts:  # fmt: skip
    env = ENVS[cfg.rl.env]
    common = dict(tokenizer=policy.tokenizer, template=policy.template, group_size=group_size,
                  max_new_tokens=cfg.rl.max_new_tokens, key=key, first_id=first_id,
                  generate_fn=policy.generate_fn)  # fmt: skip
    if isinstance(env, ToolEnv):
        return episode_rollout(policy.model, params, prompts, env=env, max_len=cfg.data.seq_len + 1, **common)
    return rollout(policy.model, params, prompts, reward=env.reward, **common)


def evaluate_policy(cfg: TrainConfig, policy: Policy, params: Any) -> dict[str, float]:
    """Greedy answers to ``rl.eval_prompts`` held-out prompts: ``{"eval.reward": mean reward}``."""
    prompts = ENVS[cfg.rl.env].prompts(cfg.rl.eval_prompts, seed=cfg.seed, split="eval")
    ro = _sample(cfg, policy, params, prompts, key=None, group_size=1)
    return {"eval.reward": float(ro.rewards.mean())}


def batch_spec(cfg: TrainConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each field of a :func:`collect`ed batch: its shape and dtype (what a checkpointed queue holds)."""
    n, w = cfg.rl.prompts * cfg.rl.group_size, cfg.data.seq_len
    rows = {"inputs": ((n, w), torch.int64), "targets": ((n, w), torch.int64), "gen_logp": ((n, w), torch.float32),
            "advantages": ((n,), torch.float32), "rewards": ((n,), torch.float32), "lengths": ((n,), torch.int64),
            "ids": ((n,), torch.int64), "index": ((), torch.int64)}  # fmt: skip
    return {**rows, **{k: ((), torch.float32) for k in STATS}}


def rl_state_like(cfg: TrainConfig, reference: Any) -> dict[str, Any]:
    """What an RL checkpoint holds besides the train state: the generator's next batch index, the frozen
    reference (with ``rl.kl_coef``: ``reference``, params-shaped), and in async mode the rollout queue."""
    out: dict[str, Any] = {"generator_step": torch.zeros((), dtype=torch.int64)}
    if cfg.rl.kl_coef:
        out["reference"] = reference
    if cfg.rl.max_offpolicy_steps:
        out["queue"] = AsyncRollouts.empty_queue(cfg.rl.max_offpolicy_steps, batch_spec(cfg))
    return out


STATS = ("reward_mean", "reward_std", "response_length", "groups_kept", "rounds", "gen_tokens_per_s")
TRAIN_FIELDS = ("inputs", "targets", "gen_logp", "advantages")  # what the train step reads of a collected batch


def _loss(cfg: TrainConfig, model: Any) -> Callable[..., Any]:
    rl = cfg.rl
    # async: old_logp is the generator's (the behaviour policy), so there is no second correction to make
    tis = None if (not rl.tis_cap or rl.batch_invariant or rl.max_offpolicy_steps) else rl.tis_cap
    return grpo_loss_fn(model, clip_low=rl.clip_low, clip_high=rl.clip_high, loss_agg=rl.loss_agg,
                        kl_coef=rl.kl_coef, tis_cap=tis)  # fmt: skip


def rl_train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run the RL run ``cfg`` (see the module docstring); returns its records and where things were written."""
    from ftitan.train.trainer import _determinism

    with _determinism(cfg.deterministic):
        return _rl_train(cfg, resume=resume, overwrite=overwrite, progress=progress)


def _prepare_dir(cfg: TrainConfig, run: RunDir, *, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite: pick one")
    if overwrite or run.check_reuse(config_to_dict(cfg), resume=resume):
        run.clear()
    run.create(config_to_dict(cfg))


@faults.reports_peer_failures
def _rl_train(cfg: TrainConfig, *, resume: bool, overwrite: bool, progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    rl = cfg.rl
    rt = runtime.setup(cfg.parallel, device=cfg.device, malloc_retain=cfg.malloc_retain,
                       gemm_library=cfg.gemm_library)
    if rt.layout is not None:
        raise ValueError("ftitan rl runs on one process for now; drop the --parallel.* degrees")
    run = RunDir.of(cfg)
    _prepare_dir(cfg, run, resume=resume, overwrite=overwrite)
    policy = _warm_start(cfg, run.path, rt.device, progress=progress)
    model = policy.model
    opt = post.optimizer_of(cfg, model, model.init(random.key(cfg.seed), device="meta"))
    mp = cfg.mixed_precision
    precision = MixedPrecision.from_names(mp.param, mp.compute, mp.reduce).for_model(model)
    step_fn = rt.make_step(model, _loss(cfg, model), opt, accum_steps=cfg.accum_steps, compile=cfg.compile,
                           update_buffers=model.update_buffers, precision=precision,
                           buckets=cfg.flexshard.buckets, quantize=cfg.flexshard.quantize or None,
                           **runtime.step_options(cfg.model))  # fmt: skip
    state = init_state(policy.params, opt, rng=random.key(cfg.seed))
    reference = tree.map(torch.clone, policy.params) if rl.kl_coef else None  # the frozen initial policy
    ckpt: dict[str, Any] = {"state": state, "rl": rl_state_like(cfg, reference)}
    start = 0
    run.remove_unfinished()
    if resume and (found := run.resume(ckpt, into=True)):
        ckpt, start = found
        state = ckpt["state"]
        reference = ckpt["rl"].get("reference")
    if start > cfg.steps:
        raise RunDirError(f"--steps={cfg.steps}: the run in {run.path} is already at step {start}; pass --steps "
                          f"above {start} to train further (or --overwrite to start over)")  # fmt: skip
    sink = MetricsSink(run.path, keep_until=start)
    ledger = Ledger()
    make = functools.partial(collect, cfg, policy, seed=cfg.seed)
    source: AsyncRollouts | ProcessRollouts | None = None
    llm = None
    threads = torch.get_num_threads()
    saver = run.checkpointer(cfg.checkpoint, keep=cfg.keep, cfg_dict=config_to_dict(cfg))
    try:
        if rl.generator == "vllm" and not rl.max_offpolicy_steps:  # the engine samples from the params pushed each step
            from ftitan import vllm as fv

            llm = _vllm_generator(cfg, policy)
        if start == 0 and rl.eval_prompts:
            sink.log({"step": 0, **evaluate_policy(cfg, policy, state.params)})
        if rl.max_offpolicy_steps:  # the cores split between the generator (a thread or a process) and the trainer
            torch.set_num_threads(max(1, threads // 2))
            common = dict(version=start, k=rl.max_offpolicy_steps, ledger=ledger, spec=batch_spec(cfg),
                          next_index=int(ckpt["rl"]["generator_step"]), queue=ckpt["rl"]["queue"],
                          threads=max(1, threads - threads // 2))  # fmt: skip
            if rl.worker == "process":  # it rebuilds the policy from the warm start's run directory
                factory = functools.partial(_process_make, cfg, str(policy.source), str(rt.device))
                source = ProcessRollouts(factory, state.params, **common)
            else:
                source = AsyncRollouts(make, state.params, **common)
        bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress, unit="step")
        for i in bar:
            if source is None:
                if llm is not None:
                    fv.push_weights(llm, state.params)  # the engine samples from the params after i updates
                got = make(state.params, i)
                lag = 0
                ledger.made(got["ids"])
            else:
                got, lag = source.get(i)
            ledger.trained(got["ids"])
            batch = {k: got[k] for k in TRAIN_FIELDS}
            if rl.max_offpolicy_steps:  # the behaviour policy's log-probs: the ratio's denominator
                batch["old_logp"] = got["gen_logp"]
            if reference is not None:
                batch["ref_logp"] = _logprobs(model, reference, batch)
            t0 = time.perf_counter()
            state, m = step_fn(state, batch)
            record = {"step": i + 1, **to_record(m)}  # reads the step back: the train time below is real
            train_s = time.perf_counter() - t0
            if source is not None:
                source.push(state.params, version=i + 1)
            n_tok = float((batch["targets"] != IGNORE_INDEX).sum())
            record.update({
                "reward": float(got["reward_mean"]), "reward_std": float(got["reward_std"]),
                "response_length": float(got["response_length"]), "rl.groups_kept": float(got["groups_kept"]),
                "rl.rounds": float(got["rounds"]), "rl.lag": float(lag), "rl.stale_dropped": float(ledger.n_dropped),
                "gen_tokens_per_s": float(got["gen_tokens_per_s"]), "train_tokens_per_s": n_tok / max(train_s, 1e-9),
            })  # fmt: skip
            nonfinite.read(state).check(cfg.optim, step=i + 1, run_dir=run, settle=saver.wait)
            sink.log(record)  # every step: an RL step takes seconds, and the reward curve wants each
            bar.set_postfix(reward=f"{record['reward']:.2f}", loss=f"{record['loss']:.3f}")
            if rl.kl_bound and "kl" in record and record["kl"] > rl.kl_bound:
                warnings.warn(f"step {i + 1}: KL to the reference {record['kl']:.3g} is above --rl.kl-bound "
                              f"{rl.kl_bound}", stacklevel=2)  # fmt: skip
            if rl.eval_prompts and ((cfg.eval_every and (i + 1) % cfg.eval_every == 0) or i + 1 == cfg.steps):
                scores = evaluate_policy(cfg, policy, state.params)
                sink.log({"step": i + 1, **scores})
                bar.write(f"step {i + 1}: held-out reward {scores['eval.reward']:.3f}")
            if (cfg.ckpt_every and (i + 1) % cfg.ckpt_every == 0) or i + 1 == cfg.steps:
                nonfinite.read(state, params=True).check(cfg.optim, step=i + 1, run_dir=run, settle=saver.wait)
                tree_out: dict[str, Any] = {"state": state, "rl": {"generator_step": torch.tensor(i + 1)}}
                if reference is not None:
                    tree_out["rl"]["reference"] = reference
                if source is not None:
                    if i + 1 == cfg.steps:  # the last save: no batch is made after it (none made and never saved)
                        source.close()
                    with source.paused() as (queue, next_index):  # nothing in flight: every made rollout is saved
                        tree_out["rl"].update(queue=queue, generator_step=torch.tensor(next_index))
                        saver.save(i + 1, tree_out)
                else:
                    saver.save(i + 1, tree_out)
        bar.close()
        saver.close()
    except BaseException:
        saver.abort()
        raise
    finally:
        if source is not None:
            source.close()
        torch.set_num_threads(threads)
        if llm is not None:
            fv.close(llm)
    sink.close()
    plot_rewards(sink.records, run.path / "reward.png", f"{cfg.recipe}: {cfg.steps} steps")
    rt.close()
    rewards = [r["reward"] for r in sink.records if "reward" in r]
    return {
        "run_dir": str(run.path), "start_step": start, "records": sink.records, "model": model,
        "params": state.params, "tokenizer": policy.tokenizer, "ledger": ledger,
        "final_reward": rewards[-1] if rewards else math.nan,
    }  # fmt: skip


@torch.no_grad()
def _logprobs(model: Any, params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from ftitan.rl.losses import token_logprobs_and_entropy

    return token_logprobs_and_entropy(model, params, batch["inputs"], batch["targets"])[0]

