"""optax idioms: masking and freezing, injected hyperparameters, MultiSteps weights,
apply_if_finite, parameter EMA, and all of them in one compiled step without recompiles."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing

import ftitan.optim as fo
from ftitan import tree


def nested(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    t = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return {"layer": {"b": t(3), "w": t(3, 4)}, "head": t(4, 2)}


def ones_like(t):
    return tree.map(torch.ones_like, t)


def test_globs_mean_the_same_inside_and_outside_multi_transform():
    params = nested()
    grads = ones_like(params)
    outside = fo.chain(fo.sgd(0.1), fo.freeze("layer.*"))
    inside = fo.multi_transform(
        {"a": fo.chain(fo.sgd(0.1), fo.freeze("layer.*")), "b": fo.sgd(0.1)},
        lambda path, x: "a" if path != "head" else "b",
    )
    for opt in (outside, inside):
        updates, _ = opt.update(grads, opt.init(params), params)
        assert torch.equal(updates["layer"]["b"], torch.zeros(3)) and torch.equal(updates["layer"]["w"], torch.zeros(3, 4))
        assert torch.all(updates["head"] == -0.1)
    # '*' is one component: it matches no nested path, and says so instead of passing raw gradients
    layer_only = {"layer": params["layer"]}
    for opt in (fo.chain(fo.sgd(0.1), fo.freeze("*")), fo.multi_transform({"f": fo.freeze("*")}, lambda p, x: "f")):
        with pytest.raises(ValueError, match=r"freeze: glob '\*' matches no parameter path \(paths here: layer\.b"):
            opt.init(layer_only)
    assert fo.freeze("**").init(layer_only) == fo.EmptyState()
    assert fo.freeze("nothing.*", missing_ok=True).init(params) == fo.EmptyState()
    for make in (lambda: fo.masked(fo.sgd(0.1), "layers.*"), lambda: fo.selective_transform(fo.sgd(0.1), freeze_mask="x")):
        with pytest.raises(ValueError, match="matches no parameter path"):
            make().init(params)


def test_masked_selective_transform_and_set_to_zero_allocate_no_state_for_other_leaves():
    params = nested()
    masked = fo.masked(fo.adam(0.1), "layer.w")
    state = masked.init(params)
    assert list(state.inner_state[0].mu) == ["layer.w"]
    updates, _ = masked.update(ones_like(params), state, params)
    assert torch.equal(updates["head"], torch.ones(4, 2))  # masked-out: passed through unchanged
    sel = fo.selective_transform(fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(0.1)), freeze_mask="layer.**")
    state = sel.init(params)
    adam_state = state.inner_states["train"][1][0]
    assert list(adam_state.mu) == list(adam_state.nu) == ["head"]  # moments for the trainable leaf only
    assert tree.nbytes(state) == 2 * tree.nbytes(params["head"]) + 8 + 8 + 4  # + adam step, lr step, lr
    assert tree.leaves(state.inner_states["freeze"]) == []
    grads = {"layer": {"b": torch.full((3,), 100.0), "w": torch.full((3, 4), 100.0)}, "head": torch.full((4, 2), 0.01)}
    updates, _ = sel.update(grads, state, params)
    # the clip inside saw only the trainable gradient (norm 0.028 < 1): frozen 100s did not scale it down
    plain, _ = fo.adamw(0.1).update({"head": grads["head"]}, fo.adamw(0.1).init({"head": params["head"]}), {"head": params["head"]})
    torch.testing.assert_close(updates["head"], plain["head"])
    assert not any(torch.any(u != 0) for u in tree.leaves(updates["layer"]))


def test_inject_hyperparams_state_is_what_the_update_reads():
    params = nested()
    opt = fo.inject_hyperparams(fo.sgd)(lr=0.5, momentum=0.9, weight_decay=0.0)
    state = opt.init(params)
    assert sorted(state.hyperparams) == ["lr", "momentum", "weight_decay"] and state.scheduled == {}
    state = fo.set_hyperparams(state, lr=0.0)
    updates, state = opt.update(ones_like(params), state, params)
    assert all(torch.all(u == 0) for u in tree.leaves(updates)) and float(fo.current_lr(state)) == 0.0
    state = fo.set_hyperparams(state, lr=0.1, momentum=0.0)
    updates, state = opt.update(ones_like(params), state, params)
    # trace holds 1 from the first step; momentum 0 now: the update is -lr * g
    assert torch.allclose(updates["head"], torch.full((4, 2), -0.1))
    with pytest.raises(ValueError, match=r"no injected hyperparameter \['b1'\].*editable ones: \['lr', 'momentum', 'weight_decay'\]"):
        fo.set_hyperparams(state, b1=0.5)
    scheduled = fo.inject_hyperparams(fo.adamw)(lr=fo.linear_warmup(1.0, 4), weight_decay=0.1)
    s = scheduled.init(params)
    with pytest.raises(ValueError, match="'lr' is scheduled"):
        fo.set_hyperparams(s, lr=0.0)
    _, s = scheduled.update(ones_like(params), s, params)
    _, s = scheduled.update(ones_like(params), s, params)
    assert s.scheduled["lr"].item() == pytest.approx(0.25) and fo.current_lr(s).item() == pytest.approx(0.25)


def test_transform_without_lr_stage_has_no_lr():
    opt = fo.chain(fo.scale_by_adam(), fo.scale(-1e-3))
    assert fo.find_lr(opt.init(nested())) is None
    assert fo.find_lr(fo.adam(0.1).init(nested())).item() == pytest.approx(0.1)


def test_multi_steps_weights_calls_and_emits_zeros_in_between():
    params = {"w": torch.zeros(2, dtype=torch.float64)}
    opt = fo.MultiSteps(fo.sgd(1.0), 3)
    state = opt.init(params)
    gs = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0]), torch.tensor([4.0, 4.0])]
    ws = [1, 3, 0]  # the zero-weight call counts towards k but not towards the mean
    outs = []
    for g, w in zip(gs, ws, strict=True):
        u, state = opt.update({"w": g.double()}, state, params, weight=torch.tensor(w))
        outs.append(u["w"])
    assert torch.equal(outs[0], torch.zeros(2)) and torch.equal(outs[1], torch.zeros(2))
    torch.testing.assert_close(outs[2], -torch.tensor([1.0 * 1 + 0.0 * 3, 0.0 * 1 + 3.0 * 3], dtype=torch.float64) / 4)
    assert (int(state.mini_step), int(state.gradient_step), float(state.acc_weight)) == (0, 1, 0.0)
    with pytest.raises(ValueError, match="every_k=0"):
        fo.MultiSteps(fo.sgd(1.0), 0)


def test_apply_if_finite_keeps_params_and_inner_state():
    params = nested()
    opt = fo.apply_if_finite(fo.adamw(0.1), max_consecutive_errors=5)
    _, state = opt.update(ones_like(params), opt.init(params), params)
    bad = tree.map(lambda x: torch.full_like(x, math.nan), params)
    updates, new = opt.update(bad, state, params)
    assert all(torch.equal(u, torch.zeros_like(u)) for u in tree.leaves(updates))
    for a, b in zip(tree.leaves(new.inner_state), tree.leaves(state.inner_state), strict=True):
        assert torch.equal(a, b)
    assert (int(new.notfinite_count), bool(new.last_finite), int(new.total_notfinite)) == (1, False, 1)


def test_ema_params_tracks_params_in_float32_for_bf16():
    params = nested(torch.bfloat16)
    opt = fo.chain(fo.sgd(0.1), fo.ema_params(0.9))
    state = opt.init(params)
    assert {x.dtype for x in tree.leaves(fo.params_ema(state))} == {torch.float32}
    updates, state = opt.update(ones_like(params), state, params)
    new = fo.apply_updates(params, updates)
    want = tree.map(lambda p, n: 0.9 * p.float() + 0.1 * n.float(), params, new)
    for a, b in zip(tree.leaves(fo.params_ema(state)), tree.leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="needs params"):
        fo.ema_params(0.9).update(ones_like(params), fo.ema_params(0.9).init(params))


def test_every_idiom_in_one_compiled_step_without_recompiles():
    """inject_hyperparams (edited lr), MultiSteps, apply_if_finite, selective_transform, masked, ema,
    ema_params, eps_root / mu_dtype and the new schedules, compiled once; eager gives the same numbers."""
    params = nested()
    schedule = fo.join_schedules(
        [fo.linear_warmup(1.0, 2, init_value=0.1), fo.exponential_decay(1.0, 2, 0.5, staircase=True),
         fo.piecewise_constant(0.5, {2: 0.5}), fo.polynomial(0.3, 0.0, 2.0, 4)],
        [2, 4, 6],
    )  # fmt: skip
    inner = fo.chain(
        fo.clip_by_global_norm(1.0),
        fo.masked(fo.ema(0.5), "head"),
        fo.inject_hyperparams(fo.adamw)(lr=1e-2, weight_decay=0.1, b1=fo.warmup_cosine(0.9, 2, 8, init_value=0.5),
                                        eps_root=1e-8, mu_dtype=torch.bfloat16),
        fo.scale_by_learning_rate(schedule),
        fo.ema_params(0.9),
    )  # fmt: skip
    opt = fo.MultiSteps(fo.apply_if_finite(fo.selective_transform(inner, freeze_mask="layer.b"), 2), 2)

    def step(params, state, grads, weight):
        updates, state = opt.update(grads, state, params, weight=weight)
        return fo.apply_updates(params, updates), state

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    g = torch.Generator().manual_seed(1)
    grads = [tree.map(lambda x: torch.randn(x.shape, generator=g), params) for _ in range(8)]
    grads[3]["head"][0, 0] = math.nan  # skipped by apply_if_finite
    runs = []
    for fn in (step, compiled):
        p, s = params, opt.init(params)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i, gr in enumerate(grads):
                lr = 1e-2 * (i + 1)
                s = fo.set_hyperparams(s, lr=lr)
                p, s = fn(p, s, gr, torch.tensor(i + 1))
        runs.append((p, s))
    assert counter.frame_count == 1
    for a, b in zip(tree.leaves(runs[0]), tree.leaves(runs[1]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # aot_eager runs eager's aten ops
    (p, s), _ = runs
    assert torch.equal(p["layer"]["b"], params["layer"]["b"])  # frozen
    assert not torch.equal(p["layer"]["w"], params["layer"]["w"])
    assert int(s.gradient_step) == 4 and int(s.inner_opt_state.total_notfinite) == 1
