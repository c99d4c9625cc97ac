"""The lane stream: same global batches on any data-parallel degree, resumable anywhere, every document once."""

import hashlib
import io
import json
import math

import pytest
import torch

import ftitan.data as fd
from ftitan.data import loader as loader_module

from ._helpers import assert_same, assert_same_state, texts, write_jsonl, write_parquet

B, T = 8, 16


@pytest.fixture
def corpus(tmp_path):
    docs = texts(150)
    for k in range(3):
        write_jsonl(tmp_path / f"s{k}.jsonl", docs[k * 40 : (k + 1) * 40])
    write_parquet(tmp_path / "p.parquet", docs[120:140], row_group_size=5)
    for i, t in enumerate(docs[140:]):
        (tmp_path / f"t{i}.txt").write_text(t)
    return fd.shards(tmp_path, chunk_bytes=300), docs  # ~40 chunks


def run(src, tok, state, *, dp_size, steps, eval_fraction=0.02, segments=False):
    """Global batches (rank slices concatenated) and the merged state after ``steps``."""
    streams = [fd.stream_batches(src, tok, state, seq_len=T, batch_size=B, dp_rank=r, dp_size=dp_size,
                                 eval_fraction=eval_fraction, segments=segments) for r in range(dp_size)]  # fmt: skip
    batches = []
    for _ in range(steps):
        parts = [next(s) for s in streams]
        batches.append({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    return batches, fd.merge_states([s.state for s in streams])


def lane_tokens(batches, j) -> list[int]:
    """Lane j's token sequence: its row of each batch, T + 1 tokens (inputs plus the last target)."""
    return [t for b in batches for t in [*b["inputs"][j].tolist(), int(b["targets"][j, -1])]]


def split_docs(tokens, eos) -> list[list[int]]:
    """Complete documents (up to each EOS); a trailing partial one is dropped."""
    docs, cur = [], []
    for t in tokens:
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return docs


def test_batches_and_state(corpus, small_tokenizer):
    src, _ = corpus
    state = fd.init_stream_state(0, B)
    assert all(t.dtype == torch.int64 for t in state) and state.chunk.tolist() == list(range(B))
    batches, after = run(src, small_tokenizer, state, dp_size=2, steps=1)
    (batch,) = batches
    assert set(batch) == {"inputs", "targets"}
    for v in batch.values():
        assert v.shape == (B, T) and v.dtype == torch.int64 and v.is_contiguous()
    assert torch.equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert int(after.num_chunks) == src.num_chunks > B
    assert after.epoch.tolist() == [0] * B


def test_same_global_batches_and_state_for_every_dp_degree(corpus, small_tokenizer):
    src, _ = corpus
    state = fd.init_stream_state(3, B)
    ref, ref_state = run(src, small_tokenizer, state, dp_size=1, steps=90)
    assert int(ref_state.epoch.max()) >= 1  # the run crosses an epoch boundary
    for d in (2, 4, 8):
        got, got_state = run(src, small_tokenizer, state, dp_size=d, steps=90)
        assert_same(got, ref)
        assert_same_state(got_state, ref_state)  # canonical: the same position whatever d ran it


def test_resume_on_another_degree_and_bit_identical_on_the_same(corpus, small_tokenizer):
    src, _ = corpus
    start = fd.init_stream_state(5, B)
    full, full_state = run(src, small_tokenizer, start, dp_size=1, steps=90)
    first, saved = run(src, small_tokenizer, start, dp_size=2, steps=33)
    buf = io.BytesIO()
    torch.save(saved._asdict(), buf)
    buf.seek(0)
    loader_module._randperm.cache_clear()  # as in a fresh process
    restored = fd.StreamState(**torch.load(buf))
    for d in (4, 1, 2):
        rest, end = run(src, small_tokenizer, restored, dp_size=d, steps=57)
        assert_same(first + rest, full)
        assert_same_state(end, full_state)


def test_every_document_once_per_epoch(corpus, small_tokenizer):
    src, docs = corpus
    tok, b = small_tokenizer, 4
    state = fd.init_stream_state(1, b)
    total = sum(len(tok.encode(d)) + 1 for d in docs)
    steps = math.ceil(2.6 * total / (b * (T + 1)))
    streams = fd.stream_batches(src, tok, state, seq_len=T, batch_size=b, eval_fraction=0.0)
    batches = [next(streams) for _ in range(steps)]
    assert int(streams.state.epoch.min()) >= 2
    # the order the lanes must follow, built from the rule: chunk places j, j + b, ...; epoch e shuffles chunks
    n = src.num_chunks
    chunk_docs = [list(src.records(c)) for c in range(n)]
    per_epoch: dict[int, list[str]] = {}
    for j in range(b):
        got = [tok.decode(ids) for ids in split_docs(lane_tokens(batches, j), tok.eos_id)]
        expected, place = [], j
        while len(expected) < len(got):
            epoch, i = divmod(place, n)
            chunk = int(fd.epoch_order(state.key, epoch, n)[i])
            expected += [(epoch, d) for d in chunk_docs[chunk]]
            place += b
        assert got == [d for _, d in expected[: len(got)]]
        for epoch, d in expected[: len(got)]:
            per_epoch.setdefault(epoch, []).append(d)
    for epoch in (0, 1):  # every lane is past them: each document exactly once in each
        assert sorted(per_epoch[epoch]) == sorted(docs)


def _held(text: str, fraction: float) -> bool:
    # the documented rule, computed independently: blake2b-64 of the UTF-8 text, mod 10,000
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % 10_000
    return h < round(fraction * 10_000)


def test_hash_held_out_split(corpus, small_tokenizer):
    src, _ = corpus
    tok, frac = small_tokenizer, 0.2
    held = [d for d in src.documents() if _held(d, frac)]  # in file order
    assert 10 < len(held) < 50
    batches, _ = run(src, tok, fd.init_stream_state(0, B), dp_size=1, steps=30, eval_fraction=frac)
    trained = {tok.decode(ids) for j in range(B) for ids in split_docs(lane_tokens(batches, j), tok.eos_id)}
    assert trained and not trained & set(held)
    evals = list(fd.held_out_batches(src, tok, seq_len=T, batch_size=B, eval_fraction=frac))
    assert all(e["inputs"].shape == (B, T) for e in evals[:-1])
    stream = [t for e in evals for row in range(len(e["inputs"]))
              for t in [*e["inputs"][row].tolist(), int(e["targets"][row, -1])]]  # fmt: skip
    packed = [t for d in held for t in [*tok.encode(d), tok.eos_id]]
    assert len(stream) == len(packed) // (T + 1) * (T + 1)  # every full held-out row, once
    assert stream == packed[: len(stream)]  # in file order, unshuffled
    # data-parallel slices of the same global eval batches (the last one cut to a multiple of dp_size)
    halves = [list(fd.held_out_batches(src, tok, seq_len=T, batch_size=B, eval_fraction=frac, dp_rank=r,
                                       dp_size=2)) for r in range(2)]  # fmt: skip
    joined = torch.cat([torch.cat([a["inputs"], b["inputs"]]) for a, b in zip(*halves, strict=True)])
    all_rows = torch.cat([e["inputs"] for e in evals])
    assert torch.equal(joined, all_rows[: len(all_rows) // 2 * 2])


def test_single_document_falls_back_to_a_held_out_tail(tmp_path, small_tokenizer, small_docs):
    tok = small_tokenizer
    (tmp_path / "one.txt").write_text(small_docs[0])
    src = fd.shards(tmp_path)
    packed = [*tok.encode(small_docs[0]), tok.eos_id]
    held = max(math.ceil(0.02 * len(packed)), T + 1)
    cut = len(packed) - held
    stream = fd.stream_batches(src, tok, fd.init_stream_state(0, 2), seq_len=T, batch_size=2)
    batches = [next(stream) for _ in range(3 * cut // (T + 1))]
    # one chunk: lane 0 reads it in epochs 0, 2, 4, ...; each time only the train head, without its EOS
    lane0 = lane_tokens(batches, 0)
    assert lane0 == (packed[:cut] * 3)[: len(lane0)]
    evals = list(fd.held_out_batches(src, tok, seq_len=T, batch_size=4))
    rows = torch.cat([torch.cat([e["inputs"], e["targets"][:, -1:]], 1) for e in evals])
    assert rows.flatten().tolist() == packed[cut : cut + held // (T + 1) * (T + 1)]


def test_held_out_documents_shorter_than_a_row_fall_back_to_a_tail(tmp_path, small_tokenizer, small_docs):
    from ftitan.data.heldout import _bucket, held_out

    tiny = next(t for i in range(10_000) if _bucket(t := f"tiny {i}") < 200)  # held out by its hash, a few tokens
    assert _bucket(small_docs[0]) >= 200
    (tmp_path / "two.jsonl").write_text(json.dumps({"text": small_docs[0]}) + "\n" + json.dumps({"text": tiny}) + "\n")
    split = held_out(fd.shards(tmp_path), small_tokenizer, seq_len=T, eval_fraction=0.02)
    assert split.mode == "tail"  # the hash split's held-out side would not fill one row
    assert next(fd.held_out_batches(fd.shards(tmp_path), small_tokenizer, seq_len=T, batch_size=2))["inputs"].shape[1] == T


def test_segments_mark_document_starts(corpus, small_tokenizer):
    src, _ = corpus
    batches, _ = run(src, small_tokenizer, fd.init_stream_state(0, B), dp_size=2, steps=6, segments=True)
    plain, _ = run(src, small_tokenizer, fd.init_stream_state(0, B), dp_size=2, steps=6)
    eos = small_tokenizer.eos_id
    for b, p in zip(batches, plain, strict=True):
        assert torch.equal(b["inputs"], p["inputs"]) and torch.equal(b["targets"], p["targets"])
        x, seg, pos = b["inputs"], b["segment_ids"], b["positions"]
        assert seg.shape == pos.shape == x.shape and seg.dtype == pos.dtype == torch.int64
        assert (seg[:, 0] == 0).all()
        starts = x[:, :-1] == eos  # a token after an EOS starts a new document
        assert torch.equal(seg[:, 1:] - seg[:, :-1], starts.long())
        assert torch.equal(pos[:, 1:], torch.where(starts, 0, pos[:, :-1] + 1))


def test_errors(corpus, small_tokenizer, tmp_path):
    src, _ = corpus
    tok = small_tokenizer

    def make(state, **kw):
        return fd.stream_batches(src, tok, state, seq_len=T, **{"batch_size": B, **kw})

    with pytest.raises(ValueError, match="the state has 8 lanes but batch_size=4"):
        make(fd.init_stream_state(0, B), batch_size=4)
    with pytest.raises(ValueError, match="positive multiple of dp_size=3"):
        make(fd.init_stream_state(0, B), dp_size=3)
    with pytest.raises(ValueError, match=r"dp_rank=2 is outside \[0, dp_size=2\)"):
        make(fd.init_stream_state(0, B), dp_rank=2, dp_size=2)
    other = fd.init_stream_state(0, B)._replace(num_chunks=torch.tensor(3))
    with pytest.raises(ValueError, match=f"saved for a source of 3 chunks, this one has {src.num_chunks}"):
        make(other)
    bad = fd.init_stream_state(0, B)
    bad.chunk[1] = 2
    with pytest.raises(ValueError, match="lane 1 has chunk 2"):
        make(bad)
    with pytest.raises(ValueError, match="merge_states: 3 states cannot split 8 lanes"):
        fd.merge_states([bad] * 3)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="hold no records"):
        fd.stream_batches(fd.shards(tmp_path / "empty.jsonl"), tok, fd.init_stream_state(0, 2), seq_len=T,
                          batch_size=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"eval_fraction must be in \[0, 1\], got 1.5"):
        make(fd.init_stream_state(0, B), eval_fraction=1.5)
    with pytest.raises(ValueError, match="without a training document"):
        next(make(fd.init_stream_state(0, B), eval_fraction=1.0))


def test_stream_reads_lazily_and_reports_bad_records(tmp_path, small_tokenizer):
    path = tmp_path / "d.jsonl"
    good = "".join(json.dumps({"text": t}) + "\n" for t in texts(400))
    path.write_text(good + "{broken\n")
    src = fd.shards(path, chunk_bytes=1 << 30)  # one chunk: every lane reads the same file, each in its epoch
    stream = fd.stream_batches(src, small_tokenizer, fd.init_stream_state(0, 2), seq_len=T, batch_size=2,
                               eval_fraction=0.0)  # fmt: skip
    next(stream)  # the broken last line is far ahead: not read yet
    with pytest.raises(ValueError, match=r"d\.jsonl:401: invalid JSON"):
        for _ in range(10_000):
            next(stream)


def test_gather_state_with_a_process_group(corpus, small_tokenizer, tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up")
    src, _ = corpus
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        stream = fd.stream_batches(src, small_tokenizer, fd.init_stream_state(0, B), seq_len=T, batch_size=B)
        next(stream)
        assert_same_state(fd.gather_state(stream.state), stream.state)
    finally:
        dist.destroy_process_group()
