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
    """4 layers, 2 steps (new closures over new RoPE angles each step): one graph for the blocks (and one for
    the head's fused loss, ``regional.compiled``), and a recompile would raise."""
    model = tiny("llama")
    params, b = model.init(ft.random.key(0)), batch()
    with torch._dynamo.config.patch(error_on_recompile=True):
        regional_grads(model, params, b)
        regional_grads(model, params, batch(seed=1))  # other tokens, same shapes
    assert counters["stats"]["unique_graphs"] == 1 + 1


@pytest.mark.parametrize(("family", "kinds"), [("qwen3_moe", 1), ("qwen3_next", 2), ("deepseek_v3", 2),
                                               ("muse_glimmer", 2)])  # fmt: skip
def test_one_region_per_layer_kind(family, kinds):
    """Qwen3-Next's linear-attention and full-attention layers (DeepSeek-V3's dense and MoE blocks) differ by
    their params' keys, Muse Glimmer's by the (RoPE base, window) its block reads for the layer index
    (``run_stage``'s ``layer_kind``): two graphs for four layers (and the head's fused loss); a second step
    compiles nothing new."""
    model = tiny(family)
    params, b = model.init(ft.random.key(0)), batch()
    regional_grads(model, params, b, steps=1)
    assert counters["stats"]["unique_graphs"] == kinds + 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        regional_grads(model, params, batch(seed=1), steps=1)
    assert counters["stats"]["unique_graphs"] == kinds + 1


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
    assert counters["stats"]["unique_graphs"] == 1 + 1  # the block, the head's fused loss
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
    # the block region and the head's fused loss once; the update by layers (AdamW is leafwise): its part update
    # and statistics pass once for what lies outside the layers and once for the layers
    assert counters["stats"]["unique_graphs"] == 2 + 2 * 2
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
    """``make_train_step(update_backend=...)`` for an optimizer that does not run by layers (a weight-decay mask
    reads paths): the optimizer update, its application and the donated writes compiled whole, on their own,
    give the eager step's params and moments (aot_eager: the same aten ops, 1e-6), in the donated buffers; a
    second step compiles nothing new."""
    model = tiny("llama")
    params, b = model.init(ft.random.key(0)), batch()
    opt = ft.optim.adamw(1e-2, mask="layers.*")
    assert not opt.leafwise
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


def trainer_optimizer(clip=0.05):
    """The trainer's AdamW (``optim.from_config``): a warm-up/cosine schedule, clipping, the non-finite guard."""
    from ftitan.optim.from_config import guard_nonfinite

    lr = ft.optim.warmup_cosine(1e-2, warmup=2, total=10, final=1e-3)
    return guard_nonfinite(ft.optim.chain(ft.optim.clip_by_global_norm(clip), ft.optim.adamw(lr)), "skip")


@pytest.mark.parametrize("family, parts", [("llama", 2), ("deepseek_v3", 3)])
def test_update_by_layers_compiles_once_per_layer_kind_and_is_the_eager_step(family, parts):
    """A leafwise optimizer (``Transform.leafwise``: the trainer's AdamW behind clipping, its schedule and the
    non-finite guard) under ``update_backend`` runs its compiled update layer by layer: one graph for what lies
    outside the layers and one per layer kind (DeepSeek-V3: dense and MoE blocks), however deep the model;
    bit-identical to the eager step (aot_eager) in params, moments, the guard's and the schedule's counters and
    the metrics, with clipping binding (the norm is the whole tree's) and after a non-finite gradient (the
    guard skips it, naming the same first bad leaf); the state stays in its donated buffers."""
    model = tiny(family)
    params = model.init(ft.random.key(0))
    opt = trainer_optimizer()
    assert opt.leafwise

    def loss_fn(p, b):
        loss, aux = ft.train.next_token_loss(model)(p, b)
        return loss * b["scale"], aux

    step = ft.train.make_train_step(loss_fn, opt, grad_impl="autograd", donate=True, update_backend="aot_eager")
    eager = ft.train.make_train_step(loss_fn, opt, grad_impl="autograd", donate=True)
    got, want = (ft.train.init_state(T.map(torch.clone, params), opt) for _ in range(2))
    buffers = [x.data_ptr() for x in T.leaves((got.params, got.opt_state))]
    for i, scale in enumerate((1.0, 1.0, float("inf"), 1.0)):
        b = {**batch(), "scale": torch.tensor(scale)}
        with torch._dynamo.config.patch(error_on_recompile=i > 0):  # the first step compiles each kind
            got, m = step(got, b)
        want, m_want = eager(want, b)
        for x, y in zip(T.leaves((got, m)), T.leaves((want, m_want)), strict=True):
            assert torch.equal(x, y) or (x.isnan().all() and y.isnan().all())
    guard = ft.optim.find_finite_guard(got.opt_state)
    assert int(guard.total_notfinite) == 1 and int(guard.bad_step) == 3 and int(guard.bad_leaf) >= 0
    assert float(m_want["grad_norm"]) > 0.05  # clipping binds: the parts scaled by the whole tree's norm
    # the part update per kind, and the statistics pass (squares, non-finite flags) per kind
    assert counters["stats"]["unique_graphs"] == 2 * parts
    assert [x.data_ptr() for x in T.leaves((got.params, got.opt_state))] == buffers


def test_an_optimizer_that_reads_a_parts_other_tree_falls_back_to_the_whole_update():
    """A transform marked leafwise that asks for the norm of another tree of the part's structure (here: the
    updates, not the gradients) raises ``tree.NotPartitionable`` on the first part, before any write: the step
    falls back to the update compiled whole and stays the eager step (SGD: the update's size follows the
    norm, so a part's own norm in place of the whole tree's would show)."""
    model = tiny("llama")
    params, b = model.init(ft.random.key(0)), batch()

    def update(g, s, p=None):
        u = T.map(lambda x: 2 * x, g)
        norm = T.global_norm(u)
        return T.map(lambda x: x / (1 + norm), u), s

    opt = ft.optim.chain(ft.optim.Transform(lambda p: ft.optim.EmptyState(), update, leafwise=True),
                         ft.optim.sgd(1.0))  # fmt: skip
    loss_fn = ft.train.next_token_loss(model)
    step = ft.train.make_train_step(loss_fn, opt, grad_impl="autograd", donate=True, update_backend="aot_eager")
    eager = ft.train.make_train_step(loss_fn, opt, grad_impl="autograd", donate=True)
    got, want = (ft.train.init_state(T.map(torch.clone, params), opt) for _ in range(2))
    for _ in range(2):
        got, _ = step(got, b)
        want, _ = eager(want, b)
    assert_close_trees((got.params, got.opt_state), (want.params, want.opt_state), rtol=1e-5, atol=1e-6)


def test_whole_tree_statistics_inside_a_part():
    """``tree.as_part_of``: the part's gradients give the whole tree's norm and non-finite flags; another tree
    of the part's structure raises; a tree of another structure is its own."""
    from ftitan.optim import finite

    g = {"a": torch.ones(2), "b": torch.ones(3)}
    whole = {"sum_squares": torch.tensor(16.0), "nonfinite": torch.tensor([False, True, False])}
    with T.as_part_of(g, **whole):
        assert T.global_norm(g) == 4.0
        assert torch.equal(finite.nonfinite_leaves(g), whole["nonfinite"]) and not finite.all_finite(g)
        assert T.global_norm({"x": torch.tensor(3.0)}) == 3.0
        with pytest.raises(T.NotPartitionable, match="other than its gradients"):
            T.global_norm(T.map(torch.clone, g))
    assert T.global_norm(g) == 5**0.5


@pytest.mark.parametrize(
    "options, want",
    [({}, "func"), ({"compile": True}, "func"), ({"compile": "regional"}, "autograd"), ({"remat": "full"}, "autograd"),
     ({"kernels": "triton"}, "autograd"), ({"attn_impl": "flex"}, "autograd"), ({"attn_impl": "math"}, "func")],
)  # fmt: skip
def test_the_gradient_path_is_autograd_where_a_choice_needs_it(options, want):
    """One rule for ``ftitan train`` and ``ftitan bench step``: regional compile, remat, ftitan.kernels and
    FlexAttention differentiate on the autograd path (torch.func refuses or bypasses them), else torch.func."""
    from ftitan.train.runtime import gradient_path

    assert gradient_path(**options) == want
