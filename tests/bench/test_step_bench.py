"""``ftitan bench step``: the JSON it prints has the shape DESIGN.md fixes, with honest ratios."""

import json

from ftitan.bench import step


def test_quick_run_reports_results_ratios_and_goals(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert step.main(["--quick", "--peers", "ftitan-compiled", "ftitan-eager", "hf-eager",
                      "--warmup", "1", "--rounds", "2", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["bench"] == "step" and printed["config"]["quick"] is True
    assert set(printed["results"]) == {"ftitan-compiled", "ftitan-eager", "hf-eager"}
    tokens = printed["config"]["batch_size"] * printed["config"]["seq_len"]
    for r in printed["results"].values():
        assert r["tokens_per_s"] > 0 and 0 < r["mfu_vs_gemm_peak"]
        assert len(r["times_s"]) == 2
        # the rate is the tokens of one step over its median time, and the median is of the timed calls
        assert abs(r["tokens_per_s"] * r["median_s"] - tokens) <= 1e-6 * tokens
        assert min(r["times_s"]) <= r["median_s"] <= max(r["times_s"])
    res = printed["results"]
    want = res["ftitan-compiled"]["tokens_per_s"] / res["hf-eager"]["tokens_per_s"]
    assert abs(printed["ratios"]["ftitan-compiled/hf-eager"] - want) < 1e-9
    # only the goals whose peers ran are judged, and "met" follows from them
    assert printed["goals"] == {"ftitan-compiled/hf-eager": 1.2}
    assert printed["met"] == (printed["ratios"]["ftitan-compiled/hf-eager"] >= 1.2)
    assert printed["machine"]["threads"] >= 1 and printed["gemm_peak"]["flops_per_s"] > 0


def test_bf16_mixed_precision_runs_the_gpu_command_on_cpu(capsys):
    """The GPU measurement's command, shrunk by --quick, runs here: bf16 compute for ftitan and HF (autocast)."""
    assert step.main(["--quick", "--device", "cpu", "--mixed-precision", "bf16", "--model", "llama3-8b-2layers",
                      "--peers", "ftitan-compiled", "hf-eager", "--warmup", "1", "--rounds", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["config"]["compute_dtype"] == "bfloat16" and printed["config"]["device"] == "cpu"
    assert printed["gemm_peak"]["dtype"] == "bfloat16"
    assert printed["device_peak"] is None  # no published peak for a CPU: MFU is against the measured GEMM only
    assert all(r["tokens_per_s"] > 0 for r in printed["results"].values())


def test_unknown_shape_is_refused():
    import pytest

    with pytest.raises(ValueError, match="--model='llama9'"):
        step.run(step.Options(quick=True, model="llama9", peers=("ftitan-eager",)))


def test_streaming_loader_is_measured_beside_pretokenized_data(capsys):
    assert step.main(["--quick", "--device", "cpu", "--peers", "ftitan-compiled", "ftitan-compiled-streaming",
                      "--warmup", "1", "--rounds", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    res = printed["results"]
    want = res["ftitan-compiled-streaming"]["tokens_per_s"] / res["ftitan-compiled"]["tokens_per_s"]
    assert abs(printed["ratios"]["ftitan-compiled-streaming/ftitan-compiled"] - want) < 1e-9
    assert printed["goals"]["ftitan-compiled-streaming/ftitan-compiled"] == 0.95
    assert printed["loader"]["tokens_per_s"] > 0 and printed["loader"]["tokens"] > 0
