import json
import threading
import time

import pytest
import torch

import ftitan.data as fd

from ._helpers import assert_same, assert_same_state, texts, write_jsonl

B, T = 4, 16


@pytest.fixture
def src(tmp_path):
    for k in range(4):
        write_jsonl(tmp_path / f"s{k}.jsonl", texts(160)[k * 40 : (k + 1) * 40])
    return fd.shards(tmp_path, chunk_bytes=400)


def make(src, tok, state=None, **kw):
    state = fd.init_stream_state(0, B) if state is None else state
    return fd.stream_batches(src, tok, state, seq_len=T, **{"batch_size": B, **kw})


def test_same_batches_and_state_as_the_synchronous_stream(src, small_tokenizer):
    sync = make(src, small_tokenizer, dp_rank=1, dp_size=2)
    expected, states = [], []
    for _ in range(12):
        expected.append(next(sync))
        states.append(sync.state)
    with fd.prefetch(make(src, small_tokenizer, dp_rank=1, dp_size=2), depth=3) as batches:
        assert_same_state(batches.state, fd.init_stream_state(0, B)._replace(num_chunks=torch.tensor(src.num_chunks)))
        got = []
        for i in range(12):
            got.append(next(batches))
            if i == 4:
                deadline = time.monotonic() + 5
                while not batches._ready.full() and time.monotonic() < deadline:  # let the worker run ahead
                    time.sleep(0.01)
                assert batches._ready.full()
            # the position after the batch handed out, not after the worker's read-ahead
            assert_same_state(batches.state, states[i])
        assert_same(got, expected)
    # resuming from the prefetcher's state continues exactly where the caller was
    resumed = make(src, small_tokenizer, states[5], dp_rank=1, dp_size=2)
    assert_same([next(resumed) for _ in range(6)], expected[6:])


def test_worker_exception_surfaces_with_its_message(tmp_path, small_tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine " * 40}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    batches = fd.prefetch(make(fd.shards(path), small_tokenizer, fd.init_stream_state(0, 1), batch_size=1,
                               eval_fraction=0.0))  # fmt: skip
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: object has no field 'text'"):
        for _ in range(100):
            next(batches)
    assert not batches._thread.is_alive()


def test_close_stops_the_worker(src, small_tokenizer):
    before = threading.active_count()
    batches = fd.prefetch(make(src, small_tokenizer), depth=2)
    next(batches)
    batches.close()
    assert not batches._thread.is_alive() and batches._thread.daemon
    assert threading.active_count() == before
    with pytest.raises(RuntimeError, match="after close"):
        next(batches)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        fd.prefetch(make(src, small_tokenizer), depth=0)


def test_loader_throughput(src, small_tokenizer):
    r = fd.loader_throughput(src, small_tokenizer, seq_len=T, batch_size=B, batches=5)
    assert r["tokens"] == 5 * B * T and r["tokens_per_s"] > 0 and r["seconds"] > 0
