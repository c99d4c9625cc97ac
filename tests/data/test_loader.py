import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftitan import random
from ftitan.data import LoaderState, PackedDataset, epoch_order, eval_batches, init_loader_state, next_batch
from ftitan.data import loader as loader_module

SEQ_LEN = 4


def numbered_rows(num_rows: int) -> PackedDataset:
    # row i holds tokens i*(T+1) .. i*(T+1)+T, so a row's id is its first token // (T+1)
    return PackedDataset(torch.arange(num_rows * (SEQ_LEN + 1), dtype=torch.int32).view(num_rows, SEQ_LEN + 1))


def row_ids(batch) -> list[int]:
    return (batch["inputs"][:, 0] // (SEQ_LEN + 1)).tolist()


def run(dataset, state, batch_size, steps):
    batches = []
    for _ in range(steps):
        batch, state = next_batch(dataset, state, batch_size)
        batches.append(batch)
    return batches, state


def test_batch_shapes_dtypes_and_shift():
    ds = numbered_rows(10)
    batch, state = next_batch(ds, init_loader_state(0), 3)
    assert set(batch) == {"inputs", "targets"}
    for v in batch.values():
        assert v.shape == (3, SEQ_LEN) and v.dtype == torch.int64 and v.is_contiguous()
    assert torch.equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert isinstance(state, LoaderState)
    assert all(t.dtype == torch.int64 and t.dim() == 0 for t in state)
    assert (int(state.epoch), int(state.position)) == (0, 3)


@settings(max_examples=30, deadline=None)
@given(num_rows=st.integers(1, 23), batch_size=st.integers(1, 30), seed=st.integers(0, 2**40))
def test_every_row_once_per_epoch(num_rows, batch_size, seed):
    ds = numbered_rows(num_rows)
    epochs = 3
    steps = -(-epochs * num_rows // batch_size)
    batches, state = run(ds, init_loader_state(seed), batch_size, steps)
    seen = [i for b in batches for i in row_ids(b)]
    assert all(len(b["inputs"]) == batch_size for b in batches)  # batches are always full
    for e in range(epochs):
        in_epoch = seen[e * num_rows : (e + 1) * num_rows]
        assert sorted(in_epoch) == list(range(num_rows))
        assert in_epoch == epoch_order(state.key, e, num_rows).tolist()
    assert int(state.epoch) * num_rows + int(state.position) == steps * batch_size


def test_epochs_and_seeds_change_the_order():
    n = 50
    k = random.key(7)
    orders = [epoch_order(k, e, n).tolist() for e in range(3)]
    assert orders[0] != orders[1] != orders[2]
    assert epoch_order(random.key(8), 0, n).tolist() != orders[0]
    assert epoch_order(k, 0, n).tolist() == orders[0]


def test_resume_from_saved_state_is_bit_identical():
    ds = numbered_rows(13)
    full, _ = run(ds, init_loader_state(3), 5, 12)  # crosses several epoch boundaries
    first, state = run(ds, init_loader_state(3), 5, 4)  # stop mid-epoch (position 7 of epoch 1)
    assert (int(state.epoch), int(state.position)) == (1, 7)
    buf = io.BytesIO()
    torch.save(state._asdict(), buf)
    buf.seek(0)
    loader_module._randperm.cache_clear()  # as in a fresh process
    restored = LoaderState(**torch.load(buf))
    rest, _ = run(ds, restored, 5, 8)
    assert len(first + rest) == len(full)
    for a, b in zip(first + rest, full, strict=True):
        assert torch.equal(a["inputs"], b["inputs"]) and torch.equal(a["targets"], b["targets"])


def test_init_from_a_key():
    k = random.key(5)
    assert torch.equal(init_loader_state(k).key, k)
    assert torch.equal(init_loader_state(5).key, k)
    with pytest.raises(TypeError, match="expected a key"):
        init_loader_state(torch.tensor(1.0))


def test_errors():
    ds = numbered_rows(4)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next_batch(ds, init_loader_state(0), 0)
    bad = init_loader_state(0)._replace(position=torch.tensor(4))
    with pytest.raises(ValueError, match="position=4 is outside"):
        next_batch(ds, bad, 2)


def test_eval_batches_cover_rows_in_order():
    ds = numbered_rows(7)
    batches = list(eval_batches(ds, 3))
    assert [len(b["inputs"]) for b in batches] == [3, 3, 1]
    assert [i for b in batches for i in row_ids(b)] == list(range(7))
    assert all(b["targets"].dtype == torch.int64 for b in batches)
