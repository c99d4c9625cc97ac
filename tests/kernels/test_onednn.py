"""``ftitan.kernels.onednn``: the linear layers' GEMMs in oneDNN on the CPU.

The reference is ``F.linear`` in float64 (an independent GEMM): oneDNN's float32 results differ from MKL's
only in summation order, so values and gradients agree with it to float32 rounding (rtol 1e-5 over
K = 512 terms), eager and compiled with inductor (the op is opaque there: inductor's own lowering of
``_linear_pointwise`` takes frozen weights only). Under ``torch.func`` transforms the plain ``F.linear``
runs, bit for bit, and the op is never called; a double backward runs plain ops. The weight gradient's
``gemm_tn`` is checked in each library against a float64 product, and its probe against known timings.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from ftitan.kernels import onednn
from tests.kernels._kernel_checks import Spy

TOL = dict(rtol=1e-5, atol=1e-5)
OP_EVENT = "ftitan_kernels::onednn_linear"
TN_EVENT = "ftitan_kernels::gemm_tn"


def _inputs(rows=64, k=512, n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows // 2, k, generator=g)
    w = torch.randn(n, k, generator=g) * k**-0.5
    cot = torch.randn(2, rows // 2, n, generator=g)
    return x, w, cot


def _value_and_grads(fn, x, w, cot):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    return (y.detach(), *torch.autograd.grad((y * cot).sum(), (x, w)))


def _reference(x, w, cot):
    return [t.float() for t in _value_and_grads(F.linear, x.double(), w.double(), cot.double())]


def test_linear_and_its_gradients_match_a_float64_reference(monkeypatch):
    x, w, cot = _inputs()
    assert onednn.usable(x, w)
    spy = Spy(monkeypatch, onednn, ("_linear_op", "_tn_op"))
    got = _value_and_grads(onednn.linear, x, w, cot)
    assert spy.calls == {"_linear_op": 2, "_tn_op": 1}  # the forward and the input gradient; the weight gradient
    torch.testing.assert_close(got, _reference(x, w, cot), **TOL)
    b = torch.randn(w.shape[0])
    torch.testing.assert_close(onednn.linear(x, w, b), F.linear(x.double(), w.double(), b.double()).float(), **TOL)


def test_inductor_compiles_it_with_the_same_gradients():
    x, w, cot = _inputs(seed=1)
    before = torch._dynamo.config.trace_autograd_ops
    torch._dynamo.config.trace_autograd_ops = True  # torch.autograd.grad traced, as ft.train's autograd path does
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda x, w, cot: _value_and_grads(onednn.linear, x, w, cot), fullgraph=True)
        compiled(x, w, cot)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = compiled(x, w, cot)
    finally:
        torch._dynamo.config.trace_autograd_ops = before
        torch._dynamo.reset()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts[OP_EVENT] == 2 and counts[TN_EVENT] == 1  # the ops ran from inductor's code
    torch.testing.assert_close(got, _reference(x, w, cot), **TOL)


def test_torch_func_transforms_run_f_linear_bit_for_bit(monkeypatch):
    x, w, cot = _inputs(seed=2)
    spy = Spy(monkeypatch, onednn, ("_linear_op", "_tn_op"))
    assert torch.equal(torch.func.grad(lambda w: (onednn.linear(x, w) * cot).sum())(w),
                       torch.func.grad(lambda w: (F.linear(x, w) * cot).sum())(w))
    assert torch.equal(torch.func.vmap(onednn.linear, in_dims=(0, None))(x, w), torch.func.vmap(F.linear, (0, None))(x, w))
    _, got = torch.func.jvp(lambda w: onednn.linear(x, w), (w,), (w.flip(0),))
    _, want = torch.func.jvp(lambda w: F.linear(x, w), (w,), (w.flip(0),))
    assert torch.equal(got, want)
    assert spy.total() == 0


def test_double_backward_runs_plain_ops():
    x, w, cot = _inputs(seed=3)

    def second(fn, x, w):
        x = x.detach().requires_grad_()
        (gx,) = torch.autograd.grad((fn(x, w) * cot).square().sum(), x, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), x)[0]

    want = second(F.linear, x.double(), w.double()).float()
    torch.testing.assert_close(second(onednn.linear, x, w), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize(
    "case, want",
    [("float32 GEMM", True), ("bfloat16", False), ("small weight, few rows", False),
     ("small weight, many rows", True), ("no shared inner dim", False)],
)  # fmt: skip
def test_usable_only_for_float32_cpu_gemms_worth_the_call(case, want):
    x, w, _ = _inputs()
    if case == "bfloat16":
        x, w = x.bfloat16(), w.bfloat16()
    elif case.startswith("small weight"):  # 512 x 128: below MIN_WEIGHT; 2 * rows * 65536 FLOPs vs MIN_FLOP
        w = w[:128]
        x = x.reshape(-1, 512)[:8] if case.endswith("few rows") else torch.randn(512, 512)
    elif case == "no shared inner dim":
        w = w[:, :256]
    assert onednn.usable(x, w) is want
    if case == "bfloat16":
        assert onednn.usable(x, w, dtype=torch.float32)  # a caller that casts to float32 first (the fused loss)


@pytest.fixture
def fresh_picks(monkeypatch, tmp_path):
    """The per-shape library picks and pin, as a new process has them, with an empty cache root."""
    monkeypatch.setattr(onednn, "_choice", {})
    monkeypatch.setattr(onednn, "_pinned", None)
    monkeypatch.setenv("FTITAN_CACHE_DIR", str(tmp_path))
    return tmp_path


LIBRARY_EVENT = {"aten": "aten::mm", "onednn": "mkldnn::_linear_pointwise"}


def _ran_only(prof, library: str) -> None:
    """The profiled code ran ``library``'s GEMM and not the other's."""
    ran = {e.key for e in prof.key_averages()}
    assert LIBRARY_EVENT[library] in ran and not (set(LIBRARY_EVENT.values()) - {LIBRARY_EVENT[library]}) & ran, (
        library, ran)  # fmt: skip


def _in_each_pinned_library(gemm, want: torch.Tensor) -> None:
    """``gemm()`` with each library pinned: that library ran, and a dense result equal to ``want``."""
    for library in onednn.LIBRARIES:
        onednn.pin(library)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = gemm()
        _ran_only(prof, library)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("rows, m, n", [(96, 384, 512), (256, 768, 64)])  # oneDNN copies g.T; x.T and the result
def test_weight_gradient_gemm_matches_a_float64_reference_in_each_library(fresh_picks, rows, m, n):
    g = torch.Generator().manual_seed(4)
    gr, x = torch.randn(rows, m, generator=g) * rows**-0.5, torch.randn(rows, n, generator=g)  # sums ~ 1
    want = (gr.double().t() @ x.double()).float()
    _in_each_pinned_library(lambda: onednn.gemm_tn(gr, x), want)
    assert onednn.choices() == {"pinned": "onednn"}
    torch.library.opcheck(onednn._tn_op, (gr, x))  # the fake's shape and layout are the op's
    onednn.pin(None)
    torch.testing.assert_close(onednn.gemm_tn(gr, x), want, **TOL)
    picks = onednn.choices()
    assert list(picks) == [f"tn {rows}x{m}x{n}"] and picks[f"tn {rows}x{m}x{n}"] in onednn.LIBRARIES  # probed, kept
    with pytest.raises(ValueError, match=r"pin\('mkl'\): expected one of \('aten', 'onednn'\)"):
        onednn.pin("mkl")


@pytest.mark.parametrize("transposed", [False, True])  # the forward x @ w.T ("nt"); the input gradient g @ w ("nn")
def test_linear_gemms_match_a_float64_reference_in_each_library(fresh_picks, transposed):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 48, 384, generator=g), torch.randn(256, 384, generator=g) * 384**-0.5
    if transposed:  # g @ w with w stored (384, 256): passed as its transposed view, read as it lies
        w = torch.randn(384, 256, generator=g).t() * 384**-0.5
    want = (x.double() @ w.double().t()).float()
    _in_each_pinned_library(lambda: onednn.gemm_nt(x, w), want)
    torch.library.opcheck(onednn._linear_op, (x, w))
    onednn.pin(None)
    torch.testing.assert_close(onednn.gemm_nt(x, w), want, **TOL)
    assert list(onednn.choices()) == [f"{'nn' if transposed else 'nt'} 96x384x256"]  # probed for its kind


def test_a_linear_layer_picks_each_of_its_three_gemms_by_kind_and_shape(monkeypatch, fresh_picks):
    """Forward ("nt"), input gradient ("nn") and weight gradient ("tn") are probed apart: here the probe finds
    oneDNN faster for the gradients only, and each GEMM then ran in its own pick (profiler events)."""
    picks = {"nt": "aten", "nn": "onednn", "tn": "onednn"}
    monkeypatch.setattr(onednn, "_probe", lambda kind, a, b: picks[onednn._key(kind, a, b)[0]])
    x, w, cot = _inputs()
    x, w = x.requires_grad_(), w.requires_grad_()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = onednn.linear(x, w)
        gx, gw = torch.autograd.grad((y * cot).sum(), (x, w))
    assert onednn.choices() == {"nt 64x512x512": "aten", "nn 64x512x512": "onednn", "tn 64x512x512": "onednn"}
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::mm") == 1 and counts.get("mkldnn::_linear_pointwise") == 2, counts
    for got, want in zip((y, gx, gw), _reference(x, w, cot), strict=True):
        torch.testing.assert_close(got.detach(), want, **TOL)
    saved = json.loads((fresh_picks / onednn.CACHE).read_text())
    assert saved == {onednn._machine(): onednn.choices()}


def test_gemm_in_runs_the_library_it_names_and_refuses_others(fresh_picks):
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(32, 96, generator=g), torch.randn(48, 96, generator=g)
    onednn.pin("aten")  # a pin (or a pick) does not change gemm_in's library
    for library in onednn.LIBRARIES:
        for kind, want in (("nt", a.double() @ b.double().t()), ("tn", a.double().t() @ a.double())):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                got = onednn.gemm_in(library, kind, a, b if kind == "nt" else a)
            _ran_only(prof, library)
            torch.testing.assert_close(got, want.float(), **TOL)
    with pytest.raises(ValueError, match=r"gemm_in\('mkl', 'nt'\): expected a library of"):
        onednn.gemm_in("mkl", "nt", a, b)
    with pytest.raises(ValueError, match=r"gemm_in\('aten', 'nn'\)"):
        onednn.gemm_in("aten", "nn", a, b)


@pytest.mark.parametrize("slower, want", [("aten", "onednn"), ("onednn", "aten"), ("neither", "aten")])
def test_probe_picks_the_faster_library_and_keeps_aten_on_a_tie(monkeypatch, fresh_picks, slower, want):
    """The per-shape probe times both libraries on the operands: here one is slowed by 5 ms a call (far more
    than either GEMM), so the faster is known; within MARGIN (a tie) aten::mm stays."""

    def slowed(fn):
        def run(*args):
            time.sleep(0.005)
            return fn(*args)

        return run

    if slower != "neither":
        monkeypatch.setattr(onednn, f"_tn_{slower}", slowed(getattr(onednn, f"_tn_{slower}")))
    else:  # equal times: aten wins the tie
        monkeypatch.setattr(onednn, "time", types.SimpleNamespace(perf_counter=iter(range(1000)).__next__))
    g, x = torch.randn(8, 16), torch.randn(8, 4)  # g.T @ x: (16, 4)
    assert onednn._probe("tn", g, x) == want


def test_picks_are_remembered_per_machine_so_a_new_process_takes_them_without_probing(monkeypatch, fresh_picks):
    g, x = torch.randn(64, 256), torch.randn(64, 128)
    onednn.gemm_tn(g, x)
    picked = onednn.choices()["tn 64x256x128"]
    saved = json.loads((fresh_picks / onednn.CACHE).read_text())
    assert saved == {onednn._machine(): {"tn 64x256x128": picked}}
    other = next(lib for lib in onednn.LIBRARIES if lib != picked)  # the file decides, not a new probe
    saved[onednn._machine()]["tn 64x256x128"] = other
    (fresh_picks / onednn.CACHE).write_text(json.dumps(saved))
    monkeypatch.setattr(onednn, "_choice", {})  # a new process
    monkeypatch.setattr(onednn, "_probe", lambda *_: pytest.fail("probed a shape the cache file holds"))
    torch.testing.assert_close(onednn.gemm_tn(g, x), (g.double().t() @ x.double()).float(), **TOL)
    assert onednn.choices() == {"tn 64x256x128": other}
    assert not list(fresh_picks.glob("*.tmp"))  # written by rename


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"%s": "aten"}'])
def test_an_unreadable_cache_file_costs_a_probe_and_is_rewritten(monkeypatch, fresh_picks, text):
    (fresh_picks / onednn.CACHE).write_text(text.replace("%s", onednn._machine()))
    probes = []
    monkeypatch.setattr(onednn, "_probe", lambda *_: probes.append(1) or "aten")
    onednn.gemm_tn(torch.randn(8, 16), torch.randn(8, 4))
    assert probes == [1]
    assert json.loads((fresh_picks / onednn.CACHE).read_text()) == {onednn._machine(): {"tn 8x16x4": "aten"}}


def test_a_pick_another_process_recorded_during_the_probe_is_the_one_that_runs(monkeypatch, fresh_picks):
    """Another rank on the machine probed the same shape at the same time and recorded its pick first: this
    process runs that library too (its own probe's pick is dropped) and leaves the file as it was."""
    g, x = torch.randn(64, 256), torch.randn(64, 128)
    shape = "tn 64x256x128"

    def probe(*_):  # meanwhile, the other process records "onednn"
        (fresh_picks / onednn.CACHE).write_text(json.dumps({onednn._machine(): {shape: "onednn"}}))
        return "aten"

    monkeypatch.setattr(onednn, "_probe", probe)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = onednn.gemm_tn(g, x)
    _ran_only(prof, "onednn")
    torch.testing.assert_close(got, (g.double().t() @ x.double()).float(), **TOL)
    assert onednn.choices() == {shape: "onednn"}
    assert json.loads((fresh_picks / onednn.CACHE).read_text()) == {onednn._machine(): {shape: "onednn"}}


_RANK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from ftitan.kernels import onednn
    library, root = sys.argv[1], Path(sys.argv[2])

    def probe(*_):  # both processes probe at once, each finding its own library faster
        (root / f"ready-{library}").touch()
        deadline = time.monotonic() + 120
        while len(list(root.glob("ready-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        return library

    onednn._probe = probe
    onednn.gemm_tn(torch.randn(64, 256), torch.randn(64, 128))
    print(onednn.choices()["tn 64x256x128"])
""")


def test_processes_probing_a_shape_at_once_all_run_the_first_recorded_pick(tmp_path):
    """Two processes (the ranks of a run on one machine) probe the same shape at once and find opposite
    libraries faster: both run the pick the first of them recorded, and the file holds it (a rerun reads it),
    so the ranks agree and a rerun repeats the first run bit for bit."""
    env = {**os.environ, "FTITAN_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, lib, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for lib in onednn.LIBRARIES]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    ran = [out.strip() for out, _ in outs]
    saved = json.loads((tmp_path / onednn.CACHE).read_text())
    assert len(saved) == 1 and ran[0] == ran[1] == next(iter(saved.values()))["tn 64x256x128"], (ran, saved)
