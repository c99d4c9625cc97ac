"""ftitan.kernels.permute: the MoE dispatch/combine Triton kernels (interpreter, CPU) vs their references.

Tolerances: dispatch is a copy (exact, 0). fp32 combine sums k <= 3 products in fp32 in the same order
as the reference (measured exact; 1e-6 allowed for the fused multiply-add the kernel may use); its weight
gradient is a dot over D columns summed in another order (1e-5). bf16: the kernel accumulates in fp32
and rounds once, the reference rounds each product and partial sum to bf16, so they differ by a few bf16
ulps (2^-8 relative): rtol 2e-2, atol 2e-2 on values of order 1.
"""

from __future__ import annotations

import pytest
import torch

from ftitan.kernels import op
from ftitan.kernels import permute as P
from ftitan.nn import moe as M

FP32 = dict(rtol=1e-6, atol=1e-6)
BF16 = dict(rtol=2**-6, atol=1e-3)  # against float32 references: twice the largest error measured (2**-7, 60 draws)


def _case(n: int = 7, k: int = 3, e: int = 5, d: int = 37, dtype=torch.float32, drop: bool = True, seed: int = 0):
    """Routing of ``n`` tokens to ``k`` of ``e`` experts; one dropped pair (-1) when ``drop``; ``d`` columns
    (37: ragged against every power-of-two block)."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    if drop:
        experts[2, 1] = -1
    perm = P.sort_by_expert(experts, e)
    x = torch.randn(n, d, generator=g).to(dtype)
    w = torch.rand(n, k, generator=g).to(dtype)
    return experts, perm, x, w


class _Spy:
    """Counts ``apply`` calls of the autograd Functions (the kernel path) while patched in."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for cls in (P._Dispatch, P._Combine):
            original = cls.apply

            def counted(*args, _original=original):
                self.calls += 1
                return _original(*args)

            monkeypatch.setattr(cls, "apply", counted)


def test_sort_by_expert_is_nn_moe_argsort_on_device():
    experts, perm, x, _ = _case(drop=False)
    d = M.dispatch(x, M.Routing(torch.ones(experts.shape), experts, torch.ones(7, 5)), 5)
    assert perm.offs.dtype == torch.int32 and torch.equal(perm.offs, d.offs) and torch.equal(perm.counts, d.counts)
    assert torch.equal(perm.pos.reshape(-1)[d.order], torch.arange(experts.numel()))  # pos inverts order
    torch.testing.assert_close(P.dispatch_reference(x, perm.pos, experts.numel()), d.x, rtol=0, atol=0)
    # a dropped pair (-1, or an id past the experts) has no row and is not counted
    experts[0, 0], experts[1, 2] = -1, 9
    dropped = P.sort_by_expert(experts, 5)
    assert dropped.pos[0, 0] == -1 and dropped.pos[1, 2] == -1
    assert int(dropped.offs[-1]) == experts.numel() - 2 and sorted(dropped.pos[dropped.pos >= 0].tolist()) == list(
        range(experts.numel() - 2)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_reference(dtype):
    """bf16 combines: against the reference in float32 on the same bf16 values (see the gradient test
    below; the reference's own bf16 weighted sums were off by up to 3x on cancelling rows over 60 draws)."""
    _, perm, x, w = _case(dtype=dtype)
    n_rows = x.shape[0] * 3 + 4  # padding rows past every pair
    y = torch.randn(n_rows, x.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    y[-4:] = float("nan")  # padding rows are never read
    with op.interpret():
        got_d, got_c, got_c1 = P.dispatch(x, perm.pos, n_rows), P.combine(y, perm.pos, w), P.combine(y, perm.pos)
    torch.testing.assert_close(got_d, P.dispatch_reference(x, perm.pos, n_rows), rtol=0, atol=0)
    tol = FP32 if dtype == torch.float32 else BF16
    torch.testing.assert_close(got_c.float(), P.combine_reference(y.float(), perm.pos, w.float()), **tol)
    torch.testing.assert_close(got_c1.float(), P.combine_reference(y.float(), perm.pos), **tol)
    assert got_d.dtype == got_c.dtype == dtype and not got_d[-4:].any()


@pytest.mark.parametrize(("dtype", "d"), [(torch.float32, 37), (torch.bfloat16, 37), (torch.float32, 1100)])
def test_gradients_through_the_backward_ops_match_reference(dtype, d, monkeypatch):
    """d=1100: the combine backward's loop over column blocks (block 1024) is exercised. bf16: against the
    reference evaluated in float32 on the same bf16 values, within two bf16 roundings (the kernels sum in
    float32 and round once; the reference's own bf16 sums lose up to 94% of a cancelling weight gradient,
    measured over 60 draws, which made a bf16-vs-bf16 comparison fail for some draws)."""
    _, perm, x, w = _case(n=4 if d > 64 else 7, d=d, dtype=dtype)
    n_rows = perm.pos.numel() + 2
    g = torch.Generator().manual_seed(1)
    y = torch.randn(n_rows, d, generator=g).to(dtype)
    gd, gc = torch.randn(n_rows, d, generator=g).to(dtype), torch.randn(x.shape[0], d, generator=g).to(dtype)

    def losses(dispatch, combine, x, y, w):
        dispatched = (dispatch(x, perm.pos, n_rows).float() * gd.float()).sum()
        return dispatched + (combine(y, perm.pos, w).float() * gc.float()).sum()

    args = [t.clone().requires_grad_() for t in (x, y, w)]
    wide = [t.detach().float().requires_grad_() for t in (x, y, w)]
    ref = torch.autograd.grad(losses(P.dispatch_reference, P.combine_reference, *wide), wide)
    spy = _Spy(monkeypatch)
    with op.interpret():
        got = torch.autograd.grad(losses(P.dispatch, P.combine, *args), args)
    assert spy.calls == 2  # the kernels' Functions ran (their backward ops gave these gradients)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else BF16
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, **tol)


def test_compiled_gradients_match_eager_reference():
    _, perm, x, w = _case()
    n_rows = perm.pos.numel()
    y0 = torch.randn(n_rows, x.shape[1])

    def loss_and_grads(dispatch, combine, x, w):
        y = torch.tanh(dispatch(x, perm.pos, n_rows)) + y0  # combine reads what dispatch wrote
        loss = (combine(y, perm.pos, w) ** 2).sum()
        return loss.detach(), torch.autograd.grad(loss, (x, w))

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_loss, ref = loss_and_grads(P.dispatch_reference, P.combine_reference, xr, wr)
    compiled = torch.compile(lambda x, w: loss_and_grads(P.dispatch, P.combine, x, w), fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    with op.interpret(), torch._dynamo.config.patch(trace_autograd_ops=True):
        loss, got = compiled(x.clone().requires_grad_(), w.clone().requires_grad_())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_steps_aside_under_torch_func_transforms(monkeypatch):
    _, perm, x, w = _case()
    n_rows = perm.pos.numel()
    y = torch.randn(n_rows, x.shape[1])

    def f(dispatch, combine):
        return lambda x, w: (combine(torch.sin(dispatch(x, perm.pos, n_rows)) + y, perm.pos, w) ** 2).sum()

    spy = _Spy(monkeypatch)
    with op.interpret():
        grad = torch.func.grad(f(P.dispatch, P.combine), argnums=(0, 1))(x, w)
        _, tangent = torch.func.jvp(f(P.dispatch, P.combine), (x, w), (torch.ones_like(x), torch.ones_like(w)))
        batched = torch.func.vmap(lambda y_: P.combine(y_, perm.pos, w))(torch.stack([y, 2 * y]))
    assert spy.calls == 0  # each transform saw the reference's plain ops
    ref = f(P.dispatch_reference, P.combine_reference)
    for a, b in zip(grad, torch.func.grad(ref, argnums=(0, 1))(x, w), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(tangent, torch.func.jvp(ref, (x, w), (torch.ones_like(x), torch.ones_like(w)))[1])
    torch.testing.assert_close(batched[1], P.combine_reference(2 * y, perm.pos, w))


def test_moe_layer_with_triton_kernels_equals_torch_kernels(monkeypatch):
    """nn.moe with ``kernels="triton"`` (the permute kernels in the interpreter) == ``kernels="torch"``:
    outputs and every gradient (fp32; the grouped GEMMs are the same, so only summation order differs)."""
    from ftitan import nn

    cfg = M.MoEConfig(n_experts=6, top_k=2, expert_dim=8, n_shared_experts=1)
    params = nn.init(M.moe_params(12, cfg, std=0.3), __import__("ftitan").random.key(0))
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(3))

    def run(c):
        leaves = [params["router"], *params["experts"].values()]
        leaves = [t.clone().requires_grad_() for t in leaves]
        p = {**params, "router": leaves[0], "experts": dict(zip(params["experts"], leaves[1:], strict=True))}
        y, stats = M.moe(x, p, c)
        return y, stats, torch.autograd.grad((y**2).sum(), leaves)

    ref_y, ref_stats, ref_g = run(cfg)
    spy = _Spy(monkeypatch)
    with op.interpret():
        y, stats, g = run(M.MoEConfig(**{**__import__("attrs").asdict(cfg), "kernels": "triton"}))
    assert spy.calls == 2
    torch.testing.assert_close(y, ref_y, **FP32)
    assert torch.equal(stats.counts, ref_stats.counts)
    for a, b in zip(g, ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


_AOT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ftitan.kernels import permute as P

def sig(names, types, consts):
    return {**dict(zip(names, types)), **{k: "constexpr" for k in consts}}

cases = []
for dt in ("*bf16", "*fp32"):
    cases += [
        (P._dispatch_kernel, sig(["x_ptr", "pos_ptr", "out_ptr", "D"], [dt, "*i64", dt, "i32"], ["K", "BLOCK_D"]),
         {"K": 8, "BLOCK_D": 1024}),
        (P._combine_bwd_kernel, sig(["g_ptr", "y_ptr", "pos_ptr", "w_ptr", "gy_ptr", "gw_ptr", "D"],
                                    [dt, dt, "*i64", dt, dt, dt, "i32"], ["K", "BLOCK_D"]), {"K": 8, "BLOCK_D": 1024}),
    ] + [
        (P._combine_kernel, sig(["y_ptr", "pos_ptr", "w_ptr", "out_ptr", "D"], [dt, "*i64", dt if has_w else "*i64", dt, "i32"],
                                ["K", "HAS_W", "BLOCK_D"]), {"K": 8, "HAS_W": has_w, "BLOCK_D": 1024})
        for has_w in (False, True)
    ]
for fn, signature, consts in cases:
    compiled = triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    assert "ptx" in compiled.asm and "cubin" in compiled.asm, fn
print("compiled", len(cases))
'''


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    """The interpreter accepts Python the compiler refuses: compile the three kernels (fp32 and bf16, combine
    with and without weights) ahead of time for sm_90 to PTX and cubin, without a GPU (~30 s)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[2]), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "compiled 8" in out.stdout
