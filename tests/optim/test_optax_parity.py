"""The optax-style idioms against optax 0.2.8 itself, in float64 (jax_enable_x64).

Tolerances: both sides compute in float64 and differ only in the order of
roundings (e.g. ``lerp(m, g, 1 - b1)`` against ``(1 - b1) * g + b1 * m``,
``-expm1(t log b)`` against ``1 - b ** t``): ~1e-16 relative per operation,
so a few steps stay below 1e-13 (params of size ~1) unless noted.
Schedules are float32 in ftitan: within a few float32 roundings (rel 1e-6)
of optax's float64 values.
"""

from __future__ import annotations

import math
import sys

import absl.logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import ftitan.optim as fo
from ftitan import tree

from ._helpers import grad_stream, run

jax.config.update("jax_enable_x64", True)

# optax imports absl.logging, whose handler holds the sys.stderr of that moment: pytest's capture
# stream. absl's handler closes a stream that is not the current sys.stderr when logging shuts its
# handlers down, which vLLM's logging.config.dictConfig does: pytest's capture file is then closed
# under it and the whole run dies ("lost sys.stderr"). Point the handler at the real stderr, which
# absl never closes (nothing here logs through absl).
absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__

F64 = 1e-13


def nested_params() -> dict:
    g = torch.Generator().manual_seed(0)
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"layer": {"b": t(3), "w": t(3, 4)}, "head": t(4, 2), "x": t(5)}


def to_jax(t):
    return jax.tree.map(lambda x: jnp.asarray(x.numpy()), t)


def to_torch(t):
    return jax.tree.map(lambda x: torch.from_numpy(np.asarray(x).copy()), t)


def run_optax(opt, params, grads, edit=None):
    p = to_jax(params)
    s = opt.init(p)
    update = jax.jit(opt.update)  # one trace; eager lax.cond dispatch costs seconds
    for i, g in enumerate(grads):
        if edit is not None:
            s = edit(i, s)
        u, s = update(to_jax(g), s, p)
        p = optax.apply_updates(p, u)
    return to_torch(p), s


def assert_close(a, b, tol=F64):
    for path, x, y in zip(tree.paths(a), tree.leaves(a), tree.leaves(b), strict=True):
        diff = (x.double() - y.double()).abs().max().item()
        assert diff <= tol, (path, diff)


def test_adam_eps_root_and_adamw_match_optax():
    params = nested_params()
    grads = grad_stream(params, 8)
    kw = dict(b1=0.9, b2=0.99, eps=1e-8, eps_root=1e-6)
    assert_close(run(fo.adam(0.05, **kw), params, grads)[0], run_optax(optax.adam(0.05, **kw), params, grads)[0])
    ours = run(fo.adamw(0.05, weight_decay=0.1, **kw), params, grads)[0]
    assert_close(ours, run_optax(optax.adamw(0.05, weight_decay=0.1, **kw), params, grads)[0])
    assert (ours["head"] - params["head"]).abs().max() > 0.1  # the comparison saw real steps


def adam_bf16_mu_f64(params, grads, lr, b1=0.9, b2=0.999, eps=1e-8):
    """Adam in float64 whose first moment is stored in bf16 between steps (rounded after use)."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    for t, g in enumerate(grads, start=1):
        for k in p:
            m64 = b1 * m[k].double() + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            p[k] = p[k] - lr * (m64 / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps)
            m[k] = m64.to(torch.bfloat16)
    return p, m


def test_adam_mu_dtype_stores_bf16_and_updates_from_the_unrounded_moment():
    params = flat(nested_params())  # {dotted path: leaf}, for the leaf-by-leaf reference
    grads = grad_stream(params, 6)
    ours, state = run(fo.adam(0.05, mu_dtype=torch.bfloat16), params, grads)
    want, want_mu = adam_bf16_mu_f64(params, grads, 0.05)
    assert {x.dtype for x in tree.leaves(state[0].mu)} == {torch.bfloat16}
    assert {x.dtype for x in tree.leaves(state[0].nu)} == {torch.float64}
    assert_close(ours, want, tol=1e-12)  # float64 rounding order only; the bf16 moments agree exactly
    assert_close(state[0].mu, want_mu, tol=0)
    # optax stores mu the same way but multiplies b1 * mu in bf16 (jax's weak-type promotion), an
    # error of up to 2^-9 of the moment: per step at most lr * 2^-8 apart after Adam's normalization
    ref, ref_state = run_optax(optax.adam(0.05, mu_dtype=jnp.bfloat16), nested_params(), grads_nested(grads))
    assert_close(ours, flat(ref), tol=6 * 0.05 * 2**-8)
    assert ref_state[0].mu["head"].dtype == jnp.bfloat16


def flat(t):
    paths, leaves, _ = tree.flatten_with_paths(t)
    return dict(zip(paths, leaves, strict=True))


def grads_nested(grads):
    return [tree.from_paths(g) for g in grads]


def test_multi_steps_matches_optax():
    params = nested_params()
    grads = grad_stream(params, 9)
    ours, state = run(fo.MultiSteps(fo.adamw(0.05, weight_decay=0.1), 3), params, grads[:8])
    ref_opt = optax.MultiSteps(optax.adamw(0.05, weight_decay=0.1), 3, accumulator_dtype=jnp.float64)
    ref, ref_state = run_optax(ref_opt, params, grads[:8])
    assert_close(ours, ref)  # 2 applied updates, the third round half accumulated
    assert_close(state.acc_grads, to_torch(ref_state.acc_grads))
    assert (int(state.mini_step), int(state.gradient_step)) == (2, 2) == (int(ref_state.mini_step), int(ref_state.gradient_step))


def test_apply_if_finite_matches_optax():
    params = nested_params()
    grads = grad_stream(params, 8)
    for i in (2, 4, 5, 6):  # one bad step, then three in a row (> max_consecutive_errors=2: applied)
        grads[i]["layer"]["w"][0, 1] = math.nan if i % 2 else math.inf
    ours, state = run(fo.apply_if_finite(fo.adam(0.05), 2), params, grads[:6])
    ref, ref_state = run_optax(optax.apply_if_finite(optax.adam(0.05), 2), params, grads[:6])
    assert_close(ours, ref)
    assert torch.isfinite(ours["layer"]["w"]).all()
    for field in ("notfinite_count", "last_finite", "total_notfinite"):
        assert int(getattr(state, field)) == int(getattr(ref_state, field)), field
    assert (int(state.notfinite_count), int(state.total_notfinite)) == (2, 3)
    ours, _ = run(fo.apply_if_finite(fo.adam(0.05), 2), params, grads[:7])  # third in a row goes through
    assert torch.isnan(ours["layer"]["w"]).any()


def test_ema_and_ema_params_match_optax():
    params = nested_params()
    grads = grad_stream(params, 5)
    for debias in (True, False):
        opt = fo.chain(fo.ema(0.8, debias=debias), fo.scale(-0.1))
        ref = optax.chain(optax.ema(0.8, debias=debias), optax.scale(-0.1))
        assert_close(run(opt, params, grads)[0], run_optax(ref, params, grads)[0])
    # params EMA: optax's incremental_update over the params after every update, from the initial params
    p, state = run(fo.chain(fo.sgd(0.1, momentum=0.9), fo.ema_params(0.9)), params, grads)
    jp, s, ema = to_jax(params), optax.sgd(0.1, momentum=0.9).init(to_jax(params)), to_jax(params)
    for g in grads:
        u, s = optax.sgd(0.1, momentum=0.9).update(to_jax(g), s, jp)
        jp = optax.apply_updates(jp, u)
        ema = optax.incremental_update(jp, ema, step_size=0.1)
    assert_close(p, to_torch(jp))
    assert_close(fo.params_ema(state), to_torch(ema))


def test_masked_set_to_zero_and_freeze_inside_multi_transform_match_optax():
    params = nested_params()
    grads = grad_stream(params, 4)
    # masked: adam on the layer leaves only, the rest pass through as raw gradients (then scaled)
    ours, state = run(fo.chain(fo.masked(fo.adam(0.1), "layer.*"), fo.scale(-0.01)), params, grads)
    mask = {"layer": {"b": True, "w": True}, "head": False, "x": False}
    ref, _ = run_optax(optax.chain(optax.masked(optax.adam(0.1), mask), optax.scale(-0.01)), params, grads)
    assert_close(ours, ref)
    assert sorted(state[0].inner_state[0].mu) == ["layer.b", "layer.w"]  # no moments for masked-out leaves
    # a frozen label: freeze("layer.*") inside multi_transform freezes the nested leaves, as optax's freeze does
    labels = lambda path, x: "frozen" if path.startswith("layer.") else "train"  # noqa: E731
    ours, _ = run(fo.multi_transform({"train": fo.adam(0.1), "frozen": fo.freeze("layer.*")}, labels), params, grads)
    jlabels = {"layer": {"b": "frozen", "w": "frozen"}, "head": "train", "x": "train"}
    ref, _ = run_optax(
        optax.multi_transform({"train": optax.adam(0.1), "frozen": optax.freeze(True)}, jlabels), params, grads
    )
    assert_close(ours, ref)
    assert torch.equal(ours["layer"]["b"], params["layer"]["b"]) and torch.equal(ours["layer"]["w"], params["layer"]["w"])
    # selective_transform: the same partition, optax's name
    ours, _ = run(fo.selective_transform(fo.adam(0.1), freeze_mask="layer.**"), params, grads)
    assert_close(ours, ref)
    ours, _ = run(fo.multi_transform({"train": fo.adam(0.1), "frozen": fo.set_to_zero()}, labels), params, grads)
    assert_close(ours, ref)


def test_inject_hyperparams_matches_optax_with_edits():
    params = nested_params()
    grads = grad_stream(params, 6)

    def edit_ours(i, s):
        return fo.set_hyperparams(s, lr=0.0 if i == 2 else 0.02 * (i + 1), weight_decay=0.05 * i)

    def edit_ref(i, s):
        s.hyperparams["learning_rate"] = jnp.asarray(0.0 if i == 2 else 0.02 * (i + 1))
        s.hyperparams["weight_decay"] = jnp.asarray(0.05 * i)
        return s

    opt = fo.inject_hyperparams(fo.adamw)(lr=0.1, weight_decay=0.0, b1=0.9)
    state = opt.init(params)
    p = params
    for i, g in enumerate(grads):
        state = edit_ours(i, state)
        u, state = opt.update(g, state, p)
        p = fo.apply_updates(p, u)
    ref, _ = run_optax(optax.inject_hyperparams(optax.adamw)(learning_rate=0.1, weight_decay=0.0, b1=0.9), params, grads, edit_ref)
    assert_close(p, ref)
    assert state.hyperparams["lr"].dtype == torch.float64 and fo.current_lr(state).item() == pytest.approx(0.12)


SCHEDULES = [
    (lambda: fo.polynomial(1.0, 0.1, 2.0, 50, 10), lambda: optax.polynomial_schedule(1.0, 0.1, 2.0, 50, 10)),
    (lambda: fo.linear(0.2, 1.0, 30, 5), lambda: optax.linear_schedule(0.2, 1.0, 30, 5)),
    (lambda: fo.exponential_decay(1.0, 10, 0.5), lambda: optax.exponential_decay(1.0, 10, 0.5)),
    (
        lambda: fo.exponential_decay(2.0, 7, 0.8, transition_begin=5, staircase=True, end_value=0.3),
        lambda: optax.exponential_decay(2.0, 7, 0.8, transition_begin=5, staircase=True, end_value=0.3),
    ),
    (lambda: fo.exponential_decay(0.1, 10, 1.5, end_value=2.0), lambda: optax.exponential_decay(0.1, 10, 1.5, end_value=2.0)),
    (
        lambda: fo.piecewise_constant(1.0, {40: 0.1, 10: 0.5, 70: 0.2}),
        lambda: optax.piecewise_constant_schedule(1.0, {40: 0.1, 10: 0.5, 70: 0.2}),
    ),
    (lambda: fo.linear_warmup(1.0, 20, init_value=0.1), lambda: optax.linear_schedule(0.1, 1.0, 20)),
    (
        lambda: fo.warmup_cosine(1.0, 10, 100, final=0.05, init_value=0.2),
        lambda: optax.warmup_cosine_decay_schedule(0.2, 1.0, 10, 100, 0.05),
    ),
    (
        lambda: fo.join_schedules([fo.linear_warmup(1.0, 10, init_value=0.1), fo.cosine_decay(1.0, 50, 0.1), fo.constant(0.3)], [10, 60]),
        lambda: optax.join_schedules(
            [optax.linear_schedule(0.1, 1.0, 10), optax.cosine_decay_schedule(1.0, 50, alpha=0.1), optax.constant_schedule(0.3)], [10, 60]
        ),
    ),
]


@pytest.mark.parametrize("i", range(len(SCHEDULES)))
def test_schedules_match_optax(i):
    ours, ref = SCHEDULES[i][0](), SCHEDULES[i][1]()
    steps = torch.arange(0, 121, dtype=torch.int64)
    got = torch.stack([ours(s) for s in steps])  # one 0-d step at a time, as a train step calls it
    assert got.dtype == torch.float32 and got.shape == (121,)
    want = np.asarray(ref(jnp.arange(121)), dtype=np.float64)  # optax's schedules take a vector of steps
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-6, atol=1e-9)
    assert len(set(want.round(9))) > 2  # the schedule moves over these steps
