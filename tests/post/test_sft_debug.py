"""``ftitan train --recipe sft-debug``: no files, a synthetic chat task, exact match of greedy answers.

Default tier: a short run makes >= 90% of held-out answers parse (the untrained model's: none), and the
run converted with ``ftitan convert`` answers the same way in transformers (its own tokenizer and chat
template; greedy). Slow tier: the whole recipe, compiled, raises exact match from the untrained model's
(0) to >= 50% in ftitan and in the converted transformers model.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from ftitan.__main__ import main
from ftitan.data import tasks
from ftitan.data.sft import TASK_TRAIN_ITEMS


def _run(tmp_path, *flags: str) -> list[dict]:
    run = tmp_path / "run"
    assert main(["train", "--recipe", "sft-debug", "--run-dir", str(run), "--device", "cpu", *flags]) == 0
    assert main(["convert", "--run", str(run), "--hf", str(tmp_path / "hf")]) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _hf_scores(directory, n: int) -> dict[str, float]:
    """Greedy answers of the converted model in transformers, prompts rendered by its own chat template."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    items = tasks.task_items(n, seed=0, split="eval", task="sort")
    parsed = right = 0
    for item in items:
        prompt = tok.apply_chat_template(item["messages"][:-1], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0, ids.shape[1]:]).split("<|end|>")[0]
        parsed += tasks.parse_answer(text) is not None
        right += tasks.exact_match(text, item)
    return {"parse_rate": parsed / n, "exact_match": right / n}


def test_short_sft_debug_learns_the_format_and_converts(tmp_path):
    records = _run(tmp_path, "--steps", "40", "--eval-every", "40", "--compile", "False")
    untrained = next(r for r in records if "eval.parse_rate" in r)
    trained = [r for r in records if "eval.parse_rate" in r][-1]
    assert untrained["step"] == 0 and untrained["eval.parse_rate"] == 0.0 and untrained["eval.exact_match"] == 0.0
    assert trained["step"] == 40 and trained["eval.parse_rate"] >= 0.9
    assert records[0]["data.conversations"] == TASK_TRAIN_ITEMS and records[0]["data.fill"] > 0.9
    hf = _hf_scores(tmp_path / "hf", 50)
    assert hf["parse_rate"] >= 0.9  # the exported model, tokenizer and template answer in the task's format
    assert (tmp_path / "run" / "loss.png").is_file()


@pytest.mark.slow
def test_sft_debug_reaches_half_exact_match(tmp_path):
    records = _run(tmp_path)
    scores = [r for r in records if "eval.exact_match" in r]
    assert scores[0]["step"] == 0 and scores[0]["eval.exact_match"] == 0.0
    assert scores[-1]["step"] == 200 and scores[-1]["eval.exact_match"] >= 0.5
    assert _hf_scores(tmp_path / "hf", 200)["exact_match"] >= 0.5


def test_sft_resume_sees_the_batches_of_an_uninterrupted_run(tmp_path):
    flags = ["--recipe", "sft-debug", "--device", "cpu", "--compile", "False", "--log-every", "1", "--eval-every", "0",
             "--ckpt-every", "2", "--data.task-eval-items", "0", "--optim.warmup", "1"]  # fmt: skip

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]

    assert main(["train", *flags, "--steps", "4", "--run-dir", str(tmp_path / "straight")]) == 0
    assert main(["train", *flags, "--steps", "2", "--run-dir", str(tmp_path / "cut")]) == 0
    assert main(["train", *flags, "--steps", "4", "--run-dir", str(tmp_path / "cut"), "--resume"]) == 0
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "cut")
    assert len(straight) == 4 and resumed == straight  # packed rows from the restored loader position, bit for bit
