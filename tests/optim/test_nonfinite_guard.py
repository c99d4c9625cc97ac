"""The non-finite guard a run's optimizer sits behind (``--optim.nonfinite``): ``apply_if_finite(..., halt=True)``.

Skipped steps leave params and optimizer state bit-identical; the guard counts them, halts after
``max_nonfinite`` in a row ("skip") or at the first ("stop"), and remembers where the run of bad
gradients began (step and leaf) for the trainer's message. optax parity of the default
(``halt=False``) lives in ``test_optax_parity.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing

import ftitan.optim as fo
from ftitan import tree
from ftitan.config.schema import OptimConfig

from ._helpers import llama_params


def _grads(params, bad: str | None = None):
    g = tree.map(lambda x: torch.full_like(x, 0.1), params)
    if bad is not None:  # a dotted path: NaN in that leaf
        leaf = dict(zip(tree.paths(g), tree.leaves(g), strict=True))[bad]
        leaf.view(-1)[0] = math.nan
    return g


def _run(opt, params, pattern: str, bad: str = "layers.0.attn.wq"):
    """Apply ``opt`` for each character of ``pattern`` ("." a finite step, "x" a NaN one in ``bad``)."""
    state, history = opt.init(params), []
    for c in pattern:
        before = (tree.map(torch.clone, params), tree.map(torch.clone, state.inner_state))
        updates, state = opt.update(_grads(params, bad if c == "x" else None), state, params)
        params = fo.apply_updates(params, updates)
        history.append((before, (params, state.inner_state)))
    return params, state, history


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tree.leaves(a), tree.leaves(b), strict=True))


def test_skip_leaves_params_and_state_untouched_and_counts():
    params = llama_params()
    opt = fo.guard_nonfinite(fo.adamw(1e-2), "skip", max_nonfinite=3)
    _, state, history = _run(opt, params, ".x.xx.")
    for i, c in enumerate(".x.xx."):
        (p0, s0), (p1, s1) = history[i]
        assert _same(p0, p1) == _same(s0, s1) == (c == "x"), i  # a skipped step changes nothing
    assert int(state.total_notfinite) == 3 and int(state.count) == 6
    assert not bool(state.halted)  # at most 2 in a row
    paths = tree.paths(params)
    assert (int(state.bad_step), paths[int(state.bad_leaf)]) == (4, "layers.0.attn.wq")  # the latest run's start


def test_skip_halts_after_max_nonfinite_in_a_row_and_applies_nothing_after():
    params = llama_params()
    opt = fo.guard_nonfinite(fo.adamw(1e-2), "skip", max_nonfinite=3)
    _, state, history = _run(opt, params, "..xxx..", bad="layers.1.moe.w2")
    assert bool(state.halted) and int(state.total_notfinite) == 3
    assert (int(state.bad_step), tree.paths(params)[int(state.bad_leaf)]) == (3, "layers.1.moe.w2")
    (p0, _), (p1, _) = history[-1]
    assert _same(p0, p1)  # halted: finite gradients are not applied either; params stay step 2's


def test_stop_halts_at_the_first_nonfinite_gradient_and_off_applies_it():
    params = llama_params()
    _, state, _ = _run(fo.guard_nonfinite(fo.adamw(1e-2), "stop"), params, "..x", bad="head")
    assert bool(state.halted) and (int(state.bad_step), tree.paths(params)[int(state.bad_leaf)]) == (3, "head")
    new, state, _ = _run(fo.guard_nonfinite(fo.adamw(1e-2), "off"), params, "..x", bad="head")
    assert not bool(state.halted) and int(state.total_notfinite) == 1
    assert torch.isnan(new["head"]).any()  # applied: "off" only counts


def test_from_config_puts_the_whole_chain_behind_the_guard():
    params = llama_params()
    for mode in ("skip", "stop", "off"):
        opt = fo.from_config(OptimConfig(nonfinite=mode, warmup=1), 10, params)
        state = opt.init(params)
        assert isinstance(state, fo.ApplyIfFiniteState) and fo.find_finite_guard(state) is state
        # the same state in every mode: a checkpoint resumes under another one
        assert tree.paths(state) == tree.paths(fo.from_config(OptimConfig(warmup=1), 10, params).init(params))
    with pytest.raises(ValueError, match="--optim.nonfinite='never'"):
        fo.guard_nonfinite(fo.adamw(1e-2), "never")


def test_guarded_step_compiles_once():
    params = {"embed": torch.randn(4, 3), "head": torch.randn(3, 4)}
    opt = fo.guard_nonfinite(fo.adamw(1e-2), "skip")

    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return fo.apply_updates(p, u), s

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    p, s = params, opt.init(params)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for c in ".x.xx":
            p, s = compiled(p, s, _grads(params, "embed" if c == "x" else None))
    assert counter.frame_count == 1
    assert (int(s.total_notfinite), int(s.bad_step), int(s.bad_leaf)) == (3, 4, 0)  # embed: the first leaf
