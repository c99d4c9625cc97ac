"""``ftitan bench generate``: the JSON it prints has the shape DESIGN.md fixes, with honest ratios."""

import json

from ftitan.bench import generate


def test_quick_run_reports_decode_rates_ratios_and_goals(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # one batch size: each one compiles ftitan's decode graphs anew (about 45 s on a cold inductor cache)
    argv = ["--quick", "--peers", "ftitan-compiled", "hf", "vllm-ftitan", "vllm-builtin", "--batches", "2",
            "--warmup", "1", "--rounds", "1", "--out", str(out)]  # fmt: skip
    assert generate.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["bench"] == "generate" and printed["config"]["quick"] is True
    assert set(printed["results"]) == {"b2"} and printed["skipped"] == {}
    for results in printed["results"].values():
        assert set(results) == {"ftitan-compiled", "hf", "vllm-ftitan", "vllm-builtin"}
        n = printed["config"]["new_tokens"]
        for r in results.values():
            assert r["decode_tokens_per_s"] > 0 and r["generation_s"] > 0
            # decode rate = the batch's tokens after the first over the time they added to a 1-token generation
            # (the bench's max(..., 1e-9): on a loaded machine (make test runs two workers) a 1-token
            # generation of this tiny quick model can take as long as the whole one)
            decoded = r["decode_tokens_per_s"] * max(r["generation_s"] - r["prefill_s"], 1e-9)
            assert abs(decoded - 2 * (n - 1)) <= 1e-6 * decoded
            assert r["same_tokens_as_first_peer"]  # every peer decodes the same greedy tokens
    b2 = printed["results"]["b2"]
    want = b2["ftitan-compiled"]["decode_tokens_per_s"] / b2["hf"]["decode_tokens_per_s"]
    assert abs(printed["ratios"]["ftitan-compiled/hf@b2"] - want) < 1e-9
    assert printed["goals"] == {"ftitan-compiled/hf@b2": 2.0, "vllm-ftitan/vllm-builtin@b2": 0.9}
    assert printed["met"] == all(printed["ratios"][k] >= v for k, v in printed["goals"].items())
