import json

import pytest

from ftitan.data import corpus
from ftitan.data.corpus import jsonl, stdlib_corpus, stdlib_files, text_files


def test_stdlib_files_are_deterministic_and_sorted():
    a = stdlib_files(split="all")
    assert a == stdlib_files(split="all")
    assert a == sorted(a)


def test_split_is_disjoint_and_covers_everything():
    train, held_out, everything = (set(stdlib_files(split=s)) for s in ("train", "eval", "all"))
    assert not train & held_out
    assert train | held_out == everything
    assert 0.005 < len(held_out) / len(everything) < 0.05


def test_split_hash_is_stable_across_processes():
    # a golden value: breaks if someone swaps blake2b for the per-process salted hash()
    assert corpus._eval_bucket("json/decoder.py") == corpus._eval_bucket("json/decoder.py")
    assert corpus._eval_bucket("json/decoder.py") == 877


def test_stdlib_corpus_is_several_megabytes_of_source():
    docs = list(stdlib_corpus(split="train"))
    assert sum(map(len, docs)) > 3_000_000
    assert any("def " in d for d in docs)
    assert list(stdlib_corpus(split="eval"))  # the held-out split is never empty


def test_excluded_directories(tmp_path):
    for rel in ["a.py", "pkg/b.py", "test/test_a.py", "pkg/tests/t.py", "site-packages/x/y.py",
                "idlelib/i.py", "notes.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    files = stdlib_files(split="all", root=tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in files] == ["a.py", "pkg/b.py"]
    assert list(stdlib_corpus(split="all", root=tmp_path)) == ["# a.py\n", "# pkg/b.py\n"]
    assert not any("site-packages" in str(p) for p in stdlib_files(split="all"))


def test_bad_split_names_the_choices():
    with pytest.raises(ValueError, match="'train', 'eval' or 'all'"):
        stdlib_files(split="test")


def test_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("héllo")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe")
    assert list(text_files([tmp_path / "a.txt"])) == ["héllo"]
    with pytest.raises(ValueError, match="b.txt is not valid UTF-8"):
        list(text_files([tmp_path / "b.txt"]))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        list(text_files([tmp_path / "missing.txt"]))


def test_jsonl_reads_field_and_skips_blank_lines(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "body": "b"}) + "\n")
    assert list(jsonl(f)) == ["one", "two"]
    with pytest.raises(ValueError, match=r"d.jsonl:1: object has no field 'body'"):
        list(jsonl(f, field="body"))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": 3}', "field 'text' must be a string"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n' + line + "\n")
    docs = jsonl(f)
    assert next(docs) == "fine"
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: {message}"):
        next(docs)


def test_invalid_json_says_where_once(tmp_path):
    f = tmp_path / "torn.jsonl"
    f.write_text('{"text": "fine"}\n{"text": "cut sho')  # the last line, cut off
    with pytest.raises(ValueError) as e:
        list(jsonl(f))
    assert "torn.jsonl:2: invalid JSON (Unterminated string starting at column 10)" in str(e.value)
    assert "at at" not in str(e.value)
