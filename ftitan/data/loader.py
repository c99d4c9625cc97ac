"""A resumable, shuffling loader over packed rows.

The loader's whole state is :class:`LoaderState`, a NamedTuple of three 0-d
``int64`` tensors (shuffle key, epoch, position), so it checkpoints with the
rest of the train state. :func:`next_batch` is a function of
``(dataset, state)`` only: epoch ``e`` visits the rows in the order
``randperm(num_rows)`` drawn from ``fold_in(key, e)``, so a run resumed from a
saved state sees exactly the batches the uninterrupted run would have seen.

Each epoch visits every row exactly once. A batch that runs past the end of
an epoch takes its remaining rows from the start of the next epoch's order,
so no row is skipped and every batch is full.

Example::

    ds = PackedDataset(pack(stream, seq_len=256))
    state = init_loader_state(0)
    batch, state = next_batch(ds, state, batch_size=8)   # batch["inputs"]: (8, 256) int64
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import torch

from ftitan import random

__all__ = [
    "Batch",
    "LoaderState",
    "PackedDataset",
    "epoch_order",
    "eval_batches",
    "init_loader_state",
    "next_batch",
]

Batch = dict[str, torch.Tensor]


class PackedDataset(NamedTuple):
    """Packed token rows: ``(num_rows, seq_len + 1)`` int32 or int64 (see :func:`ftitan.data.pack`), or
    ready batch fields ``{"inputs", "targets", ...}`` of ``(num_rows, seq_len)`` each (packed documents,
    :func:`ftitan.data.pack_documents`; preference pairs), served as they are."""

    rows: torch.Tensor | dict[str, torch.Tensor]

    @property
    def num_rows(self) -> int:
        return _first(self.rows).shape[0]

    @property
    def seq_len(self) -> int:
        return _first(self.rows).shape[1] - (0 if isinstance(self.rows, dict) else 1)


def _first(rows: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
    return next(iter(rows.values())) if isinstance(rows, dict) else rows


class LoaderState(NamedTuple):
    """Where a loader is: all 0-d ``int64`` tensors."""

    key: torch.Tensor  # shuffle key (ftitan.random); epoch e uses fold_in(key, e)
    epoch: torch.Tensor  # epochs completed
    position: torch.Tensor  # rows of the current epoch already served


def init_loader_state(seed: int | torch.Tensor) -> LoaderState:
    """Epoch 0, position 0, shuffle key from an int seed or an ftitan.random key."""
    k = random.key(seed) if isinstance(seed, int) else seed
    random.key_data(k)  # validates it is a key
    zero = torch.zeros((), dtype=torch.int64)
    return LoaderState(key=k, epoch=zero, position=zero.clone())


@functools.lru_cache(maxsize=4)
def _randperm(seed_bits: int, num_rows: int) -> torch.Tensor:
    # cached: next_batch runs once per step, but the order only changes once per epoch
    g = torch.Generator(device="cpu").manual_seed(seed_bits >> 1)  # as ftitan.random: signed 63 bits
    return torch.randperm(num_rows, generator=g)


def _order(key: torch.Tensor, epoch: int, num_rows: int) -> torch.Tensor:
    return _randperm(random.key_data(random.fold_in(key, epoch)), num_rows)


def epoch_order(key: torch.Tensor, epoch: int, num_rows: int) -> torch.Tensor:
    """The row order of ``epoch``: a permutation of ``range(num_rows)``, ``(num_rows,)`` int64."""
    return _order(key, int(epoch), num_rows).clone()


def next_batch(dataset: PackedDataset, state: LoaderState, batch_size: int) -> tuple[Batch, LoaderState]:
    """The next ``batch_size`` rows as ``{"inputs": (B, T), "targets": (B, T)}`` int64, and the new state.

    ``T = dataset.seq_len``; ``targets`` is ``inputs`` shifted left by one token (rows of batch fields:
    each field's rows, e.g. packed documents' ``positions`` and ``segments`` too).
    """
    n = dataset.num_rows
    if batch_size < 1:
        raise ValueError(f"next_batch: batch_size must be >= 1, got {batch_size}")
    if n == 0:
        raise ValueError("next_batch: the dataset has no rows")
    random.key_data(state.key)  # validates it is a key
    epoch, position = int(state.epoch), int(state.position)
    if not 0 <= position < n:
        raise ValueError(f"next_batch: state.position={position} is outside [0, {n}); "
                         f"was this state saved for a dataset of another size?")
    picks: list[torch.Tensor] = []
    need = batch_size
    while need > 0:
        take = min(need, n - position)
        picks.append(_order(state.key, epoch, n)[position : position + take])
        need -= take
        position += take
        if position == n:
            epoch, position = epoch + 1, 0
    batch = _take(dataset.rows, torch.cat(picks))
    new_state = LoaderState(
        key=state.key,
        epoch=torch.tensor(epoch, dtype=torch.int64),
        position=torch.tensor(position, dtype=torch.int64),
    )
    return batch, new_state


def _take(rows: torch.Tensor | dict[str, torch.Tensor], index: torch.Tensor | slice) -> Batch:
    if isinstance(rows, dict):  # batch fields already
        return {k: v[index].long() for k, v in rows.items()}
    return _as_batch(rows[index])


def _as_batch(rows: torch.Tensor) -> Batch:
    rows = rows.long()  # (B, T + 1)
    return {"inputs": rows[:, :-1].contiguous(), "targets": rows[:, 1:].contiguous()}


def eval_batches(dataset: PackedDataset, batch_size: int) -> Iterator[Batch]:
    """Every row once, in stored order, unshuffled: for held-out loss. The last batch may be smaller."""
    if batch_size < 1:
        raise ValueError(f"eval_batches: batch_size must be >= 1, got {batch_size}")
    for start in range(0, dataset.num_rows, batch_size):
        yield _take(dataset.rows, slice(start, start + batch_size))
