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


def _compiled_value_and_grads(fn, *args):
    """``_value_and_grads(fn, *args)`` compiled with inductor (``fullgraph``; ``torch.autograd.grad`` traced, as
    ft.train's autograd path does), its second call profiled: the values and the count of each op that ran."""
    before = torch._dynamo.config.trace_autograd_ops
    torch._dynamo.config.trace_autograd_ops = True
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda *args: _value_and_grads(fn, *args), fullgraph=True)
        compiled(*args)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = compiled(*args)
    finally:
        torch._dynamo.config.trace_autograd_ops = before
        torch._dynamo.reset()
    return got, {e.key: e.count for e in prof.key_averages()}


def test_inductor_compiles_it_with_the_same_gradients():
    x, w, cot = _inputs(seed=1)
    got, counts = _compiled_value_and_grads(onednn.linear, x, w, cot)
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


def _ran(fn, capfd):
    """``fn()`` and the libraries its GEMMs ran, as oneDNN's verbose log (each primitive it executes) and the
    profiler's aten events show them: "onednn" (oneDNN's inner product, ``_linear_pointwise``), "onednn-matmul"
    (oneDNN's matmul primitive, reached through ``aten::mm``/``aten::bmm``), "aten" (an ``aten::mm``/``bmm`` that
    ran no oneDNN primitive: MKL's)."""
    capfd.readouterr()
    verbose = torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON)
    with verbose, profile(activities=[ProfilerActivity.CPU]) as p:
        out = fn()
    log = capfd.readouterr().out.splitlines()
    primitives = [line.split(",")[5] for line in log if line.startswith("onednn_verbose") and ",exec," in line]
    aten = sum(e.count for e in p.key_averages() if e.key in ("aten::mm", "aten::bmm"))
    matmuls = primitives.count("matmul")
    ran = {"onednn"} if "inner_product" in primitives else set()
    return out, ran | ({"onednn-matmul"} if matmuls else set()) | ({"aten"} if aten > matmuls else set())


def _in_each_pinned_library(gemm, want: torch.Tensor, capfd, *, batched: bool = False) -> None:
    """``gemm()`` with each library pinned: that library alone ran, and a dense result equal to ``want``
    (``batched``: oneDNN's inner product has no batch, so its pin runs aten's). On a CPU with AMX the
    "onednn-matmul" pin is refused."""
    for library in onednn.LIBRARIES:
        if library == "onednn-matmul" and onednn._amx():
            with pytest.raises(ValueError, match="this CPU has AMX"):
                onednn.pin(library)
            continue
        onednn.pin(library)
        gemm()  # the first call of a shape under the onednn-matmul pin checks it computes float32
        got, ran = _ran(gemm, capfd)
        assert ran == {"aten" if batched and library == "onednn" else library}, (library, ran)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("rows, m, n", [(96, 384, 512), (256, 768, 64)])  # oneDNN copies g.T; x.T and the result
def test_weight_gradient_gemm_matches_a_float64_reference_in_each_library(fresh_picks, capfd, rows, m, n):
    g = torch.Generator().manual_seed(4)
    gr, x = torch.randn(rows, m, generator=g) * rows**-0.5, torch.randn(rows, n, generator=g)  # sums ~ 1
    want = (gr.double().t() @ x.double()).float()
    _in_each_pinned_library(lambda: onednn.gemm_tn(gr, x), want, capfd)
    assert onednn.choices() == {"pinned": onednn.LIBRARIES[-2 if onednn._amx() else -1]}
    torch.library.opcheck(onednn._tn_op, (gr, x))  # the fake's shape and layout are the op's
    onednn.pin(None)
    torch.testing.assert_close(onednn.gemm_tn(gr, x), want, **TOL)
    picks = onednn.choices()
    assert list(picks) == [f"tn {rows}x{m}x{n}"] and picks[f"tn {rows}x{m}x{n}"] in onednn.LIBRARIES  # probed, kept
    with pytest.raises(ValueError, match=r"pin\('mkl'\): expected one of \('aten', 'onednn', 'onednn-matmul'\)"):
        onednn.pin("mkl")


@pytest.mark.parametrize("transposed", [False, True])  # the forward x @ w.T ("nt"); the input gradient g @ w ("nn")
def test_linear_gemms_match_a_float64_reference_in_each_library(fresh_picks, capfd, transposed):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 48, 384, generator=g), torch.randn(256, 384, generator=g) * 384**-0.5
    if transposed:  # g @ w with w stored (384, 256): passed as its transposed view, read as it lies
        w = torch.randn(384, 256, generator=g).t() * 384**-0.5
    want = (x.double() @ w.double().t()).float()
    _in_each_pinned_library(lambda: onednn.gemm_nt(x, w), want, capfd)
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


def test_gemm_in_runs_the_library_it_names_and_refuses_others(fresh_picks, capfd):
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(32, 96, generator=g), torch.randn(48, 96, generator=g)
    onednn.pin("aten")  # a pin (or a pick) does not change gemm_in's library
    for library in onednn.LIBRARIES[: 2 if onednn._amx() else 3]:
        for kind, want in (("nt", a.double() @ b.double().t()), ("tn", a.double().t() @ a.double())):
            operand = b if kind == "nt" else a
            onednn.gemm_in(library, kind, a, operand)  # onednn-matmul's first call checks float32
            got, ran = _ran(lambda: onednn.gemm_in(library, kind, a, operand), capfd)  # noqa: B023
            assert ran == {library}, (library, kind, ran)
            torch.testing.assert_close(got, want.float(), **TOL)
    with pytest.raises(ValueError, match=r"gemm_in\('mkl', 'nt'\): expected a library of"):
        onednn.gemm_in("mkl", "nt", a, b)
    with pytest.raises(ValueError, match=r"gemm_in\('aten', 'nn'\)"):
        onednn.gemm_in("aten", "nn", a, b)


@pytest.mark.parametrize("fast, want", [("aten", "aten"), ("onednn", "onednn"), ("onednn-matmul", "onednn-matmul"),
                                        ("all", "aten")])  # fmt: skip
def test_probe_picks_the_fastest_library_and_keeps_aten_on_a_tie(monkeypatch, fresh_picks, fast, want):
    """The per-shape probe times every library on the operands: here all but one are slowed by 5 ms a call (far
    more than any GEMM), so the fastest is known; within MARGIN (a tie) aten::mm stays."""
    run = onednn._run

    def timed(kind, library, a, b):
        if fast != library:
            time.sleep(0.005)
        return run(kind, library, a, b)

    monkeypatch.setattr(onednn, "_float32", {})
    monkeypatch.setattr(onednn, "_check_float32", lambda *_: True)  # a CPU without AMX, where it is float32
    monkeypatch.setattr(onednn, "cpuinfo", lambda: {"flags": "avx512f"})
    if fast != "all":
        monkeypatch.setattr(onednn, "_run", timed)
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


def test_a_pick_another_process_recorded_during_the_probe_is_the_one_that_runs(monkeypatch, fresh_picks, capfd):
    """Another rank on the machine probed the same shape at the same time and recorded its pick first: this
    process runs that library too (its own probe's pick is dropped) and leaves the file as it was."""
    g, x = torch.randn(64, 256), torch.randn(64, 128)
    shape = "tn 64x256x128"

    def probe(*_):  # meanwhile, the other process records "onednn"
        (fresh_picks / onednn.CACHE).write_text(json.dumps({onednn._machine(): {shape: "onednn"}}))
        return "aten"

    monkeypatch.setattr(onednn, "_probe", probe)
    got, ran = _ran(lambda: onednn.gemm_tn(g, x), capfd)
    assert ran == {"onednn"}
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
                              stderr=subprocess.PIPE, text=True) for lib in ("aten", "onednn")]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    ran = [out.strip() for out, _ in outs]
    saved = json.loads((tmp_path / onednn.CACHE).read_text())
    assert len(saved) == 1 and ran[0] == ran[1] == next(iter(saved.values()))["tn 64x256x128"], (ran, saved)


BMM_EVENT = "ftitan_kernels::onednn_bmm"


def _bmm_inputs(seed=7):
    """(2, 3, 40, 64) @ (2, 3, 64, 24) with ``b`` a transposed view (attention's keys), and a cotangent."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, 3, 40, 64, generator=g)
    b = (torch.randn(2, 3, 24, 64, generator=g) * 64**-0.5).mT
    return a, b, torch.randn(2, 3, 40, 24, generator=g)


def test_batched_matmul_and_its_gradients_match_float64_in_each_library(fresh_picks, capfd):
    a, b, cot = _bmm_inputs()
    want = _value_and_grads(torch.matmul, a.double(), b.double(), cot.double())
    a3, b3 = a.reshape(6, 40, 64), b.reshape(6, 64, 24)  # the op's 3-D operands
    _in_each_pinned_library(lambda: onednn._bmm_op(a3, b3), want[0].float().reshape(6, 40, 24), capfd, batched=True)
    torch.library.opcheck(onednn._bmm_op, (a3, b3))
    onednn.pin(None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = _value_and_grads(onednn.matmul, a, b, cot)
    assert {e.key: e.count for e in prof.key_averages()}[BMM_EVENT] == 3  # the product and both gradients
    torch.testing.assert_close(got, [t.float() for t in want], **TOL)
    # probed per shape and layout: the forward reads b transposed, the gradients g @ b.T and a.T @ g
    assert set(onednn.choices()) == {"bmm-nt 6x40x64x24", "bmm-nn 6x40x24x64", "bmm-tn 6x64x40x24"}
    assert set(onednn.choices().values()) <= {"aten", "onednn-matmul"}  # no batched inner product


def test_batched_matmul_compiles_and_steps_aside_under_transforms(monkeypatch):
    a, b, cot = _bmm_inputs(seed=8)
    want = [t.float() for t in _value_and_grads(torch.matmul, a.double(), b.double(), cot.double())]
    got, counts = _compiled_value_and_grads(onednn.matmul, a, b, cot)
    assert counts[BMM_EVENT] == 3  # from inductor's code
    torch.testing.assert_close(got, want, **TOL)
    spy = Spy(monkeypatch, onednn, ("_bmm_op",))
    assert torch.equal(torch.func.grad(lambda a: (onednn.matmul(a, b) * cot).sum())(a),
                       torch.func.grad(lambda a: (torch.matmul(a, b) * cot).sum())(a))  # fmt: skip
    _, tangent = torch.func.jvp(lambda b: onednn.matmul(a, b), (b,), (b.flip(0),))
    assert torch.equal(tangent, torch.func.jvp(lambda b: torch.matmul(a, b), (b,), (b.flip(0),))[1])
    assert torch.equal(onednn.matmul(a.bfloat16(), b.bfloat16()), torch.matmul(a.bfloat16(), b.bfloat16()))
    assert spy.total() == 0  # plain torch.matmul under transforms and for bfloat16


def test_onednn_matmul_runs_only_where_it_computes_float32(monkeypatch, fresh_picks):
    """Torch reaches oneDNN's matmul for float32 operands only under a setting that lets oneDNN round them to
    bfloat16 (it does on AMX): the check finds a library that does (operands rounded here), which is then never
    probed, and its pin refuses the shape; a plain float32 GEMM passes the check. On an AMX CPU the pin is
    refused outright."""
    g, x = torch.randn(64, 96), torch.randn(64, 48)
    run = onednn._run

    def rounding(kind, library, a, b):  # "onednn-matmul" as oneDNN runs it on AMX: bfloat16 operands
        if library == "onednn-matmul":
            return run(kind, "aten", a.bfloat16().float(), b.bfloat16().float())
        return run(kind, library, a, b)

    def plain(kind, library, a, b):
        return run(kind, "aten" if library == "onednn-matmul" else library, a, b)

    monkeypatch.setattr(onednn, "cpuinfo", lambda: {"flags": "avx512f avx512_bf16"})
    monkeypatch.setattr(onednn, "_run", plain)
    assert onednn._check_float32("tn", g, x)
    monkeypatch.setattr(onednn, "_run", rounding)
    assert not onednn._check_float32("tn", g, x)
    monkeypatch.setattr(onednn, "_float32", {})
    assert onednn._candidates("tn", g, x) == ["aten", "onednn"]
    assert onednn._candidates("bmm", g.t()[None], x[None]) == ["aten"]  # nor the inner product: it has no batch
    onednn.pin("onednn-matmul")
    with pytest.raises(RuntimeError, match=r"does not compute tn 64x96x48 in float32 on this machine"):
        onednn.gemm_tn(g, x)
    onednn.pin(None)
    monkeypatch.setattr(onednn, "cpuinfo", lambda: {"flags": "avx512f amx_bf16 amx_tile"})
    monkeypatch.setattr(onednn, "_float32", {})
    with pytest.raises(ValueError, match=r"pin\('onednn-matmul'\) \(--gemm-library onednn-matmul\): this CPU has AMX"):
        onednn.pin("onednn-matmul")
    monkeypatch.setattr(onednn, "_run", plain)  # a check would pass now: on AMX it must not run at all
    monkeypatch.setattr(onednn, "_check_float32", lambda *_: pytest.fail("checked a product on an AMX CPU"))
    assert not onednn.float32_exact("tn", g, x)
    assert onednn._candidates("tn", g, x) == ["aten", "onednn"]


@pytest.mark.parametrize("t, window, calls", [(128, None, 12), (1088, 64, 6)])  # 2 query blocks; bands
def test_the_cpu_attention_runs_its_gemms_here_with_kernels(fresh_picks, t, window, calls):
    """``nn.attention(impl="gemm")`` with ``kernels="triton"``: its GEMMs (two per query block forward and four
    backward; a windowed row past ``GEMM_MAX_SEQ`` as bands: two and four in all) run the batched op, with the
    values and gradients of ``kernels="torch"``'s ``torch.matmul``."""
    from ftitan import nn

    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, t, h, 32, generator=g) for h in (4, 2, 2))
    cot = torch.randn(2, t, 4, 32, generator=g)

    def run(kernels):
        qkv = [x.detach().requires_grad_() for x in (q, k, v)]
        out = nn.attention(*qkv, impl="gemm", window=window, kernels=kernels)
        return [out.detach(), *torch.autograd.grad((out * cot).sum(), qkv)]

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = run("triton")
    assert {e.key: e.count for e in prof.key_averages()}.get(BMM_EVENT) == calls
    torch.testing.assert_close(got, run("torch"), **TOL)
