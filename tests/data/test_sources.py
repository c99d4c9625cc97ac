import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ftitan.data import shards
from ftitan.data.sources import Chunk

from ._helpers import write_jsonl, write_parquet


def all_records(src):
    return [list(src.records(c)) for c in range(src.num_chunks)]


def test_every_kind_is_read_in_order(tmp_path):
    write_parquet(tmp_path / "b.parquet", [f"p{i}" for i in range(10)])
    write_jsonl(tmp_path / "a.jsonl", [f"j{i}" for i in range(5)], blank_every=2)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("whole file\nis one document")
    (tmp_path / "sub" / ".hidden.txt").write_text("skipped: a dot file")
    (tmp_path / "notes.md").write_text("skipped: not a shard type")
    src = shards(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in src.files] == ["a.jsonl", "b.parquet", "sub/c.txt"]
    docs = list(src.documents())
    assert docs == [f"j{i}" for i in range(5)] + [f"p{i}" for i in range(10)] + ["whole file\nis one document"]
    # chunks: one JSONL range, three row groups (4 + 4 + 2 rows), one text file
    assert src.chunks == (Chunk(0, 0, (tmp_path / "a.jsonl").stat().st_size), Chunk(1, 0, 1), Chunk(1, 1, 2),
                          Chunk(1, 2, 3), Chunk(2, 0, 1))  # fmt: skip
    assert [len(r) for r in all_records(src)] == [5, 4, 4, 2, 1]


def test_globs_lists_and_fields(tmp_path):
    for k in range(3):
        write_jsonl(tmp_path / f"s{k}.jsonl", [f"{k}-{i}" for i in range(2)], field="body")
    write_parquet(tmp_path / "p.parquet", ["x", "y"], field="body")
    src = shards(str(tmp_path / "s*.jsonl"), field="body")
    assert [f.name for f in src.files] == ["s0.jsonl", "s1.jsonl", "s2.jsonl"]
    assert list(src.documents()) == ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]
    mixed = shards([tmp_path / "p.parquet", str(tmp_path / "**" / "s1.jsonl")], field="body")
    assert list(mixed.documents()) == ["x", "y", "1-0", "1-1"]


def test_jsonl_byte_chunks_cover_every_line_once(tmp_path):
    texts = [f"doc {i} " + "x" * (i * 7 % 50) for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", texts, blank_every=3)
    for chunk_bytes in (1, 17, 64, 100, 10_000):
        src = shards(path, chunk_bytes=chunk_bytes)
        assert [d for r in all_records(src) for d in r] == texts, chunk_bytes
        assert src.num_chunks == -(-path.stat().st_size // chunk_bytes)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_records_resume_at_any_record(tmp_path, kind):
    texts = [f"t{i}" for i in range(11)]
    if kind == "jsonl":
        src = shards(write_jsonl(tmp_path / "d.jsonl", texts, blank_every=4), chunk_bytes=60)
    elif kind == "parquet":
        src = shards(write_parquet(tmp_path / "d.parquet", texts, row_group_size=3))
    else:
        for i, t in enumerate(texts):
            (tmp_path / f"{i:02d}.txt").write_text(t)
        src = shards(tmp_path)
    assert src.num_chunks > 1
    for c, records in enumerate(all_records(src)):
        for start in range(len(records) + 1):
            assert list(src.records(c, start)) == records[start:]
        with pytest.raises(ValueError, match="asks for record"):
            list(src.records(c, len(records) + 1))


def test_listing_errors(tmp_path):
    (tmp_path / "a.csv").write_text("x")
    (tmp_path / "empty").mkdir()
    write_jsonl(tmp_path / "d.jsonl", ["x"])
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl does not exist"):
        shards(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'; use \.parquet"):
        shards(tmp_path / "a.csv")
    with pytest.raises(FileNotFoundError, match="holds no"):
        shards(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="matches no"):
        shards(str(tmp_path / "*.nothing"))
    with pytest.raises(ValueError, match="listed twice"):
        shards([tmp_path, tmp_path / "d.jsonl"])
    with pytest.raises(ValueError, match="no paths"):
        shards([])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"{not json", "invalid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"body": "x"}', "object has no field 'text'"),
        (b'{"text": null}', "field 'text' must be a string"),
        (b'{"text": "\xff"}', "not valid UTF-8"),
    ],
)
def test_malformed_jsonl_names_file_line_and_fix(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n\n{"text": "fine"}\n' + line + b"\n")
    src = shards(path, chunk_bytes=20)  # the bad line is in a later chunk: its number is still right
    with pytest.raises(ValueError, match=rf"bad\.jsonl:4: {message}.*(fix or remove|field=)"):
        list(src.documents())


def test_malformed_parquet_and_text(tmp_path):
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"null\.parquet: row 1: column 'text' is null"):
        list(shards(tmp_path / "null.parquet").documents())
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints\.parquet: column 'text' has type int64, not string"):
        list(shards(tmp_path / "ints.parquet").documents())
    with pytest.raises(ValueError, match=r"no column 'body' \(columns: \['text'\]\)"):
        list(shards(tmp_path / "ints.parquet", field="body").documents())
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"bad\.txt: not valid UTF-8"):
        list(shards(tmp_path / "bad.txt").documents())


def test_jsonl_is_read_lazily(tmp_path):
    # a malformed last line is only met when reading gets there: nothing parses the file ahead
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(1000)) + "{broken\n")
    records = shards(path).records(0)
    assert [next(records) for _ in range(3)] == ["d0", "d1", "d2"]
    with pytest.raises(ValueError, match=r"big\.jsonl:1001: invalid JSON"):
        list(records)


def test_parquet_is_read_one_batch_at_a_time(tmp_path):
    # Arrow's allocations while the first document is out: about a row group (0.6 MB), not the file's 12 MB
    texts = ["x" * 3000 + str(i) for i in range(4000)]
    path = write_parquet(tmp_path / "big.parquet", texts, row_group_size=200)
    src = shards(path)
    records = src.records(3)
    base = pa.total_allocated_bytes()
    assert next(records) == texts[600]
    held = pa.total_allocated_bytes() - base
    assert held < 3_000_000, held
    records.close()
