"""From a run's config to batches: the one path ``ftitan train`` (and SFT / RL) takes to its data.

``prepare(cfg, run_dir)`` gives the tokenizer and the packed train and
held-out rows (tokenized once, cached in the run directory); ``TrainBatches``
serves the training batches in the resumable order of
:func:`ftitan.data.next_batch`, placed on the run's device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from ftitan.data.corpus import jsonl, stdlib_corpus, text_files
from ftitan.data.loader import Batch, LoaderState, PackedDataset, eval_batches, init_loader_state, next_batch
from ftitan.data.packing import encode_documents, pack
from ftitan.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_for

if TYPE_CHECKING:
    from ftitan.config.schema import TrainConfig

__all__ = ["RunData", "TrainBatches", "documents", "loader_state_like", "prepare", "run_tokenizer"]


class RunData(NamedTuple):
    """A run's tokenizer and its packed train / held-out rows."""

    tokenizer: Tokenizer
    train: PackedDataset
    eval: PackedDataset


def documents(cfg: TrainConfig, split: str) -> Iterable[str]:
    """The documents of ``split`` ("train" or "eval") of the run's ``--data.corpus``."""
    corpus = cfg.data.corpus
    if corpus == "stdlib":
        return stdlib_corpus(split=split)
    docs = list(jsonl(corpus, field=cfg.data.jsonl_field) if corpus.endswith(".jsonl") else text_files([corpus]))
    cut = max(1, len(docs) // 50)  # a user corpus: the last 2% of its documents are held out
    return docs[:-cut] if split == "train" else docs[-cut:]


def prepare(cfg: TrainConfig, run_dir: str | Path) -> RunData:
    """Tokenizer (trained once, cached) and packed train / held-out rows (encoded once, cached)."""
    run_dir = Path(run_dir)
    tok = tokenizer_for(run_dir, documents(cfg, "train"), cfg.data.vocab_size)
    sets = []
    for split in ("train", "eval"):
        stream = encode_documents(documents(cfg, split), tok, cache=run_dir / f"{split}_tokens.npy")
        rows = pack(stream, seq_len=cfg.data.seq_len)
        if rows.shape[0] == 0:
            raise ValueError(f"--data.corpus {cfg.data.corpus}: the {split} split has fewer than seq_len+1 tokens; "
                             "use a larger corpus or a smaller --data.seq-len")  # fmt: skip
        sets.append(PackedDataset(rows.long()))
    return RunData(tok, sets[0], sets[1])


def run_tokenizer(cfg: TrainConfig, run_dir: str | Path) -> Tokenizer | None:
    """The tokenizer a run directory holds (``None`` when it has none: an HF import without one)."""
    if not (Path(run_dir) / "tokenizer.json").is_file():
        return None
    return load_tokenizer(run_dir)


def loader_state_like(cfg: TrainConfig) -> LoaderState:
    """The loader state a run checkpoints (its structure: what a checkpoint restores into)."""
    return init_loader_state(cfg.seed)


def _to(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    # pinned host memory: the copy runs behind the compute already queued, no wait on the host
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


class TrainBatches(Iterator[Batch]):
    """The run's training batches (``cfg.data.batch_size`` global rows each) on ``device``.

    ``state`` is the loader position after the last batch served: what a checkpoint saves and
    ``TrainBatches(..., state=...)`` resumes from, so a resumed run sees the same batches.
    """

    def __init__(self, ds: PackedDataset, batch_size: int, *, state: LoaderState, device: torch.device) -> None:
        self.ds, self.batch_size, self.state, self.device = ds, batch_size, state, device

    def __next__(self) -> Batch:
        batch, self.state = next_batch(self.ds, self.state, self.batch_size)
        return _to(batch, self.device)

    def eval(self, ds: PackedDataset, max_batches: int) -> Iterator[Batch]:
        """The first ``max_batches`` held-out batches of ``ds``, in order, on the device."""
        for i, batch in enumerate(eval_batches(ds, self.batch_size)):
            if i == max_batches:
                return
            yield _to(batch, self.device)


