"""AdamW parity with torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

import ftitan.optim as fo
from ftitan import tree
from ftitan.optim.adam import bias_correction

from ._helpers import grad_stream, llama_params, max_abs_diff, run


def torch_adamw(params, grads, *, lr_at, b1, b2, eps, weight_decay, dtype):
    _, leaves, treedef = tree.flatten_with_paths(params)
    ps = [x.clone().requires_grad_(True) for x in leaves]
    opt = torch.optim.AdamW(ps, lr=lr_at(0), betas=(b1, b2), eps=eps, weight_decay=weight_decay, foreach=False)
    for step, g in enumerate(grads):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        for p, gl in zip(ps, tree.leaves(g), strict=True):
            p.grad = gl.clone()
        opt.step()
    return tree.unflatten(treedef, [p.detach() for p in ps])


def test_adamw_matches_torch_float64():
    # float64 throughout, constant lr: the two differ only in the order of
    # float64 roundings (~1e-16 relative per op), so 20 steps stay far below 1e-12
    params = llama_params(torch.float64)
    grads = grad_stream(params, 20)
    kw = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    ours, _ = run(fo.adamw(1e-2, **kw), params, grads)
    ref = torch_adamw(params, grads, lr_at=lambda _s: 1e-2, dtype=torch.float64, **kw)
    assert max_abs_diff(ours, ref) <= 1e-12


def test_adamw_matches_torch_float32_with_schedule():
    # the schedule's lr is a float32 tensor; torch gets the same float32 value as a
    # Python float. Per step each param may differ by ~2 float32 ulps of |p| <= 4
    # (2 * 4.8e-7) from rounding order and the float32 bias correction; 20 steps -> 2e-5
    params = llama_params(torch.float32)
    grads = grad_stream(params, 20)
    schedule = fo.warmup_cosine(1e-2, warmup=5, total=20)
    lr_at = lambda s: schedule(torch.tensor(s)).item()  # noqa: E731
    kw = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    ours, state = run(fo.adamw(schedule, **kw), params, grads)
    ref = torch_adamw(params, grads, lr_at=lr_at, dtype=torch.float32, **kw)
    assert max_abs_diff(ours, ref) <= 2e-5
    assert max_abs_diff(ours, params) > 1e-3  # the test moved the params at all
    assert fo.current_lr(state).item() == pytest.approx(lr_at(19), rel=1e-6)


def test_bias_correction_accurate_in_float32():
    got = bias_correction(0.999, torch.tensor(1), torch.float32).item()
    assert got == pytest.approx(1 - 0.999, rel=1e-6)  # naive float32 1 - 0.999**1 is off by 1.3e-5


def test_adamw_mask_excludes_from_decay():
    params = {"w": torch.ones(2, 2, dtype=torch.float64), "b": torch.ones(2, dtype=torch.float64)}
    zero = tree.map(torch.zeros_like, params)
    opt = fo.adamw(0.1, weight_decay=0.5, mask="w")
    updates, _ = opt.update(zero, opt.init(params), params)
    torch.testing.assert_close(updates["w"], torch.full((2, 2), -0.05, dtype=torch.float64))
    torch.testing.assert_close(updates["b"], torch.zeros(2, dtype=torch.float64))


def test_adam_moments_float32_for_bf16_params():
    params = llama_params(torch.bfloat16)
    state = fo.scale_by_adam().init(params)
    assert {x.dtype for x in tree.leaves(state.mu)} == {torch.float32}
    state64 = fo.scale_by_adam().init(llama_params(torch.float64))
    assert {x.dtype for x in tree.leaves(state64.nu)} == {torch.float64}


@pytest.mark.parametrize("kw", [dict(b1=1.0), dict(b2=-0.1), dict(eps=-1.0)])
def test_adam_rejects_bad_hyperparameters(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        fo.scale_by_adam(**kw)


def test_compiled_update_evaluates_bias_corrections_once():
    """Inductor would inline a lone 0-d ``-expm1(step * log(beta))`` into every leaf's loop (re-evaluated
    per 8 elements, twice the update's time on CPU); the corrections are computed once and read."""
    from torch._inductor.utils import run_and_get_code

    counts = []
    for shapes in ([(64, 32), (48,), (16, 16)], [(256, 64), (64, 256), (64,), (1024, 64), (8, 8)]):
        torch._dynamo.reset()
        params = {f"w{i}": torch.randn(s) for i, s in enumerate(shapes)}
        grads = tree.map(torch.randn_like, params)
        opt = fo.adamw(1e-3)

        def update(p, g, s, opt=opt):
            u, s = opt.update(g, s, p)
            return fo.apply_updates(p, u), s

        (got, _), codes = run_and_get_code(torch.compile(update, fullgraph=True), params, grads, opt.init(params))
        want, _ = update(params, grads, opt.init(params))
        for k in params:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
        counts.append("\n".join(codes).count("std::expm1("))
    assert counts == [2, 2], f"expm1 calls in the generated code, by leaf count (3, 5): {counts}"
