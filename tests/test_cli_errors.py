"""Every bad input to ``ftitan train`` / ``generate``: one line naming the culprit and the fix, exit status 2,
no traceback, nothing lost. Run in-process (``ftitan.__main__.main``) to stay fast."""

import json
import os

import pytest
import torch

from ftitan.__main__ import main
from ftitan.train import memory

# a model of 1 layer, dim 32 and a BPE of 300 tokens: a step takes milliseconds
TINY = ["--model.n-layers", "1", "--model.dim", "32", "--model.n-heads", "2", "--model.n-kv-heads", "1",
        "--model.ffn-dim", "48", "--data.seq-len", "16", "--data.batch-size", "2", "--steps", "2", "--optim.warmup",
        "1", "--compile", "False", "--eval-every", "0", "--eval-batches", "1", "--data.vocab-size", "300",
        "--model.vocab-size", "300"]  # fmt: skip


@pytest.fixture()
def corpus(tmp_path):
    f = tmp_path / "corpus.jsonl"
    f.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(200)))
    return f


def one_error_line(capsys, rc):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("ftitan train: error: ")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_non_finite_settings_are_refused(capsys, corpus, tmp_path):
    for flag, value in (("--optim.lr", "inf"), ("--optim.clip", "nan"), ("--optim.weight-decay", "inf")):
        rc = main(["train", *TINY, "--data.corpus", str(corpus), "--run-dir", str(tmp_path / "r"), flag, value])
        assert f"{flag}={float(value)!r}: must be a finite number" in one_error_line(capsys, rc)
    with pytest.raises(SystemExit) as e:  # the model's own check, in tyro's box (as for --model.dim 100)
        main(["train", *TINY, "--run-dir", str(tmp_path / "r"), "--model.init-std", "inf"])
    assert e.value.code == 2 and "init_std=inf: must be a finite number > 0" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_unusable_run_dirs_are_refused_before_any_work(capsys, corpus, tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "ck" / "checkpoints").parent.mkdir()
    (tmp_path / "ck" / "checkpoints").write_text("x")
    cases = [
        (str(tmp_path / "a_file"), "the run directory {} is a file".format(tmp_path / "a_file")),
        (str(tmp_path / "ck"), "its checkpoints directory {} is a file".format(tmp_path / "ck" / "checkpoints")),
        (str(tmp_path / "{foo}"), "only {recipe} is filled in (KeyError: 'foo')"),
        (str(tmp_path / "{"), "only {recipe} is filled in (ValueError: Single '{'"),
        ("", "name a directory for the run's files"),
    ]
    for run_dir, message in cases:
        rc = main(["train", *TINY, "--data.corpus", str(corpus), "--run-dir", run_dir])
        assert message in one_error_line(capsys, rc)
    # a read-only parent (checked with os.access: root may write anywhere, so the test pretends)
    (tmp_path / "ro").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(tmp_path / "ro") and real_access(p, mode))
    rc = main(["train", *TINY, "--data.corpus", str(corpus), "--run-dir", str(tmp_path / "ro" / "run")])
    assert f"{tmp_path / 'ro'} is not writable by this user" in one_error_line(capsys, rc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "ck", "corpus.jsonl", "ro"]  # nothing written
    assert not any((tmp_path / "ro").iterdir())


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", b"", "1 tokens in all, too few for a held-out tail"),
        ("latin1.txt", "café".encode("latin-1"), "latin1.txt: not valid UTF-8"),
        ("torn.jsonl", b'{"text": "a"}\n{"text": "b', "torn.jsonl:2: invalid JSON (Unterminated string starting at column"),
        ("other.jsonl", b'{"body": "a"}\n', "other.jsonl:1: object has no field 'text' (fields: ['body']); pass "
                                            "field=... (--data.jsonl-field)"),
        ("number.jsonl", b'{"text": 3}\n', "number.jsonl:1: field 'text' must be a string, got int"),
    ],
)  # fmt: skip
def test_bad_corpora_fail_in_one_line(capsys, tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    rc = main(["train", *TINY, "--data.corpus", str(tmp_path / name), "--run-dir", str(tmp_path / "r")])
    assert message in one_error_line(capsys, rc)


def test_a_single_document_with_a_short_bpe_and_intervals_of_0_trains_and_resumes(capsys, tmp_path):
    doc = tmp_path / "book.txt"  # one document: its token tail is the held-out split; too few merges for 2048
    doc.write_text(" ".join(f"word{i % 97} and more{i % 13}" for i in range(3000)))
    run = tmp_path / "r"
    args = ["train", *TINY, "--data.corpus", str(doc), "--run-dir", str(run), "--data.vocab-size", "2048",
            "--model.vocab-size", "2048", "--log-every", "0", "--eval-every", "0", "--ckpt-every", "0"]  # fmt: skip
    assert main(args) == 0
    assert "ftitan train: warning: BPE: the corpus gave" in capsys.readouterr().err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "loss" in r, "eval_loss" in r) for r in records] == [(2, True, False), (2, False, True)]
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_00000002"]
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # a run killed while writing its metrics
    assert main([*args, "--resume", "--steps", "3"]) == 0  # the same command resumes with the short BPE
    err = capsys.readouterr().err
    assert "metrics.jsonl:3: dropping a torn last line" in err and "Traceback" not in err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [2, 2, 3, 3]
    tok = run / "tokenizer.json"
    tok.write_text(tok.read_text()[:100])  # a copy cut short
    line = one_error_line(capsys, main([*args, "--resume", "--steps", "4"]))
    assert f"{tok}: not a readable tokenizer" in line and "delete it and run again" in line


def test_a_model_too_large_for_memory_is_refused_before_any_work(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 64 << 30)  # whatever this machine has
    rc = main(["train", "--recipe", "llama3-8b", "--device", "cpu", "--run-dir", str(tmp_path / "r")])
    line = one_error_line(capsys, rc)
    assert "training this llama model (8.03B params) needs at least" in line and "68.7 GB is available" in line
    assert not (tmp_path / "r").exists()  # no tokenizer trained, nothing allocated


def test_out_of_memory_is_one_line_and_bugs_keep_their_traceback(capsys, corpus, tmp_path, monkeypatch):
    import ftitan.train.trainer as trainer

    def raises(err):
        def train(cfg, **kwargs):
            raise err

        return train

    args = ["train", *TINY, "--data.corpus", str(corpus), "--run-dir", str(tmp_path / "r")]
    monkeypatch.setattr(trainer, "train", raises(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")))
    line = one_error_line(capsys, main(args))
    assert "out of memory on --device cpu (asked for 3.00 GiB more)" in line and "--data.batch-size 2" in line
    monkeypatch.setattr(trainer, "train", raises(KeyError("a bug")))
    with pytest.raises(KeyError):
        main(args)
    monkeypatch.setattr(trainer, "train", raises(ValueError("a bad setting")))
    monkeypatch.setenv("FTITAN_TRACEBACK", "1")
    with pytest.raises(ValueError, match="a bad setting"):
        main(args)
