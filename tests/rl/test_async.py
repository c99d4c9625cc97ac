"""Async rollouts: a generator thread runs ahead of the trainer by at most k versions; no rollout is lost
or trained on twice (accounted by ids), stale batches are dropped and counted, a paused queue round-trips."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest
import torch

from ftitan.rl.asynchronous import AsyncRollouts, Ledger, ProcessRollouts

N = 4
SPEC = {"ids": ((N,), torch.int64), "x": ((N, 3), torch.float32)}


def make_factory(delay: float = 0.0, fail_at: int | None = None):
    seen: list[tuple[int, float]] = []  # (index, the params' value it was made from)

    def make(params, index):
        if index == fail_at:
            raise ValueError("boom")
        time.sleep(delay)
        seen.append((index, float(params["w"])))
        return {"ids": torch.arange(index * N, (index + 1) * N), "x": torch.full((N, 3), float(index))}

    return make, seen


def drive(source, steps, *, train_time=0.0, start=0):
    got = []
    for step in range(start, start + steps):
        batch, lag = source.get(step)
        source.ledger.trained(batch["ids"])
        got.append((batch, lag))
        time.sleep(train_time)
        source.push({"w": torch.tensor(float(step + 1))}, version=step + 1)
    return got


def test_k1_runs_one_ahead_and_accounts_for_every_rollout():
    make, seen = make_factory(delay=0.01)
    ledger = Ledger()
    source = AsyncRollouts(make, {"w": torch.tensor(0.0)}, version=0, k=1, ledger=ledger, spec=SPEC)
    got = drive(source, 12, train_time=0.02)
    source.close()
    assert all(lag <= 1 for _, lag in got)
    assert max(lag for _, lag in got) == 1  # it did run ahead: batch n+1 was made while n trained
    trained = [i for b, _ in got for i in b["ids"].tolist()]
    assert len(trained) == len(set(trained)) == 12 * N
    assert ledger.unaccounted(source.pending_ids()) == set()
    # each batch was made from the params pushed before it started: version == the w it read
    for (batch, lag), step in zip(got, range(12), strict=True):
        index = int(batch["x"][0, 0])
        assert dict(seen)[index] == step - lag


def test_stale_batches_are_dropped_counted_and_never_trained():
    make, _ = make_factory(delay=0.0)
    ledger = Ledger()
    # a queue deeper than k with a slow trainer: batches wait there long enough to go stale
    source = AsyncRollouts(make, {"w": torch.tensor(0.0)}, version=0, k=1, ledger=ledger, spec=SPEC, capacity=4)
    got = drive(source, 8, train_time=0.03)
    source.close()
    assert ledger.n_dropped > 0 and ledger.dropped_ids
    assert all(lag <= 1 for _, lag in got)
    assert not set(ledger.dropped_ids) & set(ledger.trained_ids)
    assert ledger.unaccounted(source.pending_ids()) == set()
    assert len(ledger.trained_ids) == len(set(ledger.trained_ids)) == 8 * N


def test_training_a_rollout_twice_raises():
    ledger = Ledger()
    ledger.made(torch.arange(4))
    ledger.trained(torch.arange(4))
    with pytest.raises(RuntimeError, match="twice"):
        ledger.trained(torch.tensor([3, -1]))


def test_paused_queue_round_trips_through_a_checkpoint():
    make, _ = make_factory()
    ledger = Ledger()
    source = AsyncRollouts(make, {"w": torch.tensor(0.0)}, version=0, k=2, ledger=ledger, spec=SPEC)
    drive(source, 3)
    with source.paused() as (queue, next_index):
        saved = {"n": queue["n"].clone(), "versions": queue["versions"].clone(),
                 "batches": {k: v.clone() for k, v in queue["batches"].items()}}  # fmt: skip
        pending = source.pending_ids()
    source.close()
    assert int(saved["n"]) == len(pending) // N >= 1
    # a resumed run: the saved queue first, then the generator from next_index; nothing made twice or lost
    ledger2 = Ledger()
    ledger2.made(torch.tensor(pending))
    resumed = AsyncRollouts(make, {"w": torch.tensor(3.0)}, version=3, k=2, ledger=ledger2, spec=SPEC,
                            next_index=next_index, queue=saved)  # fmt: skip
    got = drive(resumed, 4, start=3)
    resumed.close()
    ids = [i for b, _ in got for i in b["ids"].tolist()]
    assert ids[: len(pending)] == pending  # the saved batches come first, in order
    assert sorted(ids) == list(range(3 * N, 7 * N))  # then the next ones: none lost, none repeated
    assert ledger2.unaccounted(resumed.pending_ids()) == set()


def test_a_failing_generator_surfaces_in_the_trainer():
    make, _ = make_factory(fail_at=2)
    source = AsyncRollouts(make, {"w": torch.tensor(0.0)}, version=0, k=1, ledger=Ledger(), spec=SPEC)
    with pytest.raises(ValueError, match="generator thread failed: boom"):
        drive(source, 5)
    source.close()
    assert not any(t.name == "ftitan-rollouts" and t.is_alive() for t in threading.enumerate())


# -- the generator in a separate process (ProcessRollouts): the same guarantees across a process boundary


def child_factory(monkeypatch, delay: float, fail_at: int | None = None):
    """``_rollout_child.make_factory`` by reference: its module on sys.path, which the spawned child inherits."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    import _rollout_child

    return functools.partial(_rollout_child.make_factory, N, delay, fail_at)


PSPEC = {**SPEC, "w": ((N,), torch.float32)}


def test_a_generator_process_keeps_every_guarantee(monkeypatch):
    ledger = Ledger()
    source = ProcessRollouts(child_factory(monkeypatch, 0.05), {"w": torch.tensor(0.0)}, version=0, k=1,
                             ledger=ledger, spec=PSPEC, threads=1)  # fmt: skip
    got = drive(source, 6, train_time=0.1)
    with source.paused() as (queue, next_index):  # a checkpoint: nothing in flight, the queue as tensors
        n, pending = int(queue["n"]), source.pending_ids()
        assert n * N == len(pending) and next_index == 6 + n
    got += drive(source, 4, train_time=0.1, start=6)
    source.close()
    assert all(lag <= 1 for _, lag in got) and max(lag for _, lag in got) == 1  # it ran ahead
    for (batch, lag), step in zip(got, range(10), strict=True):
        # the weights crossed the process boundary whole: a batch's params are the version it is filed under
        assert torch.equal(batch["w"], torch.full((N,), float(step - lag)))
    trained = [i for b, _ in got for i in b["ids"].tolist()]
    assert len(trained) == len(set(trained)) == 10 * N
    assert ledger.unaccounted(source.pending_ids()) == set()  # closing drained the child: nothing in flight lost
    assert not source._proc.is_alive()


def test_a_failing_generator_process_surfaces_its_traceback(monkeypatch):
    source = ProcessRollouts(child_factory(monkeypatch, 0.0, fail_at=2), {"w": torch.tensor(0.0)}, version=0, k=1,
                             ledger=Ledger(), spec=PSPEC, threads=1)  # fmt: skip
    with pytest.raises(ValueError, match="generator process failed: boom in the child") as info:
        drive(source, 5)
    source.close()
    assert not source._proc.is_alive()
    assert "_rollout_child.py" in "".join(info.value.__cause__.__notes__)  # the child's traceback comes along
