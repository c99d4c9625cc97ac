"""make_train_step: gradients, accumulation, metrics, purity, compile without recompiles."""

import attrs
import pytest
import torch
import torch.utils.checkpoint

import ftitan as ft
from ftitan import tree as T
from ftitan.models import llama


def tiny_cfg(**kw):
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
    return attrs.evolve(llama.Config.debug(), **(base | kw))


def make_batch(cfg, b=4, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=g)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg()
    model = llama.model(cfg)
    params = model.init(ft.random.key(0))
    return cfg, model, params


def assert_trees_close(a, b, **tol):
    for p, x, y in zip(T.paths(a), T.leaves(a), T.leaves(b), strict=True):
        torch.testing.assert_close(x, y, msg=lambda m, p=p: f"{p}: {m}", **tol)


def test_func_and_autograd_paths_give_identical_gradients(setup):
    cfg, model, params = setup
    loss_fn = ft.train.next_token_loss(model)
    batch = make_batch(cfg)
    g_func, (l_func, _) = ft.train.value_and_grad(loss_fn, impl="func")(params, batch)
    g_auto, (l_auto, _) = ft.train.value_and_grad(loss_fn, impl="autograd")(params, batch)
    assert torch.equal(l_func, l_auto)
    assert_trees_close(g_func, g_auto, rtol=0, atol=0)


def test_remat_needs_the_autograd_path(setup):
    cfg, model, params = setup
    base = ft.train.next_token_loss(model)

    def remat_loss(p, batch):  # the whole forward rematerialized in backward
        return torch.utils.checkpoint.checkpoint(base, p, batch, use_reentrant=False)

    batch = make_batch(cfg)
    g_ref, (l_ref, _) = ft.train.value_and_grad(base)(params, batch)
    g_remat, (l_remat, _) = ft.train.value_and_grad(remat_loss, impl="autograd")(params, batch)
    torch.testing.assert_close(l_remat, l_ref, rtol=0, atol=0)
    assert_trees_close(g_remat, g_ref, rtol=1e-6, atol=1e-7)
    with pytest.raises(Exception, match="(?i)saved.?tensor|hooks"):
        ft.train.value_and_grad(remat_loss, impl="func")(params, batch)


def test_accumulation_equals_full_batch(setup):
    cfg, model, params = setup
    opt = ft.optim.sgd(0.1)
    batch = make_batch(cfg, b=4)
    full = ft.train.make_train_step(ft.train.next_token_loss(model), opt)
    accum = ft.train.make_train_step(ft.train.next_token_loss(model), opt, accum_steps=2)
    s_full, m_full = full(ft.train.init_state(params, opt), batch)
    s_acc, m_acc = accum(ft.train.init_state(params, opt), batch)
    # every micro-batch has the same token count, so the mean of means is the mean
    torch.testing.assert_close(m_acc["loss"], m_full["loss"], rtol=1e-6, atol=1e-6)
    assert int(m_acc["n_tokens"]) == int(m_full["n_tokens"]) == 4 * 12
    assert_trees_close(s_acc.params, s_full.params, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not divisible by accum_steps=3"):
        ft.train.make_train_step(ft.train.next_token_loss(model), opt, accum_steps=3)(ft.train.init_state(params, opt), batch)


def test_metrics_and_purity(setup):
    cfg, model, params = setup
    sched = ft.optim.warmup_cosine(1e-2, warmup=2, total=10)
    opt = ft.optim.chain(ft.optim.clip_by_global_norm(0.5), ft.optim.adamw(sched))
    step = ft.train.make_train_step(ft.train.next_token_loss(model), opt)
    state = ft.train.init_state(params, opt)
    before = T.map(torch.clone, state.params)
    batch = make_batch(cfg)
    new, metrics = step(state, batch)
    assert set(metrics) >= {"loss", "grad_norm", "lr", "n_tokens"}
    assert_trees_close(state.params, before, rtol=0, atol=0)  # the input state is untouched
    assert int(new.step) == 1 and int(state.step) == 0
    grads, _ = ft.train.value_and_grad(ft.train.next_token_loss(model))(params, batch)
    torch.testing.assert_close(metrics["grad_norm"], T.global_norm(grads))
    torch.testing.assert_close(metrics["lr"], sched(torch.tensor(0)).float())  # lr used by the first update


def test_loss_falls_on_a_fixed_batch(setup):
    cfg, model, params = setup
    opt = ft.optim.adamw(3e-3, weight_decay=0.0)
    step = ft.train.make_train_step(ft.train.next_token_loss(model), opt)
    state, batch = ft.train.init_state(params, opt), make_batch(cfg)
    losses = []
    for _ in range(30):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0], losses


def _run(step, state, batches):
    losses = []
    for batch in batches:
        state, m = step(state, batch)
        losses.append(m["loss"])
    return state, torch.stack(losses)


@pytest.mark.parametrize("optimizer", ["adamw", "muon_with_adamw"])
def test_compiled_step_matches_eager_without_recompiles(setup, optimizer):
    cfg, model, params = setup
    sched = ft.optim.warmup_cosine(1e-2, warmup=3, total=10)  # lr changes every step
    if optimizer == "adamw":
        opt = ft.optim.adamw(sched)
    else:
        opt = ft.optim.muon_with_adamw(params, lr=sched, ns_dtype=torch.float32)
    step = ft.train.make_train_step(ft.train.next_token_loss(model), opt)
    batches = [make_batch(cfg, seed=i) for i in range(10)]
    _, eager = _run(step, ft.train.init_state(params, opt), batches)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        state, got = _run(compiled, ft.train.init_state(params, opt), batches)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    assert int(state.step) == 10


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_donated_step_updates_in_place_with_the_pure_values(setup, compiled):
    """``donate=True`` writes the new params and optimizer state into the input state's buffers: the
    returned leaves are the input's tensors, and every value equals the pure eager step's. Compiled with the
    default backend (inductor, as ``ftitan train`` runs it): one compile for every step (a new lr each)."""
    cfg, model, params = setup
    opt = ft.optim.adamw(ft.optim.warmup_cosine(1e-2, warmup=2, total=4))
    loss_fn = ft.train.next_token_loss(model)
    pure, donated = (ft.train.make_train_step(loss_fn, opt, donate=d) for d in (False, True))
    if compiled:
        donated = torch.compile(donated, fullgraph=True)
    batches = [make_batch(cfg, seed=i) for i in range(4)]
    state = ft.train.init_state(T.map(torch.clone, params), opt)
    buffers = [x.data_ptr() for x in T.leaves((state.params, state.opt_state))]
    with torch._dynamo.config.patch(error_on_recompile=True):  # the donated step first: one compile
        state, got = _run(donated, state, batches)
    want_state, want = _run(pure, ft.train.init_state(T.map(torch.clone, params), opt), batches)
    assert [x.data_ptr() for x in T.leaves((state.params, state.opt_state))] == buffers
    assert int(state.step) == 4
    # eager: bit for bit. Inductor reorders float reductions and fuses the in-place update, so float sums
    # round differently in the last place (measured against the eager step: 4.8e-7 on the loss ~5, 1.2e-7
    # on a norm weight ~1 after 4 steps), the tolerance the test had against the compiled pure step
    tol = dict(rtol=1e-5, atol=1e-7) if compiled else dict(rtol=0, atol=0)
    torch.testing.assert_close(got, want, **tol)
    assert_trees_close((state.params, state.opt_state), (want_state.params, want_state.opt_state), **tol)


def test_any_transform_works_and_lr_is_reported_only_with_a_learning_rate_stage(setup):
    cfg, model, params = setup
    loss_fn, batch = ft.train.next_token_loss(model), make_batch(cfg)
    no_lr = ft.optim.chain(ft.optim.scale_by_adam(), ft.optim.scale(-1e-3))  # optax style, no lr stage
    state, metrics = ft.train.make_train_step(loss_fn, no_lr)(ft.train.init_state(params, no_lr), batch)
    assert "lr" not in metrics and {"loss", "grad_norm", "n_tokens"} <= set(metrics)
    assert not torch.equal(state.params["embed"], params["embed"])
    injected = ft.optim.inject_hyperparams(ft.optim.sgd)(lr=0.5)
    state = ft.optim.set_hyperparams(ft.train.init_state(params, injected), lr=0.0)
    state, metrics = ft.train.make_train_step(loss_fn, injected)(state, batch)
    assert float(metrics["lr"]) == 0.0
    assert_trees_close(state.params, params, rtol=0, atol=0)  # lr 0 in the state: nothing moves


def test_accumulation_weights_micro_batches_by_target_tokens(setup):
    """Micro-batches with unequal numbers of target tokens (IGNORE_INDEX elsewhere): accumulating over
    them, in one step or with MultiSteps over steps, gives the full batch's token-mean gradient."""
    cfg, model, params = setup
    loss_fn = ft.train.next_token_loss(model)
    batch = make_batch(cfg, b=4)
    targets = batch["targets"].clone()
    targets[:2, 3:] = ft.train.IGNORE_INDEX  # first micro-batch: 2 * 3 targets; second: 2 * 12
    batch = {**batch, "targets": targets}
    opt = ft.optim.sgd(1.0)
    full = ft.train.make_train_step(loss_fn, opt)
    s_full, m_full = full(ft.train.init_state(params, opt), batch)
    s_acc, m_acc = ft.train.make_train_step(loss_fn, opt, accum_steps=2)(ft.train.init_state(params, opt), batch)
    assert int(m_acc["n_tokens"]) == int(m_full["n_tokens"]) == 30
    torch.testing.assert_close(m_acc["loss"], m_full["loss"], rtol=1e-6, atol=1e-6)
    assert_trees_close(s_acc.params, s_full.params, rtol=1e-5, atol=1e-6)
    # the unweighted mean of the two micro-batch gradients is measurably different
    halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    g = [ft.train.value_and_grad(loss_fn)(params, h)[0] for h in halves]
    g_full = ft.train.value_and_grad(loss_fn)(params, batch)[0]
    assert (g_full["embed"] - (g[0]["embed"] + g[1]["embed"]) / 2).abs().max() > 1e-3
    # MultiSteps: the same rule across two steps, weighted by each step's n_tokens
    multi = ft.optim.MultiSteps(opt, 2)
    step = ft.train.make_train_step(loss_fn, multi)
    state = ft.train.init_state(params, multi)
    state, _ = step(state, halves[0])
    assert_trees_close(state.params, params, rtol=0, atol=0)  # zero updates in between
    state, _ = step(state, halves[1])
    assert_trees_close(state.params, s_full.params, rtol=1e-5, atol=1e-6)


def _toy():
    g = torch.Generator().manual_seed(0)
    params = {"enc": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)},
              "head": {"w": torch.randn(4, 3, generator=g)}, "scale": torch.ones(3)}  # fmt: skip

    def loss_fn(p, batch):
        y = torch.tanh(batch["x"] @ p["enc"]["w"] + p["enc"]["b"]) @ p["head"]["w"] * p["scale"]
        return ((y - batch["y"]) ** 2).mean(), {"n_tokens": torch.tensor(batch["x"].shape[0])}

    batches = [{"x": torch.randn(8, 6, generator=g), "y": torch.randn(8, 3, generator=g)} for _ in range(4)]
    return params, loss_fn, batches


def test_trainable_differentiates_only_selected_leaves_compiled_without_recompiles():
    params, loss_fn, batches = _toy()
    trainable = ["head.**", "scale"]
    seen = []

    def recording(inner):
        def update(grads, state, params=None):
            seen.append((sorted(grads), T.nbytes(grads), T.global_norm(grads)))
            return inner.update(grads, state, params)

        return ft.optim.Transform(inner.init, update)

    opt = ft.optim.inject_hyperparams(ft.optim.adamw)(lr=1e-2, weight_decay=0.1)
    clipped = ft.optim.chain(ft.optim.clip_by_global_norm(1e-3), opt)
    state = ft.train.init_state(params, recording(clipped), trainable=trainable)
    # no optimizer state for frozen leaves: Adam's moments cover head.w and scale only
    adam_state = state.opt_state[1].inner_state[0]
    assert sorted(adam_state.mu) == ["head.w", "scale"]
    eager = ft.train.make_train_step(loss_fn, recording(clipped), trainable=trainable)
    new, metrics = eager(state, batches[0])
    names, nbytes, norm = seen[0]
    assert names == ["head.w", "scale"] and nbytes == (4 * 3 + 3) * 4  # no gradient tensor for enc.*
    torch.testing.assert_close(metrics["grad_norm"], norm)
    full_grads = ft.train.value_and_grad(loss_fn)(params, batches[0])[0]
    torch.testing.assert_close(norm, T.global_norm({"h": full_grads["head"], "s": full_grads["scale"]}))
    assert new.params["enc"]["w"] is params["enc"]["w"] and not torch.equal(new.params["scale"], params["scale"])
    with pytest.raises(ValueError, match=r"trainable: glob 'heads\.\*\*' matches no parameter path"):
        ft.train.init_state(params, opt, trainable="heads.**")

    torch._dynamo.reset()
    step = torch.compile(ft.train.make_train_step(loss_fn, clipped, trainable=trainable, donate=True), fullgraph=True,
                         backend="aot_eager")  # fmt: skip
    ref = ft.train.make_train_step(loss_fn, clipped, trainable=trainable)
    s_c = ft.train.init_state(T.map(torch.clone, params), clipped, trainable=trainable)
    s_e = ft.train.init_state(params, clipped, trainable=trainable)
    enc = T.map(torch.clone, params["enc"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, batch in enumerate(batches):
            s_c = s_c._replace(opt_state=ft.optim.set_hyperparams(s_c.opt_state, lr=1e-2 / (i + 1)))
            s_e = s_e._replace(opt_state=ft.optim.set_hyperparams(s_e.opt_state, lr=1e-2 / (i + 1)))
            s_c, m_c = step(s_c, batch)
            s_e, m_e = ref(s_e, batch)
            assert float(m_c["lr"]) == pytest.approx(1e-2 / (i + 1))
    assert int(s_c.step) == 4
    assert_trees_close(s_c.params, s_e.params, rtol=0, atol=0)
    assert_trees_close(s_c.params["enc"], enc, rtol=0, atol=0)  # frozen: bit-identical
