"""``ftitan bench step``: the JSON it prints has the shape DESIGN.md fixes, with honest ratios."""

import json

import pytest
import torch

from ftitan.bench import step
from ftitan.kernels import onednn


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
    # only the goals whose peers ran are judged (the GEMM-peak goal on the core shape only), "met" follows
    assert printed["goals"] == {"ftitan-compiled/hf-eager": 1.2}
    assert printed["met"] == (printed["ratios"]["ftitan-compiled/hf-eager"] >= 1.2)
    assert printed["machine"]["threads"] >= 1 and printed["gemm_peak"]["flops_per_s"] > 0
    # the GEMM peak is sampled in each timed round, beside the steps, and divides every row's model FLOP/s
    peak = printed["gemm_peak"]
    assert peak["interleaved"] and peak["rounds"] == 2 and peak["dtype"] == "float32"
    assert abs(peak["flops_per_s"] * peak["median_s"] - 2 * peak["n"] ** 3) <= 1e-6 * 2 * peak["n"] ** 3
    # on the CPU every GEMM library the ftitan peers may use is probed (oneDNN's matmul where it computes float32);
    # the peak is the fastest one's
    n = peak["n"]
    matmul = ["onednn-matmul"] if onednn.float32_exact("nt", torch.randn(n, n), torch.randn(n, n).t()) else []
    assert set(peak["by_library"]) == {"aten", "onednn", *matmul} and peak["library"] in peak["by_library"]
    assert peak["flops_per_s"] == max(peak["by_library"].values()) == peak["by_library"][peak["library"]]
    assert printed["config"]["kernels"] == "triton"  # the ftitan peers' default: ftitan.kernels (oneDNN GEMMs here)
    assert printed["config"]["attn_impl"] == "gemm"  # and their attention: causal blocks as GEMMs on the CPU
    ours = res["ftitan-compiled"]
    assert abs(ours["model_flops_per_s"] - ours["tokens_per_s"] * printed["model_flops_per_token"]) <= 1e-6 * ours[
        "model_flops_per_s"]
    assert abs(printed["ratios"]["ftitan-compiled/gemm-peak"] - ours["model_flops_per_s"] / peak["flops_per_s"]) < 1e-9
    assert not any(k.startswith("gemm-peak") for k in res)  # the probes are no peers of the results


@pytest.mark.parametrize("ours", ["ftitan-eager", pytest.param("ftitan-compiled", marks=pytest.mark.slow)])
def test_bf16_mixed_precision_runs_the_gpu_command_on_cpu(capsys, ours):
    """The GPU measurement's command, shrunk by --quick, runs here: bf16 compute for ftitan and HF (autocast).
    The default tier runs ftitan's step eagerly (the same builder as ftitan-compiled, which the quick run
    above compiles in fp32; a compiled bf16 step is tests/train/test_precision.py's); the slow tier compiles."""
    assert step.main(["--quick", "--device", "cpu", "--mixed-precision", "bf16", "--model", "llama3-8b-2layers",
                      "--peers", ours, "hf-eager", "--warmup", "1", "--rounds", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["config"]["compute_dtype"] == "bfloat16" and printed["config"]["device"] == "cpu"
    assert printed["gemm_peak"]["dtype"] == "bfloat16"
    assert printed["gemm_peak"]["n"] == step.QUICK_PROBE  # a smoke run's probe (emulated bf16 is slow on some CPUs)
    assert printed["device_peak"] is None  # no published peak for a CPU: MFU is against the measured GEMM only
    assert all(r["tokens_per_s"] > 0 for r in printed["results"].values())


def test_float8_runs_the_ftitan_peers_projections_in_float8(capsys, monkeypatch):
    """``--float8 rowwise`` (the GPU's FP8 row, shrunk): the ftitan peer's projections go through
    ``ftitan.nn.float8`` and the JSON records the recipe; an unknown recipe is refused naming the flag."""
    from ftitan.nn import float8

    calls = []
    real = float8.linear
    monkeypatch.setattr(float8, "linear", lambda *a, **k: calls.append(k["recipe"]) or real(*a, **k))
    assert step.main(["--quick", "--device", "cpu", "--mixed-precision", "bf16", "--float8", "rowwise",
                      "--peers", "ftitan-eager", "--warmup", "1", "--rounds", "1"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["config"]["float8"] == "rowwise"
    assert calls and set(calls) == {"rowwise"}
    with pytest.raises(ValueError, match="--float8='e4m3'"):
        step.run(step.Options(quick=True, float8="e4m3", peers=("ftitan-eager",)))


@pytest.mark.parametrize("fuse", [True, False])
def test_fuse_projections_picks_the_ftitan_peers_params_tree(capsys, monkeypatch, fuse):
    """``--fuse-projections`` (default) / ``--no-fuse-projections``: the ftitan peer's train state holds the
    stacked ``wqkv``/``w13`` leaves, or the separate ones, and the JSON records which."""
    import ftitan as ft

    trees = []
    real = ft.train.init_state
    monkeypatch.setattr(ft.train, "init_state", lambda params, opt: trees.append(params) or real(params, opt))
    flag = [] if fuse else ["--no-fuse-projections"]
    assert step.main(["--quick", "--device", "cpu", "--peers", "ftitan-eager", "--warmup", "1", "--rounds", "1",
                      *flag]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["config"]["fuse_projections"] is fuse
    (params,) = trees
    layer = params["layers"]["0"]
    assert ("wqkv" in layer["attn"] and "w13" in layer["mlp"]) is fuse
    assert ("wq" in layer["attn"] and "w1" in layer["mlp"]) is not fuse


def test_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="--model='llama9'"):
        step.run(step.Options(quick=True, model="llama9", peers=("ftitan-eager",)))


def test_gemm_library_pins_the_ftitan_peers_gemms_and_an_unknown_one_is_refused(capsys, monkeypatch):
    from ftitan.kernels import onednn

    monkeypatch.setattr(onednn, "_pinned", None)
    monkeypatch.setattr(onednn, "_choice", {})  # no picks of this process's earlier tests (attention's have no floor)
    assert step.main(["--quick", "--device", "cpu", "--peers", "ftitan-eager", "--warmup", "1", "--rounds", "1",
                      "--gemm-library", "aten"]) == 0  # fmt: skip
    printed = json.loads(capsys.readouterr().out)
    assert printed["config"]["gemm_library"] == "aten" and printed["gemm_libraries"] == {"pinned": "aten"}
    with pytest.raises(ValueError, match="--gemm-library='mkl'"):
        step.run(step.Options(quick=True, gemm_library="mkl", peers=("ftitan-eager",)))


def test_unknown_attention_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--attn-impl='flash'"):
        step.run(step.Options(quick=True, attn_impl="flash", peers=("ftitan-eager",)))


def test_streaming_loader_is_measured_beside_pretokenized_data(capsys, monkeypatch, tmp_path):
    # oneDNN's size floors lifted for the quick shape, a fresh pick cache: the JSON's gemm_libraries lists the
    # library each GEMM of the step's linear layers ran in, as probed in this process
    monkeypatch.setattr(onednn, "MIN_WEIGHT", 0)
    monkeypatch.setattr(onednn, "MIN_FLOP", 0)
    monkeypatch.setattr(onednn, "_choice", {})
    monkeypatch.setenv("FTITAN_CACHE_DIR", str(tmp_path))
    assert step.main(["--quick", "--device", "cpu", "--peers", "ftitan-compiled", "ftitan-compiled-streaming",
                      "--warmup", "1", "--rounds", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    res = printed["results"]
    want = res["ftitan-compiled-streaming"]["tokens_per_s"] / res["ftitan-compiled"]["tokens_per_s"]
    assert abs(printed["ratios"]["ftitan-compiled-streaming/ftitan-compiled"] - want) < 1e-9
    assert printed["goals"]["ftitan-compiled-streaming/ftitan-compiled"] == 0.95
    assert printed["loader"]["tokens_per_s"] > 0 and printed["loader"]["tokens"] > 0
    cfg, rows = printed["config"], printed["config"]["batch_size"] * printed["config"]["seq_len"]
    qkv = (cfg["n_heads"] + 2 * cfg["n_kv_heads"]) * cfg["dim"] // cfg["n_heads"]  # wqkv's rows
    dim, ffn = cfg["dim"], cfg["ffn_dim"]
    picks = printed["gemm_libraries"]
    for i, o in ((dim, qkv), (dim, dim), (dim, 2 * ffn), (ffn, dim)):  # wqkv, wo, w13, w2 (and the head's)
        assert {f"nt {rows}x{i}x{o}", f"nn {rows}x{o}x{i}", f"tn {rows}x{o}x{i}"} <= set(picks), picks
    assert picks == onednn.choices() and set(picks.values()) <= {*onednn.LIBRARIES}


def test_defaults_judge_the_issue_goals():
    """>= 8 interleaved rounds; the CPU step goal: 1.05x the best compiled peer and 0.85 of the GEMM peak."""
    assert step.Options().rounds >= 8
    assert step.GOALS["ftitan-compiled/best-compiled-peer"] == 1.05 and step.GOALS["ftitan-compiled/gemm-peak"] == 0.85
    assert {"ftitan-compiled-bf16", "hf-compiled-bf16"} <= set(step.Options().peers)


def test_bf16_row_has_its_own_gemm_peak(capsys):
    """A -bf16 peer beside the fp32 ones: divided by a bf16 GEMM peak, its ratios kept within the bf16 row."""
    from ftitan.bench import timing

    if "avx512_bf16" not in timing.cpu_flags():
        printed = step.run(step.Options(quick=True, device="cpu", peers=("ftitan-eager", "ftitan-eager-bf16"),
                                        warmup=0, rounds=1))
        assert "AVX512-BF16" in printed["skipped"]["ftitan-eager-bf16"]
        pytest.skip("no AVX512-BF16 on this CPU: the bf16 row is skipped (asserted above)")
    assert step.main(["--quick", "--device", "cpu", "--peers", "ftitan-compiled", "ftitan-compiled-bf16",
                      "hf-eager-bf16", "--warmup", "1", "--rounds", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    res, ratios, peak16 = printed["results"], printed["ratios"], printed["gemm_peak_bf16"]
    ours = res["ftitan-compiled-bf16"]
    assert peak16["dtype"] == "bfloat16" and peak16["rounds"] == 2 and printed["gemm_peak"]["dtype"] == "float32"
    assert ours["compute_dtype"] == "bfloat16" and res["ftitan-compiled"]["compute_dtype"] == "float32"
    assert abs(ours["mfu_vs_gemm_peak"] - ours["model_flops_per_s"] / peak16["flops_per_s"]) < 1e-12
    assert abs(ratios["ftitan-compiled-bf16/gemm-peak"] - ours["mfu_vs_gemm_peak"]) < 1e-12
    want = ours["tokens_per_s"] / res["hf-eager-bf16"]["tokens_per_s"]
    assert abs(ratios["ftitan-compiled-bf16/hf-eager-bf16"] - want) < 1e-9
    want = ours["tokens_per_s"] / res["ftitan-compiled"]["tokens_per_s"]
    assert abs(ratios["ftitan-compiled-bf16/ftitan-compiled"] - want) < 1e-9
    # the fp32 goal's ratios compare fp32 peers only; no goal is set on the bf16 row
    assert not any("bf16" in k for k in ratios if k.startswith("ftitan-compiled/"))
    assert not any("bf16" in k for k in printed["goals"])
