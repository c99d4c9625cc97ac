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
            assert r["generation_s"] > 0
            if r["decode_tokens_per_s"] is None:  # on a loaded machine (make test runs two workers) a 1-token
                # generation of this tiny quick model can take as long as the whole one: unmeasured, no rate
                assert r["generation_s"] <= r["prefill_s"]
                continue
            # decode rate = the batch's tokens after the first over the time they added to a 1-token generation
            decoded = r["decode_tokens_per_s"] * (r["generation_s"] - r["prefill_s"])
            assert r["decode_tokens_per_s"] > 0 and abs(decoded - 2 * (n - 1)) <= 1e-6 * decoded
            assert r["same_tokens_as_first_peer"]  # every peer decodes the same greedy tokens
    b2 = printed["results"]["b2"]
    ours, hf = b2["ftitan-compiled"]["decode_tokens_per_s"], b2["hf"]["decode_tokens_per_s"]
    want = ours / hf if ours is not None and hf is not None else None
    got = printed["ratios"]["ftitan-compiled/hf@b2"]
    assert (got is None) == (want is None) and (want is None or abs(got - want) < 1e-9)
    assert printed["goals"] == {"ftitan-compiled/hf@b2": 2.0, "vllm-ftitan/vllm-builtin@b2": 0.9}
    ratios = printed["ratios"]
    assert printed["met"] == all(ratios[k] is not None and ratios[k] >= v for k, v in printed["goals"].items())


def test_an_unmeasured_decode_rate_gives_no_ratio_and_no_met():
    """A round where the n-token generation timed no slower than the 1-token one is reported as unmeasured
    (null): the ratios it enters are null (and ``met``, which needs every goal's ratio, is false)."""
    by_batch = {"b2": {"ftitan-compiled": {"decode_tokens_per_s": None}, "hf": {"decode_tokens_per_s": 10.0},
                       "vllm-ftitan": {"decode_tokens_per_s": 9.0}, "vllm-builtin": {"decode_tokens_per_s": 10.0}}}
    assert generate._ratios(by_batch) == {"ftitan-compiled/hf@b2": None, "vllm-ftitan/vllm-builtin@b2": 0.9}
