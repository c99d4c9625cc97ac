"""Peer train steps (HF / TorchTitan Llama) and the side-by-side timer."""

import json
import math
import time

import pytest
import torch

from ftitan.bench import peers, timing

TINY = {
    "vocab_size": 256,
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 192,
    "seq_len": 32,
    "batch_size": 4,
    "rope_theta": 500000.0,
}

# TorchTitan comes with the `bench` extra, not `dev`: its tests are marked
# slow, left out of `make test` and run by `make test-all`, which installs
# the extra. They never skip: without torchtitan they fail.
requires_torchtitan = pytest.mark.slow


def _check_trains(step: peers.PeerStep, n: int = 5) -> list[float]:
    losses = [step() for _ in range(n)]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    return losses


def test_hf_llama_step_trains():
    step = peers.hf_llama_step(TINY, compile=False)
    assert step.name == "hf-eager"
    assert step.tokens_per_step == TINY["batch_size"] * TINY["seq_len"]
    _check_trains(step)


def test_hf_llama_step_is_deterministic():
    a = peers.hf_llama_step(TINY, compile=False)
    b = peers.hf_llama_step(TINY, compile=False)
    assert [a() for _ in range(2)] == [b() for _ in range(2)]


@requires_torchtitan
def test_torchtitan_llama_step_trains():
    step = peers.torchtitan_llama_step(TINY, compile=False)
    assert step.name == "torchtitan-eager"
    assert step.tokens_per_step == TINY["batch_size"] * TINY["seq_len"]
    _check_trains(step)


@requires_torchtitan
def test_torchtitan_model_matches_config():
    model = peers.build_torchtitan_llama(TINY)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # the RoPE cache must stay complex (Module.to(float32) would drop the
    # imaginary part silently)
    rope = model.layers["0"].attention.rope
    assert rope.cache.is_complex()
    assert rope.cache.shape == (TINY["seq_len"], TINY["dim"] // TINY["n_heads"] // 2)
    attn = model.layers["0"].attention
    assert type(attn.inner_attention).__name__ == "ScaledDotProductAttention"
    assert (attn.n_heads, attn.n_kv_heads) == (TINY["n_heads"], TINY["n_kv_heads"])
    assert model.layers["0"].feed_forward.w1.out_features == TINY["ffn_dim"]


@requires_torchtitan
def test_hf_and_torchtitan_have_equal_param_counts():
    hf = peers.param_count(peers.build_hf_llama(TINY))
    tt = peers.param_count(peers.build_torchtitan_llama(TINY))
    d, f, v, L = TINY["dim"], TINY["ffn_dim"], TINY["vocab_size"], TINY["n_layers"]
    kv = TINY["n_kv_heads"] * d // TINY["n_heads"]
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * f + 2 * d
    assert hf == tt == 2 * v * d + d + L * per_layer


def test_missing_config_key_is_an_error():
    cfg = dict(TINY)
    del cfg["ffn_dim"]
    with pytest.raises(ValueError, match="ffn_dim"):
        peers.build_hf_llama(cfg)


# ---------------------------------------------------------------- timing


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_steps_round_robin_and_medians():
    clock = _FakeClock()
    calls = []
    costs = {"a": [1.0, 1.0, 1.0, 9.0, 1.0], "b": [3.0] * 5, "c": [2.0] * 5}
    timed = {n: 0 for n in costs}

    def make(name):
        def step():
            calls.append(name)
            if len(calls) > 3 * 2:  # past warm-up (2 calls each)
                clock.now += costs[name][timed[name]]
                timed[name] += 1
        return step

    out = timing.time_steps(
        {n: make(n) for n in costs}, tokens_per_step=60, warmup=2, rounds=5, clock=clock
    )
    # warm-up: each peer twice, in order; then rounds with a rotating start
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]
    rounds = [calls[6 + 3 * r : 9 + 3 * r] for r in range(5)]
    assert [r[0] for r in rounds] == ["a", "b", "c", "a", "b"]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    res = out["results"]
    assert res["a"]["median_s"] == 1.0  # the 9 s outlier does not move the median
    assert res["a"]["max_s"] == 9.0
    assert res["b"]["tokens_per_s"] == pytest.approx(20.0)
    assert res["c"]["tokens_per_s"] == pytest.approx(30.0)
    assert timing.ratios(res, [("a", "b")]) == {"a/b": pytest.approx(3.0)}
    json.dumps(out)


def test_time_steps_real_sleeps_rank_correctly():
    out = timing.time_steps(
        {"fast": lambda: time.sleep(0.01), "slow": lambda: time.sleep(0.03)},
        tokens_per_step={"fast": 100, "slow": 100},
        warmup=1,
        rounds=5,
    )
    r = timing.ratios(out["results"], [("fast", "slow")])["fast/slow"]
    assert 1.8 < r < 4.0, out


def test_gemm_probe_times_each_library_itself_whatever_the_picks(monkeypatch):
    """The peak of "onednn" is oneDNN's even where the linear layers' GEMMs would run MKL (a pin, or a
    probe's pick): the probe calls each library directly, not the per-shape choice."""
    from torch.profiler import ProfilerActivity, profile

    from ftitan.kernels import onednn

    monkeypatch.setattr(onednn, "_pinned", "aten")
    probe = timing.GemmProbe(64, torch.float32)
    for library, event in (("onednn", "mkldnn::_linear_pointwise"), ("aten", "aten::mm")):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            probe.libraries[library]()
        ran = {e.key for e in prof.key_averages()}
        assert event in ran and not ({"mkldnn::_linear_pointwise", "aten::mm"} - {event}) & ran, (library, ran)


def test_gemm_peak_and_machine_info_are_json():
    g = timing.gemm_peak_flops(128, repeats=3, warmup=1)
    assert g["flops_per_s"] > 0 and g["dtype"] == "float32" and g["rounds"] == 3
    assert g["flops_per_s"] == max(g["by_library"].values())  # the one probe bench step samples: the faster library
    m = timing.machine_info()
    assert m["threads"] == torch.get_num_threads() and m["cpu"]
    json.dumps({"gemm": g, "machine": m})
