"""Bad post-training flags: one line naming the flag and the fix, before any work."""

from __future__ import annotations

import pytest

from ftitan.config import parse_train_args


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--data.chat", "task:foo"], r"^--data.chat='task:foo': no such synthetic task; known: task:add, "),
        (["--data.chat", "nope.jsonl"], r"^--data.chat='nope.jsonl': no such file; pass a .jsonl file, or task:NAME"),
        (["--data.preference", "task:format"], r"^--data.preference='task:format': one objective a run: --data.chat"),
        (["--data.chat", "", "--data.preference", "task:x"], r"^--data.preference='task:x': no such synthetic task"),
        (["--lora.rank", "-1"], r"^--lora.rank=-1: must be an int >= 0"),
        (["--lora.alpha", "-2"], r"^--lora.alpha=-2.0: must be >= 0"),
        (["--recipe", "dpo-debug", "--parallel.dp-shard", "2"], r"^--data.preference='task:format': DPO runs on one "),
        (["--parallel.pp", "2", "--compile", "False"],
         r"^--parallel.pp=2: --data.chat: packed conversations do not run through pipeline"),
        (["--dpo.beta", "0"], r"^--dpo.beta=0.0: must be > 0$"),
        (["--dpo.label-smoothing", "0.5"], r"^--dpo.label-smoothing=0.5: must be in \[0, 0.5\)$"),
        (["--dpo.loss-type", "ipo", "--dpo.label-smoothing", "0.1"], r"applies to --dpo.loss-type sigmoid only$"),
        (["--data.task-eval-items", "-1"], r"^--data.task-eval-items=-1: must be >= 0"),
    ],
)
def test_bad_post_training_flags_are_one_line(tmp_path, monkeypatch, flags, match):
    if any(f.startswith("--parallel.") for f in flags):
        monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun --nproc-per-node 2
    with pytest.raises(ValueError, match=match) as e:
        parse_train_args(["--recipe", "sft-debug", *flags, "--run-dir", str(tmp_path)])
    assert "\n" not in str(e.value)
