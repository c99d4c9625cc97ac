"""Regional compile (ftitan.train.regional): one compiled block serves every layer (no recompiles), one
region per layer kind, the same loss and gradients as eager, with remat, through the runtime and the CLI."""

import json
import subprocess
import sys

import attrs
import pytest
import torch
from torch._dynamo.utils import counters

import ftitan as ft
from ftitan import tree as T
from ftitan.models import deepseek_v3, llama, muse_glimmer, qwen3_moe, qwen3_next
from ftitan.train import regional
from ftitan.train.step import value_and_grad

TINY = {
    "llama": (llama, dict(vocab_size=128, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64)),
    "qwen3_moe": (qwen3_moe, dict(vocab_size=128, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                                  expert_dim=16, ffn_dim=64)),  # fmt: skip
    "qwen3_next": (qwen3_next, dict(vocab_size=128, n_layers=4)),  # layers: 3 Gated DeltaNet, 1 attention
    "deepseek_v3": (deepseek_v3, dict(vocab_size=128, n_layers=4, n_dense_layers=1)),  # 1 dense, 3 MoE blocks
    # 3 sliding-window RoPE layers, 1 global NoPE layer (window 8 < T: the windows mask)
    "muse_glimmer": (muse_glimmer, dict(vocab_size=128, n_layers=4, window=8)),
}


def tiny(family, **kw):
    mod, base = TINY[family]
    return mod.model(attrs.evolve(mod.Config.debug(), **(base | kw)))


def batch(b=2, t=16, seed=0):
    tokens = torch.randint(0, 128, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def regional_grads(model, params, b, steps=2):
    fn = value_and_grad(ft.train.next_token_loss(model), impl="autograd")
    with regional.compiling("aot_eager"):
        for _ in range(steps):
            out = fn(params, b)
    return out


def assert_close_trees(a, b, **tol):
    for path, x, y in zip(T.paths(a), T.leaves(a), T.leaves(b), strict=True):
        torch.testing.assert_close(x, y, msg=lambda m, p=path: f"{path}: {m}", **tol)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_one_compile_serves_every_layer_without_recompiles():
    """4 layers, 2 steps (new closures over new RoPE angles each step): one graph, and a recompile would raise."""
    model = tiny("llama")
    params, b = model.init(ft.random.key(0)), batch()
    with torch._dynamo.config.patch(error_on_recompile=True):
        regional_grads(model, params, b)
        regional_grads(model, params, batch(seed=1))  # other tokens, same shapes
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(("family", "kinds"), [("qwen3_moe", 1), ("qwen3_next", 2), ("deepseek_v3", 2),
                                               ("muse_glimmer", 2)])  # fmt: skip
def test_one_region_per_layer_kind(family, kinds):
    """Qwen3-Next's linear-attention and full-attention layers (DeepSeek-V3's dense and MoE blocks) differ by
    their params' keys, Muse Glimmer's by the (RoPE base, window) its block reads for the layer index
    (``run_stage``'s ``layer_kind``): two graphs for four layers; a second step compiles nothing new."""
    model = tiny(family)
    params, b = model.init(ft.random.key(0)), batch()
    regional_grads(model, params, b, steps=1)
    assert counters["stats"]["unique_graphs"] == kinds
    with torch._dynamo.config.patch(error_on_recompile=True):
        regional_grads(model, params, batch(seed=1), steps=1)
    assert counters["stats"]["unique_graphs"] == kinds


@pytest.mark.parametrize("family", list(TINY))
def test_loss_and_gradients_equal_eager(family):
    """Against the eager torch.func path: aot_eager runs the same aten ops, so to float rounding (1e-6);
    Qwen3-Next's autograd path sums its residual gradients in another order (1.5e-7, see test_remat)."""
    model = tiny(family)
    params, b = model.init(ft.random.key(0)), batch()
    ref, (ref_loss, _) = value_and_grad(ft.train.next_token_loss(model), impl="func")(params, b)
    grads, (loss, _) = regional_grads(model, params, b)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_close_trees(grads, ref, rtol=1e-6, atol=1e-6)


def test_regional_with_remat_full():
    model = tiny("llama", remat="full")
    params, b = model.init(ft.random.key(0)), batch()
    ref, _ = value_and_grad(ft.train.next_token_loss(tiny("llama")), impl="func")(params, b)
    with torch._dynamo.config.patch(error_on_recompile=True):
        grads, _ = regional_grads(model, params, b)
    assert counters["stats"]["unique_graphs"] == 1
    assert_close_trees(grads, ref, rtol=1e-6, atol=1e-6)


def test_outside_the_context_blocks_run_eagerly():
    model = tiny("llama")
    params, b = model.init(ft.random.key(0)), batch()
    value_and_grad(ft.train.next_token_loss(model), impl="autograd")(params, b)
    assert counters["stats"]["unique_graphs"] == 0
    assert regional.backend_of("regional") == "inductor" and regional.backend_of("regional:aot_eager") == "aot_eager"
    assert regional.backend_of(True) is None and regional.backend_of("aot_eager") is None


def test_runtime_regional_step_matches_the_eager_step():
    from ftitan.train import runtime

    model = tiny("llama")
    params, b = model.init(ft.random.key(0)), batch()
    rt = runtime.setup(runtime.ParallelConfig(), device="cpu")
    opt = ft.optim.adamw(1e-2)
    loss_fn = ft.train.next_token_loss(model)
    step = rt.make_step(model, loss_fn, opt, accum_steps=1, compile="regional:aot_eager", update_buffers=None)
    state, m = step(ft.train.init_state(T.map(torch.clone, params), opt), b)
    want, m_want = ft.train.make_train_step(loss_fn, opt)(ft.train.init_state(T.map(torch.clone, params), opt), b)
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(m["loss"], m_want["loss"], rtol=1e-6, atol=0)
    assert_close_trees(state.params, want.params, rtol=1e-5, atol=1e-6)


def ftitan(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "ftitan", *args], capture_output=True, text=True, timeout=timeout)


FAST = ["--recipe", "llama3-debug", "--steps", "3", "--optim.warmup", "1", "--log-every", "1", "--eval-every", "0",
        "--eval-batches", "1", "--model.n-layers", "2", "--data.seq-len", "32", "--data.batch-size", "2",
        "--device", "cpu"]  # fmt: skip


def test_cli_remat_flag_sets_the_model_config_and_bad_values_fail_naming_the_flag(tmp_path):
    out = ftitan("train", *FAST, "--compile", "False", "--remat", "full", "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["model"]["remat"] == "full" and cfg["remat"] == "full"
    bad = ftitan("train", *FAST, "--remat", "fulll", "--run-dir", str(tmp_path / "b"))
    assert bad.returncode == 2 and "--remat='fulll'" in bad.stderr and "'save-matmuls'" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "b").exists()
    bad = ftitan("train", *FAST, "--compile", "sometimes", "--run-dir", str(tmp_path / "c"))
    assert bad.returncode == 2 and "regional" in bad.stderr


@pytest.mark.slow
def test_cli_run_with_regional_compile_and_full_remat(tmp_path):
    """Inductor, as a user runs it: a few steps of --compile regional --remat full train (the loss falls)."""
    out = ftitan("train", *FAST, "--steps", "6", "--compile", "regional", "--remat", "full",
                 "--run-dir", str(tmp_path / "r"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) >= 5 and losses[-1] < losses[0]
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["compile"] == "regional" and cfg["model"]["remat"] == "full"


def test_update_half_compiled_apart_is_the_same_step():
    """``make_train_step(update_backend=...)`` (``bench compile``'s regional-update peer): the optimizer update, its
    application and the donated writes compiled on their own give the eager step's params and moments
    (aot_eager: the same aten ops, 1e-6), in the donated buffers; a second step compiles nothing new."""
    model = tiny("llama")
    params, b = model.init(ft.random.key(0)), batch()
    opt = ft.optim.adamw(1e-2)
    loss_fn = ft.train.next_token_loss(model)
    step = ft.train.make_train_step(loss_fn, opt, grad_impl="autograd", donate=True, update_backend="aot_eager")
    eager = ft.train.make_train_step(loss_fn, opt, grad_impl="autograd", donate=True)
    got, want = (ft.train.init_state(T.map(torch.clone, params), opt) for _ in range(2))
    buffers = [x.data_ptr() for x in T.leaves((got.params, got.opt_state))]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            got, m = step(got, b)
            want, m_want = eager(want, b)
    assert counters["stats"]["unique_graphs"] == 1
    assert_close_trees((got.params, got.opt_state), (want.params, want.opt_state), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["grad_norm"], m_want["grad_norm"])
    assert [x.data_ptr() for x in T.leaves((got.params, got.opt_state))] == buffers
