"""Where a run's metrics go: ``metrics.jsonl``, TensorBoard events, and ``loss.png`` at the end.

Step metrics stay tensors on the device until a record step reads them
back (:func:`to_record`), so the steps in between never wait for the host.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsSink", "Throughput", "plot_losses", "plot_rewards", "read_records", "to_record"]

_MAX_LOGGED_LOADS = 4096  # larger expert grids (e.g. 58 x 384) are summarized by moe.max_load only


def to_record(m: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A step's metrics as a record (reads them back): every 0-d metric as a float (``n_tokens`` aside),
    MoE load as lists."""
    out: dict[str, Any] = {k: float(v) for k, v in m.items() if v.ndim == 0 and k != "n_tokens"}
    load = m.get("moe.tokens_per_expert")
    if load is not None and load.numel() <= _MAX_LOGGED_LOADS:
        out["moe.tokens_per_expert"] = load.tolist()  # (L_moe, E): JSONL only, TensorBoard takes scalars
    return out


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (``[]`` when there is none). A torn last line (a run killed while
    writing it) is dropped with a warning; any other unreadable line raises ``ValueError`` naming it."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with an int 'step'")
        except ValueError as e:
            if i == len(lines):
                warnings.warn(f"{path}:{i}: dropping a torn last line (a run stopped while writing it): {line[:60]!r}",
                              stacklevel=3)  # fmt: skip
                break
            raise ValueError(f"{path}:{i}: unreadable metrics record ({e}); fix or delete that line") from None
        out.append(record)
    return out


class MetricsSink:
    """metrics.jsonl (one record per line) + TensorBoard events, both under the run dir.

    ``keep_until``: on resume, records past the checkpoint's step are dropped, so the file reads as
    one uninterrupted run.
    """

    def __init__(self, run_dir: Path, *, keep_until: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(run_dir) / "metrics.jsonl"
        self.records: list[dict[str, Any]] = [r for r in read_records(self.path) if r["step"] <= keep_until]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=keep_until + 1)

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for k, v in record.items():
            if k != "step" and isinstance(v, float):  # lists (router load) go to the JSONL only
                self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.tb.close()


class Throughput:
    """Tokens/s over the steps since the last reading; time spent in ``paused()`` blocks is not counted."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self._mark, self._steps, self._excluded = time.perf_counter(), 0, 0.0

    def step(self) -> None:
        self._steps += 1

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (evaluation, checkpointing) out of the next reading."""
        self._excluded += seconds

    def read(self) -> float:
        now = time.perf_counter()
        rate = self.tokens_per_step * self._steps / max(now - self._mark - self._excluded, 1e-9)
        self._mark, self._steps, self._excluded = now, 0, 0.0
        return rate


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def plot_rewards(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """An RL run's mean reward per step (and its 10-step moving mean) and the held-out greedy reward, against
    step; written atomically to ``path`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    pts = [(r["step"], r["reward"]) for r in records if "reward" in r]
    if pts:
        steps, rewards = zip(*pts)
        ax.plot(steps, rewards, alpha=0.35, label="train (samples)")
        smooth = [sum(rewards[max(0, i - 9): i + 1]) / len(rewards[max(0, i - 9): i + 1]) for i in range(len(rewards))]
        ax.plot(steps, smooth, label="train, 10-step mean")
    held = [(r["step"], r["eval.reward"]) for r in records if "eval.reward" in r]
    if held:
        ax.plot(*zip(*held), "s-", label="held-out (greedy)")
    ax.set(xlabel="step", ylabel="mean reward", title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    _save(fig, path)


def plot_losses(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Train and held-out loss against step (and a synthetic task's exact match and parse rate, on a second
    axis), written atomically to ``path`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "train"), ("eval_loss", "held-out")):
        pts = [(r["step"], r[key]) for r in records if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key == "eval_loss" else None, label=label)
    ylabel = "DPO loss" if any("rewards/accuracy" in r for r in records) else "cross-entropy (nats/token)"
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    scores = [(key, [(r["step"], r[key]) for r in records if key in r])
              for key in ("eval.exact_match", "eval.parse_rate")]  # fmt: skip
    if any(pts for _, pts in scores):  # SFT on a synthetic task: its exact match, on a second axis
        right = ax.twinx()
        for (key, pts), style in zip(scores, ("s-", "^:"), strict=True):
            if pts:
                right.plot(*zip(*pts), style, color="tab:green", label=key.removeprefix("eval."))
        right.set(ylabel="share of held-out answers", ylim=(0, 1))
        right.legend(loc="upper right")
    _save(fig, path)
