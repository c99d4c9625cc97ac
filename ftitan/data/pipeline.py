"""From a run's config to batches: the one path ``ftitan train`` (and SFT / RL) takes to its data.

Two kinds of corpus, one interface:

- the embedded default (``--data.corpus stdlib``): tokenized once, cached in the run
  directory as packed rows, served in the resumable shuffled order of
  :func:`ftitan.data.next_batch` (every rank builds the global batch; the runtime
  takes its rows);
- shards (``--data.corpus PATH``: ``.parquet`` / ``.jsonl`` / ``.txt`` files,
  directories, globs): streamed, never whole in memory, each data-parallel rank
  reading and tokenizing only its own rows (:func:`ftitan.data.stream_batches`),
  a background thread tokenizing ahead of the step (:func:`ftitan.data.prefetch`).
  The loader position is global: a run resumed on another data-parallel degree
  sees the same global batches.

The tokenizer is the run's trained byte-level BPE (cached as ``tokenizer.json`` in
the run directory), or, with ``--data.tokenizer DIR``, a published model's own
(its ``tokenizer.json``, BOS/EOS from its config; copied into the run directory).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ftitan.data import sft
from ftitan.data.chat import ChatTemplate
from ftitan.data.corpus import stdlib_corpus
from ftitan.data.heldout import held_out_batches
from ftitan.data.loader import Batch, LoaderState, PackedDataset, eval_batches, init_loader_state, next_batch
from ftitan.data.packing import encode_documents, pack
from ftitan.data.prefetch import prefetch
from ftitan.data.pretrained import pretrained_tokenizer
from ftitan.data.sources import Source, shards
from ftitan.data.stream import StreamState, init_stream_state, merge_states, stream_batches
from ftitan.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_for

if TYPE_CHECKING:
    from ftitan.config.schema import TrainConfig

__all__ = ["RunData", "TrainBatches", "eval_rows", "loader_state_like", "prepare", "run_tokenizer", "train_batches"]

BPE_TRAINING_DOCS = 50_000  # a BPE trained on a streamed corpus sees its first documents only
EVAL_FRACTION = 0.02  # held-out share of a streamed corpus's documents (by a hash of their text)
PREFETCH_DEPTH = 2  # batches tokenized ahead of the step


class RunData(NamedTuple):
    """A run's tokenizer and its data: packed train / held-out rows (stdlib, chat), or a streamed ``Source``;
    for chat data also its template and counts (``data.truncated``, ...) for the metrics."""

    tokenizer: Tokenizer
    train: PackedDataset | Source
    eval: PackedDataset | Source
    stats: dict[str, float] = {}  # noqa: RUF012  (a NamedTuple default: never mutated)
    template: ChatTemplate | None = None


def _streamed(cfg: TrainConfig) -> bool:
    return cfg.data.corpus != "stdlib"


def _tokenizer(cfg: TrainConfig, run_dir: Path, docs: Callable[[], Iterable[str]], *, write: bool) -> Tokenizer:
    if cfg.data.tokenizer:
        from ftitan.checkpoint.convert import copy_tokenizer_files

        if write:
            copy_tokenizer_files(cfg.data.tokenizer, run_dir)  # the run directory holds what it trained with
        return pretrained_tokenizer(cfg.data.tokenizer)
    return tokenizer_for(run_dir, docs(), cfg.data.vocab_size)


def prepare(cfg: TrainConfig, run_dir: str | Path, *, write: bool = True) -> RunData:
    """The run's tokenizer and data (the stdlib corpus: trained once and encoded once, both cached).

    ``write=False`` (the ranks after the first, once it has prepared): read what it cached, write nothing."""
    run_dir = Path(run_dir)
    if cfg.data.chat or cfg.data.preference:
        return _prepare_chat(cfg, run_dir, write=write)
    if _streamed(cfg):
        src = shards(cfg.data.corpus, field=cfg.data.jsonl_field)
        tok = _tokenizer(cfg, run_dir, lambda: itertools.islice(src.documents(), BPE_TRAINING_DOCS),
                         write=write)
        return RunData(tok, src, src)
    tok = _tokenizer(cfg, run_dir, lambda: stdlib_corpus(split="train"), write=write)
    sets = []
    for split in ("train", "eval"):
        stream = encode_documents(stdlib_corpus(split=split), tok, cache=run_dir / f"{split}_tokens.npy")
        rows = pack(stream, seq_len=cfg.data.seq_len)
        if rows.shape[0] == 0:
            raise ValueError(f"--data.corpus {cfg.data.corpus}: the {split} split has fewer than seq_len+1 tokens; "
                             "use a larger corpus or a smaller --data.seq-len")  # fmt: skip
        sets.append(PackedDataset(rows.long()))
    return RunData(tok, sets[0], sets[1])


def _prepare_chat(cfg: TrainConfig, run_dir: Path, *, write: bool) -> RunData:
    """SFT rows or DPO pairs (:mod:`ftitan.data.sft`); a run that trains its own tokenizer trains it on the
    rendered conversations and keeps the built-in template beside it (``chat_template.jinja``, exported by
    convert)."""
    template = sft.chat_template_of(cfg, run_dir)
    tok = _tokenizer(cfg, run_dir, lambda: sft.rendered_texts(cfg, template), write=write)
    if write and not cfg.data.tokenizer:
        (run_dir / sft.TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    chat = (sft.prepare_preferences if cfg.data.preference else sft.prepare_chat)(cfg, tok, template)
    return RunData(tok, chat.train, chat.eval, chat.stats, template)


def run_tokenizer(cfg: TrainConfig, run_dir: str | Path) -> Tokenizer | None:
    """The tokenizer a run directory holds (``None`` when it has none: an HF import without one)."""
    if not (Path(run_dir) / "tokenizer.json").is_file():
        return None
    return pretrained_tokenizer(run_dir) if cfg.data.tokenizer else load_tokenizer(run_dir)


def loader_state_like(cfg: TrainConfig) -> LoaderState | StreamState:
    """The loader state a run checkpoints (its structure: what a checkpoint restores into)."""
    if _streamed(cfg):
        return init_stream_state(cfg.seed, cfg.data.batch_size)
    return init_loader_state(cfg.seed)


def _to(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    # pinned host memory: the copy runs behind the compute already queued, no wait on the host
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


class TrainBatches(Iterator[Batch]):
    """The run's training batches on ``device``.

    ``rows_local``: each batch holds only this rank's rows (a streamed corpus), else the global
    batch. ``global_state(gather)`` is the loader position after the last batch served, as a
    checkpoint saves it (collective for a streamed corpus: ``gather`` collects every data-parallel
    slice's state, e.g. ``Runtime.gather_by_data_rank``).
    """

    def __init__(self, source: Iterator[Batch], state: Callable[[], Any], *, rows_local: bool,
                 device: torch.device) -> None:  # fmt: skip
        self._source, self._state, self.rows_local, self.device = source, state, rows_local, device

    def __next__(self) -> Batch:
        return _to(next(self._source), self.device)

    @property
    def state(self) -> Any:
        """This rank's loader position (its lanes only, for a streamed corpus)."""
        return self._state()

    def global_state(self, gather: Callable[[Any], list[Any]]) -> Any:
        return merge_states(gather(self.state)) if self.rows_local else self.state

    def close(self) -> None:
        close = getattr(self._source, "close", None)
        if close is not None:
            close()


def _packed(ds: PackedDataset, batch_size: int, state: LoaderState) -> tuple[Iterator[Batch], Callable[[], Any]]:
    box = {"state": state}

    def gen() -> Iterator[Batch]:
        while True:
            batch, box["state"] = next_batch(ds, box["state"], batch_size)
            yield batch

    return gen(), lambda: box["state"]


def train_batches(data: RunData, cfg: TrainConfig, state: Any, *, device: torch.device,
                  data_rank: tuple[int, int] = (0, 1)) -> TrainBatches:  # fmt: skip
    """The training batches from loader ``state`` (``loader_state_like(cfg)`` or a restored one)."""
    if isinstance(data.train, PackedDataset):
        source, get = _packed(data.train, cfg.data.batch_size, state)
        return TrainBatches(source, get, rows_local=False, device=device)
    index, count = data_rank
    stream = prefetch(stream_batches(data.train, data.tokenizer, state, seq_len=cfg.data.seq_len,
                                     batch_size=cfg.data.batch_size, dp_rank=index, dp_size=count,
                                     eval_fraction=EVAL_FRACTION), depth=PREFETCH_DEPTH)  # fmt: skip
    return TrainBatches(stream, lambda: stream.state, rows_local=True, device=device)


def eval_rows(data: RunData, cfg: TrainConfig, *, device: torch.device,
              data_rank: tuple[int, int] = (0, 1)) -> list[Batch]:  # fmt: skip
    """The first ``cfg.eval_batches`` held-out batches, in order, on ``device`` (this rank's rows of each,
    for a streamed corpus): build once, evaluate on them every time."""
    if isinstance(data.eval, PackedDataset):
        batches: Iterable[Batch] = eval_batches(data.eval, cfg.data.batch_size)
    else:
        index, count = data_rank
        batches = held_out_batches(data.eval, data.tokenizer, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
                                   eval_fraction=EVAL_FRACTION, dp_rank=index, dp_size=count)  # fmt: skip
    return [_to(b, device) for b in itertools.islice(batches, cfg.eval_batches)]
