"""FP8 training of linear layers (``ftitan.nn.float8``): torchao's recipes, emulated on the CPU.

torchao's ``matmul_with_hp_or_float8_args`` (the independent reference: its casts and GEMMs, emulated in
float32 off CUDA) against ftitan's own implementation of the recipes (``float8.reference``, the path under
``torch.func``); the quantization grid; ``grad`` / ``vmap`` / ``jvp``; a compiled gradient; every family
with a ``float8`` field on both gradient paths; the config's and the CLI's errors.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.func import grad, jvp, vmap

import ftitan as ft
from ftitan.kernels.grouped_mm import grouped_mm as plain_grouped_mm
from ftitan.nn import float8
from tests.tiny_families import family, tiny_config

RECIPES = float8.RECIPES
FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3")


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 24, 64, generator=g).to(dtype)
    x[0, 3] *= 40.0  # an outlier row: per-tensor and per-row scales then differ
    w = (torch.randn(48, 64, generator=g) * 0.05).to(dtype)
    gy = torch.randn(2, 24, 48, generator=g).to(dtype)
    return x, w, gy


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _fq(t: torch.Tensor, dtype: torch.dtype, recipe: str, dim: int) -> torch.Tensor:
    axiswise = recipe == "rowwise"
    return float8.fake_quantize(t, dtype, dim if axiswise else None, pow2=axiswise)


def _recipe_gradients(x, w, gy, recipe):
    """The recipe's backward as torchao documents it, written out here: the output gradient cast to float8
    (e5m2 per tensor / e4m3 per row for the input gradient, per column for the weight gradient), ``w``
    scaled per input column and ``x`` per column for their GEMMs."""
    g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
    gdt = float8.E5M2 if recipe == "tensorwise" else float8.E4M3
    gx = (_fq(g2, gdt, recipe, -1) @ _fq(w, float8.E4M3, recipe, 0)).to(x.dtype).reshape(x.shape)
    gw = (_fq(g2, gdt, recipe, 0).t() @ _fq(x2, float8.E4M3, recipe, 0)).to(w.dtype)
    return gx, gw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_torchao_matches_the_recipe_written_out(recipe, dtype):
    """torchao's (emulated) output equals ftitan's reference bit for bit, and its two gradients equal the
    recipe's backward written out here; the reference's straight-through gradients (the torch.func path)
    are ``g @ wq`` and ``g.T @ xq`` exactly and within float8's error of torchao's. All differ from the
    high-precision linear by what float8 costs (a few percent), so the casts really happen."""
    x, w, gy = _inputs(dtype)
    x.requires_grad_(), w.requires_grad_()
    y_ao = float8.linear(x, w, recipe=recipe)  # no transform active: torchao's Function
    y_ref = float8.reference(x, w, recipe=recipe)
    assert y_ao.dtype == y_ref.dtype == dtype
    assert torch.equal(y_ao, y_ref)
    g_ao = torch.autograd.grad(y_ao, (x, w), gy)
    for a, b in zip(g_ao, _recipe_gradients(x.detach(), w.detach(), gy, recipe)):
        assert a.dtype == dtype and torch.equal(a, b)
    gx, gw = torch.autograd.grad(y_ref, (x, w), gy)
    xq, wq = _fq(x.detach(), float8.E4M3, recipe, -1), _fq(w.detach(), float8.E4M3, recipe, -1)
    g2 = gy.reshape(-1, 48).float()
    assert torch.equal(gx, (g2 @ wq).to(dtype).reshape(x.shape))
    assert torch.equal(gw, (g2.t() @ xq.reshape(-1, 64)).to(dtype))
    assert _rel(gx, g_ao[0]) < 0.1 and _rel(gw, g_ao[1]) < 0.1
    exact = x.float() @ w.float().t()
    assert 1e-3 < _rel(y_ref, exact) < 0.1


def test_the_two_recipes_differ_where_a_row_is_an_outlier():
    """Per-row scales keep the ordinary rows precise when one row is 10^5x larger; one scale per tensor pushes
    them into e4m3's subnormals (a float8 type's relative precision holds only over its normal range)."""
    x, w, _ = _inputs(torch.float32)
    x[0, 3] *= 2500.0  # 40 * 2500 = 10^5
    exact = x @ w.t()
    err = {r: (float8.reference(x, w, recipe=r) - exact)[1].norm() / exact[1].norm() for r in RECIPES}
    assert err["rowwise"] < err["tensorwise"] / 2


def test_fake_quantize_lands_on_the_float8_grid():
    t = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * 3
    for dtype in (float8.E4M3, float8.E5M2):
        q = float8.fake_quantize(t, dtype)
        scale = torch.finfo(dtype).max / t.abs().amax().double()
        scaled = (q.double() * scale).float()
        assert torch.equal(scaled.to(dtype).float(), scaled), "not representable in the float8 type"
        assert scaled.abs().max() == torch.finfo(dtype).max  # the amax maps to the type's largest value
    q = float8.fake_quantize(t, float8.E4M3, -1, pow2=True)
    for row, qrow in zip(t, q):  # per row; a power-of-two scale is exact, so q * scale is on the grid
        s = torch.exp2(torch.floor(torch.log2(torch.finfo(float8.E4M3).max / row.abs().amax())))
        assert torch.equal((qrow * s).to(float8.E4M3).float(), qrow * s)
        assert (qrow * s).abs().max() <= torch.finfo(float8.E4M3).max
    assert float8.fake_quantize(torch.zeros(4), float8.E4M3).eq(0).all()  # amax 0: the 1e-12 floor, no nan


@pytest.mark.parametrize("recipe", RECIPES)
def test_transforms_see_the_reference(recipe):
    """Under ``grad``/``vmap``/``jvp`` the reference runs: the gradient equals its autograd gradient, a vmap
    equals a loop of single examples, and the tangent is the straight-through one (casts as identity);
    compiled (fullgraph) the same."""
    x, w, gy = _inputs(torch.float32)
    gx_ref, gw_ref = torch.autograd.grad(float8.reference(x.requires_grad_(), w.requires_grad_(), recipe=recipe),
                                         (x, w), gy)  # fmt: skip
    x, w = x.detach(), w.detach()

    def loss(x, w):
        return (float8.linear(x, w, recipe=recipe) * gy).sum()

    gx, gw = grad(loss, argnums=(0, 1))(x, w)
    assert torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref)
    per_example = vmap(lambda xi: float8.linear(xi, w, recipe=recipe))(x)
    assert torch.equal(per_example, torch.stack([float8.reference(xi, w, recipe=recipe) for xi in x]))
    tx, tw = torch.randn_like(x), torch.randn_like(w)
    fq = lambda t: _fq(t, float8.E4M3, recipe, -1)  # noqa: E731
    _, tangent = jvp(lambda x, w: float8.linear(x, w, recipe=recipe), (x, w), (tx, tw))
    torch.testing.assert_close(tangent, tx @ fq(w).t() + fq(x.reshape(-1, 64)).reshape(x.shape) @ tw.t())
    compiled = torch.compile(lambda x, w: (grad(loss, argnums=(0, 1))(x, w), jvp(loss, (x, w), (tx, tw))[1]),
                             fullgraph=True)  # fmt: skip
    (cgx, cgw), ctangent = compiled(x, w)
    torch.testing.assert_close(cgx, gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cgw, gw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ctangent, jvp(loss, (x, w), (tx, tw))[1], rtol=1e-5, atol=1e-4)


def test_compiled_gradient_equals_eager(monkeypatch):
    """torchao's Function inside ``torch.compile(fullgraph=True)`` with ``torch.autograd.grad`` traced (the
    train step's autograd path): the values and gradients of the eager call. Before ``float8.prepare``
    (which a model config's check runs) the compile is refused with one line naming it."""
    x, w, gy = _inputs(torch.float32)

    def f(x, w, gy):
        y = float8.linear(x, w, recipe="tensorwise")
        return (y.detach(), *torch.autograd.grad(y, (x, w), gy))

    x, w = x.requires_grad_(), w.requires_grad_()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        with monkeypatch.context() as m:  # as in a fresh process: nothing prepared yet
            m.setattr(float8, "_TORCHAO", {})
            with pytest.raises(Exception, match=r"before float8\.prepare\('tensorwise'\)"):
                torch.compile(f, fullgraph=True)(x, w, gy)
        torch._dynamo.reset()
        float8.prepare("tensorwise")
        compiled = torch.compile(f, fullgraph=True)(x, w, gy)
    for a, b in zip(compiled, f(x, w, gy)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _model(name: str, recipe: str = ""):
    extra = {"kv_lora_rank": 12} if name == "deepseek_v3" else {}  # kv_a width 12 + 4: a multiple of 16
    cfg = tiny_config(name, **extra)
    return family(name).model(ft.config.with_float8(recipe)(cfg) if recipe else cfg)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_float8_gradients_on_both_paths(name, monkeypatch):
    """A model with ``float8``: its logits move by what float8 costs; the loss gradient on the torch.func
    path (the reference) equals the autograd gradient of the reference model to float32 rounding, and the
    autograd path's (torchao, the output gradients cast to float8 too) within float8's error."""
    model, plain = _model(name, "tensorwise"), _model(name)
    params = plain.init(ft.random.key(0))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss_fn = ft.train.next_token_loss(model)
    g_func = ft.tree.leaves(grad(lambda p: loss_fn(p, batch)[0])(params))

    def autograd_grads():
        p_leaf = ft.tree.map(lambda t: t.detach().requires_grad_(), params)
        leaves = ft.tree.leaves(p_leaf)
        gs = torch.autograd.grad(loss_fn(p_leaf, batch)[0], leaves, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, gs)]

    g_torchao = autograd_grads()
    monkeypatch.setattr(float8, "linear", lambda x, w, b=None, *, recipe: float8.reference(x, w, b, recipe=recipe))
    for a, b in zip(g_func, autograd_grads()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    assert 1e-3 < _rel(flat(g_func), flat(g_torchao)) < 0.06  # measured 1.5-2.8% (tensorwise)
    out, ref = model.apply(params, batch["inputs"]), plain.apply(params, batch["inputs"])
    out, ref = (o[0] if isinstance(o, tuple) else o for o in (out, ref))
    assert 1e-4 < _rel(out, ref) < 0.3


def test_per_example_gradients_of_a_float8_model_equal_a_loop():
    """``vmap(grad(loss))`` over a batch of a float8 llama equals ``grad`` of each example alone (its scales are
    then each example's own, as a vmap of one example's function means)."""
    model = _model("llama", "rowwise")
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model)
    tokens = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(2))

    def loss(p, row):
        return loss_fn(p, {"inputs": row[None, :-1], "targets": row[None, 1:]})[0]

    batched = vmap(grad(loss), in_dims=(None, 0))(params, tokens)
    for i in range(3):
        one = grad(loss)(params, tokens[i])
        for a, b in zip(ft.tree.leaves(batched), ft.tree.leaves(one)):
            torch.testing.assert_close(a[i], b, rtol=1e-5, atol=1e-6)


def test_float8_step_trains_like_fp32():
    """Ten AdamW steps of a tiny llama with float8 (autograd path, torchao emulated): the loss falls as the
    fp32 run's does, within 2% of it at every step."""
    fp32, f8 = _train_losses(_model("llama")), _train_losses(_model("llama", "rowwise"))
    assert f8[-1] < f8[0] - 0.3
    assert all(abs(a - b) < 0.02 * b for a, b in zip(f8, fp32)), (f8, fp32)


def _train_losses(model) -> list[float]:
    """Ten AdamW steps on one batch, on the gradient path ``ftitan train`` picks for the model's config."""
    opt = ft.optim.adamw(3e-3)
    grad_impl = ft.train.runtime.gradient_path(**ft.train.runtime.step_options(model.config))
    step = ft.train.make_train_step(ft.train.next_token_loss(model), opt, grad_impl=grad_impl)
    state = ft.train.init_state(model.init(ft.random.key(0)), opt)
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    out = []
    for _ in range(10):
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return out


def test_float8_picks_the_autograd_path():
    assert ft.train.runtime.gradient_path(float8="tensorwise") == "autograd"
    assert ft.train.runtime.gradient_path(float8="") == "func"
    assert ft.train.runtime.step_options(_model("llama", "rowwise").config)["float8"] == "rowwise"


def test_config_errors_name_the_field_and_the_fix():
    from ftitan.models import llama

    base = llama.Config.debug()
    with pytest.raises(ValueError, match=r"llama\.Config\.float8='fp8'.*tensorwise"):
        attrs.evolve(base, float8="fp8")
    with pytest.raises(ValueError, match=r"batch_invariant.*float8=''"):
        attrs.evolve(base, float8="rowwise", attn_impl="batch_invariant")
    with pytest.raises(ValueError, match=r"multiple of 16.*'ffn_dim': 776"):
        attrs.evolve(base, float8="rowwise", ffn_dim=776)
    with pytest.raises(ValueError, match=r"--float8='rowwise'.*muse_glimmer.*drop --float8"):
        ft.config.with_float8("rowwise")(tiny_config("muse_glimmer"))
    with pytest.raises(ValueError, match=r"--float8='e4m3'"):
        ft.config.with_float8("e4m3")


def test_train_config_float8_flag(monkeypatch):
    """``--float8`` sets the model config's field, also under a parallel layout (the scales are each rank's:
    tests/parallel/test_float8_parallel.py); a family without the field is refused naming ``--float8``."""
    from ftitan.models import muse_glimmer

    base = ft.config.get_recipe("llama3-debug")
    cfg = ft.config.validate(attrs.evolve(base, float8="tensorwise"))
    assert cfg.model.float8 == "tensorwise"
    glimmer = muse_glimmer.Config.debug()
    with pytest.raises(ValueError, match=r"--float8='rowwise'.*drop --float8"):
        ft.config.validate(attrs.evolve(base, float8="rowwise", model=glimmer))
    with pytest.raises(ValueError, match=r"--float8='fp8'"):
        ft.config.validate(attrs.evolve(base, float8="fp8"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    par = ft.config.validate(attrs.evolve(base, float8="rowwise", parallel=attrs.evolve(base.parallel, dp_shard=2)))
    assert par.model.float8 == "rowwise" and par.parallel.world_size == 2


def test_ftitan_train_float8(capsys, tmp_path):
    """``ftitan train --float8 rowwise`` trains (torchao emulated, the autograd path) and writes its metrics;
    ``--float8 fp8`` is one error line naming the flag and the recipes."""
    import json

    from ftitan.__main__ import main
    from tests.test_cli_errors import TINY, one_error_line

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(200)))
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data.corpus", str(corpus), "--run-dir", str(run), "--float8", "rowwise"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in records)
    capsys.readouterr()
    rc = main(["train", *TINY, "--data.corpus", str(corpus), "--run-dir", str(tmp_path / "bad"), "--float8", "fp8"])
    line = one_error_line(capsys, rc)
    assert "--float8='fp8'" in line and "'tensorwise'" in line


def test_a_gpu_older_than_sm89_is_refused_naming_the_flag(monkeypatch):
    """On CUDA the float8 GEMMs need compute capability 8.9+: an A100 (8.0) is one clear error, up front."""
    from ftitan.train import runtime

    monkeypatch.setattr(runtime, "resolve_device", lambda *a, **k: torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "resolve_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    base = ft.config.get_recipe("llama3-debug")
    with pytest.raises(ValueError, match=r"--float8='tensorwise'.*8\.9.*\(8, 0\).*drop --float8"):
        ft.config.validate(attrs.evolve(base, float8="tensorwise"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # an H100/H200 passes this rule
    assert ft.config.validate(attrs.evolve(base, float8="tensorwise")).model.float8 == "tensorwise"


# ---------------------------------------------------------------- MoE experts: float8 grouped GEMMs

COUNTS = (5, 0, 19, 8)  # rows per expert, one expert without rows


def _grouped_inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    x = torch.randn(int(offs[-1]), 32, generator=g)
    x[3] *= 30.0  # an outlier row
    w = (torch.randn(len(COUNTS), 48, 32, generator=g) * 0.1).transpose(-2, -1)  # (E, K, N), as experts pass it
    gy = torch.randn(int(offs[-1]), 48, generator=g)
    return x.to(dtype), w.to(dtype), offs, gy.to(dtype)


def _grouped_recipe_written_out(x, w, gy):
    """torchao's rowwise MoE recipe as a loop over the experts: e4m3, power-of-two scales along each GEMM's
    reduction axis; the weight gradient's over each expert's own rows."""
    fq = lambda t, dim: float8.fake_quantize(t, float8.E4M3, dim, pow2=True)  # noqa: E731
    ys, gxs, gws, start = [], [], [], 0
    for e, n in enumerate(COUNTS):
        xe, ge = x[start : start + n], gy[start : start + n]
        ys.append(fq(xe, -1) @ fq(w[e], 0))
        gxs.append(fq(ge, -1) @ fq(w[e], 1).t())
        gws.append(fq(xe, 0).t() @ fq(ge, 0) if n else torch.zeros(w.shape[1:]))
        start += n
    return torch.cat(ys).to(x.dtype), torch.cat(gxs).to(x.dtype), torch.stack(gws).to(w.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_float8_matches_the_recipe_written_out(dtype):
    """The experts' float8 grouped GEMM (autograd path, emulated) is the recipe's loop over experts, bit for
    bit: output, input gradient and weight gradient (an expert without rows gets a zero gradient)."""
    x, w, offs, gy = _grouped_inputs(dtype)
    x, w = x.requires_grad_(), w.requires_grad_()
    y = float8.grouped_mm(x, w, offs)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    ref_y, ref_gx, ref_gw = _grouped_recipe_written_out(x.detach(), w.detach(), gy)
    assert torch.equal(y, ref_y) and torch.equal(gx, ref_gx) and torch.equal(gw, ref_gw)
    assert gw[1].eq(0).all() and y.dtype == gx.dtype == dtype
    plain = torch.autograd.grad(plain_grouped_mm(x, w, offs), (x, w), gy)
    assert 1e-4 < _rel(gw, plain[1]) < 0.1  # float8's rounding, not another computation


def test_pad_groups_aligns_every_expert_and_changes_nothing():
    """``pad_groups`` (the CUDA path's alignment for ``torch._scaled_grouped_mm``): each expert's rows start at
    a multiple of 16, ``x_padded[dest]`` is ``x``, rows past the last expert go to the spare last row, and the
    float8 GEMM on the padded rows gives the unpadded one's rows."""
    x, w, offs, _ = _grouped_inputs(torch.float32)
    extra = torch.cat([x, torch.randn(3, 32)])  # 3 rows past offs[-1]: in no expert (the EP padded exchange's)
    x_padded, offs_padded, dest = float8.pad_groups(extra, offs)
    assert offs_padded.tolist() == [16, 16, 48, 64] and x_padded.shape[0] == -(-(35 + 4 * 15) // 16) * 16 + 1
    assert torch.equal(x_padded[dest[: x.shape[0]]], x) and dest[x.shape[0] :].eq(x_padded.shape[0] - 1).all()
    assert x_padded[-1].eq(0).all()  # the rows in no group go in as zeros
    starts = (offs_padded - torch.tensor([16, 0, 32, 16])).tolist()
    assert all(s % 16 == 0 for s in starts)
    y = float8.grouped_mm(x, w, offs)
    assert torch.equal(float8.grouped_mm(x_padded[:-1], w, offs_padded)[dest[: x.shape[0]]], y)


def test_the_cuda_glue_around_torchao_keeps_values_and_gradients(monkeypatch):
    """``_torchao_grouped`` (pad, torchao's Function, unpad) with the emulation standing in for torchao's CUDA
    Function (same signature, same recipe): values and gradients equal the unpadded emulation's bit for bit
    (zero rows change no row's or expert's scale); rows past the last expert come back zero, and get a zero
    gradient whatever the GEMM leaves in their row."""
    calls = []

    def torchao_stand_in(a, b_t, offs, out_dtype, pad_token_groups_for_grouped_mm):
        assert not pad_token_groups_for_grouped_mm and a.is_contiguous() and b_t.stride(-2) == 1  # col-major
        calls.append([int(o) % 16 for o in offs])
        return float8._GroupedRowwise.apply(a, b_t, offs).to(out_dtype)

    monkeypatch.setattr(float8, "_TORCHAO_GROUPED", [torchao_stand_in])
    x, w, offs, gy = _grouped_inputs(torch.bfloat16)
    extra = torch.cat([x, torch.randn(3, 32).to(torch.bfloat16)]).requires_grad_()
    w = w.requires_grad_()
    y = float8._torchao_grouped(extra, w, offs)
    g_extra = torch.cat([gy, torch.ones(3, 48, dtype=gy.dtype)])
    gx, gw = torch.autograd.grad(y, (extra, w), g_extra)
    ref = extra.detach()[: x.shape[0]].requires_grad_()
    ref_y = float8.grouped_mm(ref, w, offs)
    ref_gx, ref_gw = torch.autograd.grad(ref_y, (ref, w), gy)
    assert calls == [[0, 0, 0, 0]]  # every expert's rows padded to a multiple of 16
    assert torch.equal(y[: x.shape[0]], ref_y) and y[x.shape[0] :].eq(0).all()
    assert torch.equal(gx[: x.shape[0]], ref_gx) and gx[x.shape[0] :].eq(0).all() and torch.equal(gw, ref_gw)


def test_grouped_float8_under_transforms_and_compile():
    """Under ``grad``/``jvp`` the straight-through reference runs (the forward's casts, differentiated as the
    identity); compiled with ``torch.autograd.grad`` traced (the train step's autograd path), the emulated
    recipe equals eager."""
    x, w, offs, gy = _grouped_inputs(torch.float32)
    fq = lambda t, dim: float8.fake_quantize(t, float8.E4M3, dim, pow2=True)  # noqa: E731
    gx, gw = grad(lambda x, w: (float8.grouped_mm(x, w, offs) * gy).sum(), argnums=(0, 1))(x, w)
    assert torch.equal(gx, plain_grouped_mm(gy, fq(w, -2).transpose(-2, -1), offs))
    assert torch.equal(gw, torch._grouped_mm(fq(x, -1).t(), gy, offs=offs))
    tx = torch.randn_like(x)
    _, tangent = jvp(lambda x: float8.grouped_mm(x, w, offs), (x,), (tx,))
    # forward AD runs grouped_mm's dense form (every expert's GEMM, masked): float32 rounding apart
    torch.testing.assert_close(tangent, plain_grouped_mm(tx, fq(w, -2), offs), rtol=1e-6, atol=1e-6)

    def f(x, w):
        y = float8.grouped_mm(x, w, offs)
        return (y.detach(), *torch.autograd.grad(y, (x, w), gy))

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(f, fullgraph=True)(x.requires_grad_(), w.requires_grad_())
    for a, b in zip(compiled, f(x, w)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_moe_family_with_float8_experts(name, monkeypatch):
    """``float8_experts``: the routed experts run the float8 grouped GEMM (counted), the logits move by what
    float8 costs, the torch.func gradient equals the autograd gradient of the reference model, and the
    autograd path's (the recipe's backward casts) is within float8's error of it."""
    cfg = attrs.evolve(tiny_config(name), float8_experts=True)
    model, plain = family(name).model(cfg), family(name).model(tiny_config(name))
    params = plain.init(ft.random.key(0))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss_fn = ft.train.next_token_loss(model)
    calls = []
    real = float8.grouped_mm
    monkeypatch.setattr(float8, "grouped_mm", lambda *a: calls.append(1) or real(*a))
    g_func = ft.tree.leaves(grad(lambda p: loss_fn(p, batch)[0])(params))
    moe_layers = len(model.config.moe_layers) if name == "qwen3_moe" else cfg.n_layers - cfg.n_dense_layers
    assert len(calls) == 3 * moe_layers  # gate, up, down of every MoE layer

    def autograd_grads():
        p_leaf = ft.tree.map(lambda t: t.detach().requires_grad_(), params)
        leaves = ft.tree.leaves(p_leaf)
        gs = torch.autograd.grad(loss_fn(p_leaf, batch)[0], leaves, allow_unused=True)  # the router bias: none
        return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, gs)]

    g_recipe = autograd_grads()
    monkeypatch.setattr(float8, "grouped_mm", float8.grouped_reference)
    for a, b in zip(g_func, autograd_grads()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    assert 1e-4 < _rel(flat(g_func), flat(g_recipe)) < 0.06
    out, ref = model.apply(params, batch["inputs"]), plain.apply(params, batch["inputs"])
    out, ref = (o[0] if isinstance(o, tuple) else o for o in (out, ref))
    assert 1e-4 < _rel(out, ref) < 0.3
    assert ft.train.runtime.step_options(cfg)["float8"] == "rowwise"  # the autograd path: the recipe's casts


def test_float8_experts_train_like_fp32():
    """Ten AdamW steps of a tiny Qwen3-MoE with float8 experts and rowwise projections (autograd path): the
    loss falls as the fp32 run's does, within 2% of it at every step."""
    cfg = tiny_config("qwen3_moe")
    fp32 = _train_losses(family("qwen3_moe").model(cfg))
    f8 = _train_losses(family("qwen3_moe").model(attrs.evolve(cfg, float8="rowwise", float8_experts=True)))
    assert f8[-1] < f8[0] - 0.3
    assert all(abs(a - b) < 0.02 * b for a, b in zip(f8, fp32)), (f8, fp32)


def test_float8_experts_errors(monkeypatch):
    """Widths not multiples of 16 and batch invariance are refused by the config; on CUDA a GPU below
    compute capability 9.0 (no ``torch._scaled_grouped_mm``) by validation, naming the flag."""
    from ftitan.train import runtime

    with pytest.raises(ValueError, match=r"float8_experts needs the experts' widths.*16.*'expert_dim': 24"):
        attrs.evolve(tiny_config("qwen3_moe"), float8_experts=True, expert_dim=24)
    with pytest.raises(ValueError, match=r"deepseek_v3.*float8_experts.*batch_invariant.*float8_experts=False"):
        attrs.evolve(tiny_config("deepseek_v3"), float8_experts=True, attn_impl="batch_invariant")
    from ftitan.nn.moe import MoEConfig  # a MoEConfig built by hand too: the invariant experts have no float8 path

    with pytest.raises(ValueError, match=r"MoEConfig: float8_experts=True with batch_invariant=True"):
        MoEConfig(n_experts=4, top_k=2, expert_dim=16, batch_invariant=True, float8_experts=True)
    base = ft.config.get_recipe("qwen3-moe-debug")
    monkeypatch.setattr(runtime, "resolve_device", lambda *a, **k: torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "resolve_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    on = attrs.evolve(base, model=attrs.evolve(base.model, float8_experts=True))
    with pytest.raises(ValueError, match=r"--model\.float8-experts=True.*9\.0.*\(8, 9\).*drop"):
        ft.config.validate(on)
