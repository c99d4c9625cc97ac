"""Invariants every optimizer in ``ftitan.optim.OPTIMIZERS`` must keep.

A new registry entry gets these checks for free: dtype kept (float32 and
bf16 params), state structure stable across steps, composable after
``clip_by_global_norm``, and a ``torch.compile(fullgraph=True)`` step that
equals eager and never recompiles while the learning rate moves.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo.testing

import ftitan.optim as fo
from ftitan import tree

from ._helpers import grad_stream, llama_params, matrices_only

NAMES = sorted(fo.OPTIMIZERS)


def params_for(name: str, dtype: torch.dtype) -> Any:
    params = llama_params(dtype)
    return matrices_only(params) if name in fo.MATRIX_ONLY else params


def schedule() -> fo.Schedule:
    return fo.warmup_cosine(1e-2, warmup=2, total=8)


def spec(t: Any) -> tuple[Any, list[tuple[Any, ...]]]:
    """Structure, shapes, dtypes and devices of a tree: what a compiled step guards on."""
    return tree.structure(t), [(x.shape, x.dtype, x.device) for x in tree.leaves(t)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_dtype_kept_and_state_stable(name, dtype):
    params = params_for(name, dtype)
    opt = fo.OPTIMIZERS[name](schedule())
    state = state0 = opt.init(params)
    for grads in grad_stream(params, 3):
        updates, state = opt.update(grads, state, params)
        assert spec(updates) == spec(params)
        assert all(torch.isfinite(u).all() for u in tree.leaves(updates))
        new_params = fo.apply_updates(params, updates)
        assert spec(new_params) == spec(params)
        assert spec(state) == spec(state0)
        params = new_params
    assert fo.current_lr(state).shape == ()


@pytest.mark.parametrize("name", NAMES)
def test_chains_after_clipping(name):
    params = params_for(name, torch.float32)
    opt = fo.OPTIMIZERS[name](schedule())
    clipped = fo.chain(fo.clip_by_global_norm(1.0), opt)
    small = grad_stream(params, 1, scale=1e-4)[0]  # global norm < 1: clipping is the identity
    big = grad_stream(params, 1, seed=7)[0]
    norm = tree.global_norm(big)
    assert tree.global_norm(small) < 1.0 < norm
    state, cstate = opt.init(params), clipped.init(params)
    for grads, expected_grads in [(small, small), (big, tree.map(lambda g: g / norm, big))]:
        want, state = opt.update(expected_grads, state, params)
        got, cstate = clipped.update(grads, cstate, params)
        for a, b in zip(tree.leaves(got), tree.leaves(want), strict=True):
            # the clip factor 1/norm is applied in float32 before the optimizer; the
            # reference divides directly: they agree to a few float32 ulps, which the
            # normalizing optimizers (Adam, Muon) can amplify by 1/(|g|+eps) ~ 1e2
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert spec(cstate[1]) == spec(state)


@pytest.mark.parametrize("name", NAMES)
def test_compiled_step_equals_eager_without_recompiles(name):
    params = params_for(name, torch.float32)
    opt = fo.OPTIMIZERS[name](schedule())

    def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any, torch.Tensor]:
        updates, state = opt.update(grads, state, params)
        return fo.apply_updates(params, updates), state, fo.current_lr(state)

    torch._dynamo.reset()  # `step` is one code object across the parametrized cases
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    eager_p, eager_s = params, opt.init(params)
    comp_p, comp_s = params, opt.init(params)
    lrs = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for grads in grad_stream(params, 4):
            eager_p, eager_s, eager_lr = step(eager_p, eager_s, grads)
            comp_p, comp_s, comp_lr = compiled(comp_p, comp_s, grads)
            lrs.append(comp_lr.item())
            # aot_eager runs the same aten ops as eager, so the results agree exactly
            got, want = tree.leaves((comp_p, comp_s, comp_lr)), tree.leaves((eager_p, eager_s, eager_lr))
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counter.frame_count == 1
    assert len(set(lrs)) == 4  # the lr moved every step: 0, 5e-3, 1e-2, 9.3e-3
