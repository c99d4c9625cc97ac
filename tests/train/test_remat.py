"""Remat policies (ftitan.train.remat) applied to the block function in run_stage: gradients equal to the
torch.func path without remat, saved activation bytes that really drop (counted exactly), compiled steps,
and torch.func transforms (remat steps aside there)."""

import attrs
import pytest
import torch

import ftitan as ft
from ftitan import config
from ftitan import tree as T
from ftitan.bench.remat import saved_bytes
from ftitan.models import llama, qwen3_moe, qwen3_next
from ftitan.train import remat
from ftitan.train.step import value_and_grad

POLICIES = ("full", "save-matmuls", "regions:attn", "budget:0.5")
TINY = {  # a dense, a MoE and a hybrid (Gated DeltaNet + attention) family, 2-4 layers, fast on one thread
    "llama": (llama, dict(vocab_size=128, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64)),
    "qwen3_moe": (qwen3_moe, dict(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                                  expert_dim=16, ffn_dim=64)),  # fmt: skip
    "qwen3_next": (qwen3_next, dict(vocab_size=128, n_layers=4)),
}


def tiny(family, **kw):
    mod, base = TINY[family]
    cfg = attrs.evolve(mod.Config.debug(), **(base | kw))
    return cfg, mod.model(cfg)


def batch(vocab=128, b=2, t=16, seed=0):
    tokens = torch.randint(0, vocab, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def grads_of(model, params, b, impl):
    grads, (loss, _) = value_and_grad(ft.train.next_token_loss(model), impl=impl)(params, b)
    return grads, loss


def assert_identical(a, b):
    for path, x, y in zip(T.paths(a), T.leaves(a), T.leaves(b), strict=True):
        assert torch.equal(x, y), f"{path}: max diff {(x - y).abs().max().item():.3g}"


@pytest.mark.parametrize("policy", ["none", *POLICIES, "regions:attn,attn"])
def test_valid_policies_parse(policy):
    assert remat.check_policy(policy) == policy
    assert config.with_remat(policy)(llama.Config.debug()).remat == policy


@pytest.mark.parametrize("bad", ["fulll", "regions:mlp2", "regions:", "budget:1.5", "budget:0", "budget:x", ""])
def test_invalid_policy_names_the_field_and_the_choices(bad):
    with pytest.raises(ValueError, match=r"--model\.remat=.*expected one of 'none', 'full', 'save-matmuls'"):
        config.with_remat(bad)(llama.Config.debug())


@pytest.fixture(scope="module", params=list(TINY))
def family(request):
    cfg, model = tiny(request.param)
    params = model.init(ft.random.key(0))
    b = batch()
    return request.param, cfg, params, b, grads_of(model, params, b, "func"), grads_of(model, params, b, "autograd")


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_identical_to_no_remat(family, policy):
    """Bitwise equal to the autograd path without remat: recomputation replays the same deterministic CPU
    kernels on the same inputs. Against the torch.func path without remat: bitwise for Llama and Qwen3-MoE;
    Qwen3-Next's embedding gradient differs in the last bit (1.5e-7) on the autograd path with or without
    remat (the engine sums the residual's gradient contributions in another order), so 1e-6 there."""
    name, cfg, params, b, (ref, ref_loss), (ref_autograd, _) = family
    model = TINY[name][0].model(config.with_remat(policy)(cfg))
    grads, loss = grads_of(model, params, b, "autograd")
    assert torch.equal(loss, ref_loss)
    assert_identical(grads, ref_autograd)
    if name == "qwen3_next":
        for x, y in zip(T.leaves(grads), T.leaves(ref), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    else:
        assert_identical(grads, ref)


def test_saved_bytes_drop_measured_with_dispatch_and_hooks():
    cfg, _ = tiny("llama", attn_impl="math")  # math attention saves its (B, H, T, T) scores: regions:attn shows
    params, b = llama.model(cfg).init(ft.random.key(0)), batch(t=32)
    kept = {p: saved_bytes(ft.train.next_token_loss(llama.model(attrs.evolve(cfg, remat=p))), params, b)
            for p in ("none", *POLICIES)}  # fmt: skip
    assert kept["full"] < 0.2 * kept["none"]  # only each block's input (and the head/loss) stays
    assert kept["save-matmuls"] < 0.7 * kept["none"]
    assert kept["regions:attn"] < kept["none"]
    assert kept["full"] < kept["budget:0.5"] < kept["none"]  # half the layers under full remat


def test_saved_bytes_count_every_saved_tensor_without_remat():
    """Without remat the two counts agree: what autograd saves (hooks) is what stays alive (dispatch)."""
    from ftitan.bench.remat import hook_bytes

    cfg, model = tiny("llama")
    params, b = model.init(ft.random.key(0)), batch()
    loss_fn = ft.train.next_token_loss(model)
    assert saved_bytes(loss_fn, params, b) == pytest.approx(hook_bytes(loss_fn, params, b), rel=0.02)


@pytest.mark.parametrize("policy", ["full", "save-matmuls", "budget:0.5"])
def test_compiled_step_with_remat_matches_eager(policy):
    """A whole step compiled (aot_eager, fullgraph) over the autograd path: the same gradients to float
    rounding (the compiled graph may fuse or reorder the pointwise recomputation; 1e-6 relative)."""
    cfg, _ = tiny("llama", remat=policy)
    model = llama.model(cfg)
    params, b = model.init(ft.random.key(0)), batch()
    ref, _ = grads_of(llama.model(attrs.evolve(cfg, remat="none")), params, b, "func")
    fn = value_and_grad(ft.train.next_token_loss(model), impl="autograd")
    torch._dynamo.reset()
    with remat.memory_budget(policy):
        grads, _ = torch.compile(fn, backend="aot_eager", fullgraph=True)(params, b)
    for x, y in zip(T.leaves(grads), T.leaves(ref), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_torch_func_transforms_run_without_remat():
    """torch.func refuses saved-tensor hooks: under its transforms the block runs as is (no remat), so
    grad/vjp, vmap and jvp of model.apply work and give the values without remat."""
    cfg, plain = tiny("llama")
    model = llama.model(config.with_remat("full")(cfg))
    params, b = plain.init(ft.random.key(0)), batch()
    g, _ = grads_of(model, params, b, "func")
    assert_identical(g, grads_of(plain, params, b, "func")[0])
    rows = torch.func.vmap(lambda t: model.apply(params, t[None])[0][0])(b["inputs"])
    torch.testing.assert_close(rows, plain.apply(params, b["inputs"])[0], rtol=1e-5, atol=1e-5)
    tangent = T.map(torch.ones_like, params)
    out, jvp = torch.func.jvp(lambda p: model.apply(p, b["inputs"])[0], (params,), (tangent,))
    want = torch.func.jvp(lambda p: plain.apply(p, b["inputs"])[0], (params,), (tangent,))
    torch.testing.assert_close((out, jvp), want, rtol=0, atol=0)


def test_inference_with_a_cache_is_unchanged():
    cfg, plain = tiny("llama")
    model = llama.model(config.with_remat("full")(cfg))
    params, tokens = plain.init(ft.random.key(0)), batch()["inputs"]
    with torch.no_grad():
        torch.testing.assert_close(model.apply(params, tokens)[0], plain.apply(params, tokens)[0], rtol=0, atol=0)
    out, _ = model.apply(params, tokens[:, :4], cache=ft.infer.init_cache(model, params, batch=2, slots=16))
    torch.testing.assert_close(out, plain.apply(params, tokens[:, :4])[0], rtol=1e-5, atol=1e-5)


def test_runtime_step_of_a_remat_model_takes_the_autograd_path():
    """runtime.make_step(remat=...) differentiates with torch.autograd (torch.func would refuse the hooks
    under compile, and eagerly skip remat): one AdamW step lands on the same params as the func path's."""
    from ftitan.train import runtime

    cfg, plain = tiny("llama")
    model = llama.model(config.with_remat("full")(cfg))
    params, b = plain.init(ft.random.key(0)), batch()
    rt = runtime.setup(runtime.ParallelConfig(), device="cpu")
    opt = ft.optim.adamw(1e-2)
    loss_fn = ft.train.next_token_loss(model)
    calls = []

    def spy(*a, **k):
        calls.append(k.get("impl"))
        return value_and_grad(*a, **k)

    step = rt.make_step(model, loss_fn, opt, accum_steps=1, compile=False, update_buffers=None, remat="full")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("ftitan.train.step.value_and_grad", spy)
        rt.make_step(model, loss_fn, opt, accum_steps=1, compile=False, update_buffers=None, remat="full")
    assert calls == ["autograd"]
    new, _ = step(ft.train.init_state(T.map(torch.clone, params), opt), b)
    ref = ft.train.make_train_step(ft.train.next_token_loss(plain), opt)
    want, _ = ref(ft.train.init_state(T.map(torch.clone, params), opt), b)
    assert_identical(new.params, want.params)


def test_deepseek_v4_layer_loop_applies_remat():
    """DeepSeek-V4 runs its own layer loop (hyper-connection streams), not run_stage: remat applies there too.
    Bitwise against the autograd path without remat; its func path differs by 3e-8 (summation order)."""
    from ftitan.models import deepseek_v4

    cfg = attrs.evolve(deepseek_v4.Config.debug(), vocab_size=128)
    plain = deepseek_v4.model(cfg)
    params, b = plain.init(ft.random.key(0)), batch(t=32)
    ref, ref_loss = grads_of(plain, params, b, "autograd")
    model = deepseek_v4.model(config.with_remat("full")(cfg))
    grads, loss = grads_of(model, params, b, "autograd")
    assert torch.equal(loss, ref_loss)
    assert_identical(grads, ref)
    loss_fn, plain_fn = ft.train.next_token_loss(model), ft.train.next_token_loss(plain)
    assert saved_bytes(loss_fn, params, b) < 0.2 * saved_bytes(plain_fn, params, b)


def test_compiled_torch_func_step_of_a_remat_model_steps_aside():
    """torch.func.grad_and_value compiled (aot_eager, fullgraph) over a remat model: the transform is active
    while dynamo traces, so remat steps aside there too and the gradients are the plain ones."""
    cfg, plain = tiny("llama")
    model = llama.model(config.with_remat("full")(cfg))
    params, b = plain.init(ft.random.key(0)), batch()
    torch._dynamo.reset()
    fn = torch.compile(value_and_grad(ft.train.next_token_loss(model), impl="func"), backend="aot_eager",
                       fullgraph=True)  # fmt: skip
    grads, _ = fn(params, b)
    for x, y in zip(T.leaves(grads), T.leaves(grads_of(plain, params, b, "func")[0]), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
