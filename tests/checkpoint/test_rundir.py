"""One run per run directory: a reused directory is refused unless the run is resumed with the same
model and data, or ``--overwrite`` clears it; ``--resume`` below the run's step says so."""

import json
import shutil

import attrs
import pytest

import ftitan as ft
from ftitan.checkpoint import RunDir, RunDirError
from ftitan.train.trainer import train


def _steps_of(run):
    return [ft.checkpoint._layout.step_of(p) for p in ft.checkpoint.list_checkpoints(run / "checkpoints")]


def _snapshot(run):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def _trained(tmp_path_factory):
    from ftitan.config import parse_train_args

    root = tmp_path_factory.mktemp("finished")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(200)))
    cfg = parse_train_args([
        "--run-dir", str(root / "run"), "--data.corpus", str(corpus), "--data.vocab-size", "300",
        "--model.vocab-size", "300", "--model.n-layers", "1", "--model.dim", "32", "--model.n-heads", "2",
        "--model.n-kv-heads", "1", "--model.ffn-dim", "48", "--data.seq-len", "16", "--data.batch-size", "2",
        "--steps", "4", "--optim.warmup", "1", "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2",
        "--log-every", "1", "--compile", "False",
    ])  # fmt: skip
    train(cfg, progress=False)
    return cfg


@pytest.fixture()
def finished(_trained, tmp_path):
    """A copy of a finished 4-step run (checkpoints at steps 2 and 4), and its config."""
    shutil.copytree(_trained.run_dir, tmp_path / "run")
    return attrs.evolve(_trained, run_dir=str(tmp_path / "run"))


def test_a_new_run_into_a_finished_runs_directory_is_refused_and_changes_nothing(finished):
    run = RunDir.of(finished).path
    before = _snapshot(run)
    with pytest.raises(RunDirError, match=r"checkpoints up to step 4; pass --resume .* --overwrite"):
        train(attrs.evolve(finished, steps=2), progress=False)
    assert _snapshot(run) == before


def test_overwrite_clears_the_old_run_stale_checkpoints_included(finished):
    run = RunDir.of(finished).path
    (run / "notes.txt").write_text("mine")  # not something ftitan wrote: kept
    out = train(attrs.evolve(finished, steps=2), overwrite=True, progress=False)
    assert _steps_of(run) == [2]  # step 4 of the old run is gone, so generate / --resume cannot pick it
    manifest = ft.checkpoint.read_manifest(ft.checkpoint.latest(run / "checkpoints"))
    assert manifest.extra["config"]["steps"] == 2
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1] == 2
    assert out["start_step"] == 0 and (run / "notes.txt").read_text() == "mine"
    with pytest.raises(RunDirError, match="pick one"):
        train(finished, resume=True, overwrite=True, progress=False)


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        (lambda c: attrs.evolve(c, data=attrs.evolve(c.data, seq_len=8)), "--data.seq-len"),
        (lambda c: attrs.evolve(c, data=attrs.evolve(c.data, corpus=c.data.corpus + ".other")), "--data.corpus"),
        (lambda c: attrs.evolve(c, model=attrs.evolve(c.model, n_layers=2)), "--model.n-layers"),
    ],
    ids=["seq_len", "corpus", "n_layers"],
)
def test_resume_with_other_model_or_data_names_the_flag(finished, change, flag):
    run = RunDir.of(finished).path
    before = _snapshot(run)
    with pytest.raises(RunDirError, match=rf"model or data differs \({flag}: .* in the run, .* now\)") as e:
        train(change(finished), resume=True, progress=False)
    assert "\n" not in str(e.value)
    assert _snapshot(run) == before  # the cached tokens, config and checkpoints of the run are untouched


def test_resume_past_steps_is_refused_and_resume_at_steps_reports_the_run(finished):
    with pytest.raises(RunDirError, match=r"--steps=2: .* already at step 4; pass --steps above 4"):
        train(attrs.evolve(finished, steps=2), resume=True, progress=False)
    out = train(finished, resume=True, progress=False)  # nothing left to do: the run's own figures
    assert out["start_step"] == 4
    records = [json.loads(line) for line in (RunDir.of(finished).path / "metrics.jsonl").read_text().splitlines()]
    assert out["final_loss"] == [r["loss"] for r in records if "loss" in r][-1]


def test_resume_may_change_what_is_not_the_runs_identity(finished):
    more = attrs.evolve(finished, steps=6, log_every=2, keep=1, optim=attrs.evolve(finished.optim, lr=1e-3))
    out = train(more, resume=True, progress=False)
    assert out["start_step"] == 4 and _steps_of(RunDir.of(finished).path) == [6]


def test_a_run_that_stopped_before_its_first_checkpoint_is_replaced_with_fresh_caches(finished, tmp_path):
    run = RunDir.of(finished).path
    for p in ft.checkpoint.list_checkpoints(run / "checkpoints"):
        shutil.rmtree(p)  # as if it died before its first save
    other = tmp_path / "other.jsonl"  # other data: the BPE trained on the old corpus must not be reused
    other.write_text("".join(json.dumps({"text": f"class C{i}:\n    pass\n"}) + "\n" for i in range(200)))
    old_tokenizer = (run / "tokenizer.json").read_bytes()
    cfg = attrs.evolve(finished, steps=2, data=attrs.evolve(finished.data, corpus=str(other)))
    with pytest.warns(UserWarning, match="another model or data and no checkpoint yet; its .*tokenizer.json"):
        train(cfg, progress=False)
    assert (run / "tokenizer.json").read_bytes() != old_tokenizer and _steps_of(run) == [2]
