"""metrics.jsonl as a resumed run reads it back."""

import json

import pytest

from ftitan.train.metrics import MetricsSink, read_records


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path):
    f = tmp_path / "metrics.jsonl"
    good = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.5}, {"step": 2, "eval_loss": 4.6}]
    f.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"step": 3, "lo')  # killed mid-write
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:4: dropping a torn last line"):
        sink = MetricsSink(tmp_path, keep_until=2)
    sink.close()
    assert sink.records == good
    assert read_records(f) == good  # the file was rewritten without it


def test_a_bad_line_before_the_last_names_itself(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1, "loss": 5.0}\nnot json\n{"step": 2, "loss": 4.5}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: unreadable metrics record .*fix or delete that line"):
        read_records(f)
