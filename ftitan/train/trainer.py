"""The training loop: data -> step -> metrics -> checkpoint, written so a reader sees it.

``train(cfg)`` runs one ``TrainConfig``: it tokenizes the corpus (cached in
the run directory), builds the model and optimizer, compiles the pure train
step, and loops, showing a progress bar, evaluating held-out loss, writing
``metrics.jsonl`` and TensorBoard events, checkpointing (atomically, keeping
the last K), and finally plotting ``loss.png``. ``resume=True`` continues
from the newest valid checkpoint and sees exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ftitan import checkpoint, data, optim, random, tree
from ftitan.config.schema import DataConfig, OptimConfig, ParallelConfig, TrainConfig
from ftitan.models import registry
from ftitan.train.losses import next_token_loss
from ftitan.train.state import TrainState, init_state
from ftitan.train import runtime

__all__ = ["build_optimizer", "config_from_dict", "config_to_dict", "evaluate", "load_data", "load_run", "run_dir_of", "train"]


def run_dir_of(cfg: TrainConfig) -> Path:
    return Path(cfg.run_dir.format(recipe=cfg.recipe))


def _documents(cfg: TrainConfig, split: str) -> Any:
    corpus = cfg.data.corpus
    if corpus == "stdlib":
        return data.stdlib_corpus(split=split)
    docs = list(data.jsonl(corpus, field=cfg.data.jsonl_field) if corpus.endswith(".jsonl") else data.text_files([corpus]))
    cut = max(1, len(docs) // 50)  # a user corpus: the last 2% of its documents are held out
    return docs[:-cut] if split == "train" else docs[-cut:]


def load_data(cfg: TrainConfig, run_dir: Path) -> tuple[data.Tokenizer, data.PackedDataset, data.PackedDataset]:
    """Tokenizer (trained once, cached) and packed train / held-out rows (encoded once, cached)."""
    tok = data.tokenizer_for(run_dir, _documents(cfg, "train"), cfg.data.vocab_size)
    sets = []
    for split in ("train", "eval"):
        stream = data.encode_documents(_documents(cfg, split), tok, cache=run_dir / f"{split}_tokens.npy")
        rows = data.pack(stream, seq_len=cfg.data.seq_len)
        if rows.shape[0] == 0:
            raise ValueError(f"--data.corpus {cfg.data.corpus}: the {split} split has fewer than seq_len+1 tokens; "
                             "use a larger corpus or a smaller --data.seq-len")
        sets.append(data.PackedDataset(rows.long()))
    return tok, sets[0], sets[1]


def build_optimizer(o: OptimConfig, steps: int, params: Any, *, frozen: tuple[str, ...] = ()) -> optim.Transform:
    """The optimizer a recipe names: schedule, then AdamW or Muon+AdamW, behind clipping.

    ``frozen`` (a model's ``frozen`` globs) are left unchanged by the optimizer.
    """
    final = o.lr * o.final_lr_fraction
    if o.schedule == "cosine":
        lr: Any = optim.warmup_cosine(o.lr, warmup=o.warmup, total=steps, final=final)
    elif o.schedule == "wsd":
        lr = optim.warmup_stable_decay(o.lr, warmup=o.warmup, total=steps, final=final)
    else:
        lr = optim.linear_warmup(o.lr, o.warmup)
    if o.name == "muon":
        inner = optim.muon_with_adamw(params, lr=lr, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                                      shape_scaling="match_rms_adamw")
    else:
        inner = optim.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    if frozen:
        inner = optim.chain(inner, optim.freeze(frozen, missing_ok=True))  # a pipeline stage may hold none
    return optim.chain(optim.clip_by_global_norm(o.clip), inner) if o.clip > 0 else inner


@torch.no_grad()
def evaluate(
    batch_loss: Callable[[Any, Any], float], params: Any, ds: data.PackedDataset, *, batch_size: int, max_batches: int
) -> float:
    """Mean held-out cross-entropy over the first ``max_batches`` batches (in order, unshuffled).

    ``batch_loss(params, batch) -> float``: e.g. ``Runtime.eval_loss`` bound to a loss function
    (MoE: without the balancing term).
    """
    losses = []
    for i, batch in enumerate(data.eval_batches(ds, batch_size)):
        if i == max_batches:
            break
        losses.append(batch_loss(params, batch))
    return sum(losses) / len(losses)


class _Metrics:
    """metrics.jsonl (one record per line) + TensorBoard events, both under the run dir."""

    def __init__(self, run_dir: Path, *, keep_until: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        # on resume, drop records past the checkpoint so the file reads as one uninterrupted run
        old = self.path.read_text().splitlines() if self.path.exists() else []
        kept = [line for line in old if json.loads(line)["step"] <= keep_until]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.records = [json.loads(line) for line in kept]
        self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=keep_until + 1)

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for k, v in record.items():
            if k != "step" and isinstance(v, float):  # lists (router load) go to the JSONL only
                self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.tb.close()


def _plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "train"), ("eval_loss", "held-out")):
        pts = [(r["step"], r[key]) for r in records if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key == "eval_loss" else None, label=label)
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".tmp.png"), dpi=110)
    plt.close(fig)
    path.with_suffix(".tmp.png").replace(path)


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg``; returns the final metrics and where things were written."""
    from tqdm import tqdm

    rt = runtime.setup(cfg.parallel)  # joins the torchrun world; checks the degrees first
    run_dir = run_dir_of(cfg)
    cfg_dict = config_to_dict(cfg)
    if rt.is_main:  # rank 0 writes files (and trains the tokenizer); the others read them
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
        tok, train_ds, eval_ds = load_data(cfg, run_dir)
    rt.barrier()
    if not rt.is_main:
        tok, train_ds, eval_ds = load_data(cfg, run_dir)

    model = registry.model_for(cfg.model)
    full_params = model.init(random.key(cfg.seed))
    opt = build_optimizer(cfg.optim, cfg.steps, full_params, frozen=model.frozen)
    loss_fn = next_token_loss(model)
    step_fn = rt.make_step(model, loss_fn, opt, accum_steps=cfg.accum_steps, compile=cfg.compile,
                           update_buffers=model.update_buffers)  # fmt: skip
    state: TrainState = init_state(rt.place(full_params, model), opt, rng=random.key(cfg.seed))
    loader = data.init_loader_state(cfg.seed)

    ckpt_dir = run_dir / "checkpoints"
    # what a checkpoint holds: full tensors (shapes only here; meta allocates nothing)
    full_like = init_state(tree.map(lambda x: x.to("meta"), full_params), opt, rng=random.key(cfg.seed))
    start = 0
    if resume and (latest := checkpoint.latest(ckpt_dir)) is not None:
        # checkpoints hold full tensors: load them whole, then take this rank's stage and blocks
        like = {"state": full_like, "loader": loader}
        restored, manifest = checkpoint.load(latest, like)
        state, loader, start = rt.from_full(restored["state"], state), restored["loader"], manifest.step
    metrics = _Metrics(run_dir, keep_until=start) if rt.is_main else None

    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not (progress and rt.is_main),
               unit="step")  # fmt: skip
    last: dict[str, Any] = {}
    # throughput over the steps since the last record; evaluation and checkpoint time excluded.
    # Only record steps read values back (float()), so an accelerator is not stalled every step.
    t_mark, done = time.perf_counter(), 0
    for i in bar:
        batch, loader = data.next_batch(train_ds, loader, cfg.data.batch_size)  # data
        state, m = step_fn(state, rt.local_batch(batch))  # step
        step, done = i + 1, done + 1
        if step % cfg.log_every == 0 or step == cfg.steps:  # metrics
            now = time.perf_counter()
            last = {"step": step, **_record(m), "tokens_per_s": tokens_per_step * done / (now - t_mark)}
            t_mark, done = now, 0
            if metrics is not None:
                metrics.log(last)
            load = {"load": f"{last['moe.max_load']:.2f}"} if "moe.max_load" in last else {}
            bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}", lr=f"{last['lr']:.1e}",
                            **load)  # fmt: skip
        t_side = time.perf_counter()
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            ev = evaluate(functools.partial(rt.eval_loss, model, loss_fn), state.params, eval_ds,
                          batch_size=cfg.data.batch_size, max_batches=cfg.eval_batches)  # fmt: skip
            if metrics is not None:
                metrics.log({"step": step, "eval_loss": ev})
                bar.write(f"step {step}: held-out loss {ev:.4f}")
        if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps:  # checkpoint
            full_state = rt.to_full(state, full_like)  # collective under a layout
            if rt.is_main:
                checkpoint.save(ckpt_dir, step, {"state": full_state, "loader": loader}, keep=cfg.keep,
                                extra={"config": cfg_dict})  # fmt: skip
            rt.barrier()
        t_mark += time.perf_counter() - t_side  # side work is not training time
    bar.close()
    records = metrics.records if metrics is not None else []
    if metrics is not None:
        metrics.close()
        _plot(records, run_dir / "loss.png", f"{cfg.recipe}: {cfg.steps} steps")
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    rt.close()
    return {
        "run_dir": str(run_dir),
        "final_loss": last.get("loss", math.nan),
        "eval_loss": evals[-1] if evals else math.nan,
        "records": records,
        "model": model,
        "params": state.params,  # DTensors under a parallel layout
        "tokenizer": tok,
    }


_MAX_LOGGED_LOADS = 4096  # larger expert grids (e.g. 58 x 384) are summarized by moe.max_load only


def _record(m: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A step's metrics as a record: every 0-d metric as a float (``n_tokens`` aside), MoE load as lists."""
    out: dict[str, Any] = {k: float(v) for k, v in m.items() if v.ndim == 0 and k != "n_tokens"}
    load = m.get("moe.tokens_per_expert")
    if load is not None and load.numel() <= _MAX_LOGGED_LOADS:
        out["moe.tokens_per_expert"] = load.tolist()  # (L_moe, E): JSONL only, TensorBoard takes scalars
    return out


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """``cfg`` as the JSON a run writes (``config.json``, checkpoint manifests); the model names its family."""
    return {**attrs.asdict(cfg), "model": registry.config_to_dict(cfg.model)}


def config_from_dict(d: dict[str, Any]) -> TrainConfig:
    """The ``TrainConfig`` a run wrote to its ``config.json``."""
    return TrainConfig(**{**d, "model": registry.config_from_dict(d["model"]), "optim": OptimConfig(**d["optim"]),
                          "data": DataConfig(**d["data"]), "parallel": ParallelConfig(**d.get("parallel", {}))})


def load_run(run_dir: str | Path) -> tuple[TrainConfig, Any, Any, data.Tokenizer, int]:
    """``(cfg, model, params, tokenizer, step)`` from a run directory's newest valid checkpoint."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise FileNotFoundError(f"{run_dir}: no config.json here; pass the directory a `ftitan train` run wrote "
                                "(runs/<recipe> by default)")
    latest = checkpoint.latest(run_dir / "checkpoints")
    if latest is None:
        raise FileNotFoundError(f"{run_dir}/checkpoints: no valid checkpoint yet; train longer or check the run")
    cfg = config_from_dict(checkpoint.read_manifest(latest).extra["config"])  # the config these weights came from
    model = registry.model_for(cfg.model)
    params = model.init(random.key(cfg.seed))  # the structure to restore into
    opt = build_optimizer(cfg.optim, cfg.steps, params, frozen=model.frozen)
    like = {"state": init_state(params, opt), "loader": data.init_loader_state(cfg.seed)}
    restored, manifest = checkpoint.load(latest, like)
    return cfg, model, restored["state"].params, data.load_tokenizer(run_dir), manifest.step
