"""The Gated DeltaNet chunk kernel (Triton, in the interpreter) against nn.gdn's chunked and recurrent forms:
values (ragged T, grouped heads, initial state, packed documents), gradients, bf16, compiled gradients,
torch.func stepping aside, a Qwen3-Next model with kernels="triton".

Tolerances: fp32 1e-5 absolute (the kernel, the chunked and the recurrent forms differ by summation order
only; measured ~2e-7 forward, ~1.4e-6 gradients through the Triton backward). bf16 inputs: both sides
compute in fp32 and round the output to bf16, so they differ by at most a couple of bf16 ulps of the
output (rtol 2^-7, atol 1e-2; note the Triton interpreter rounds fp32 -> bf16 by truncation).
"""

import attrs
import pytest
import torch

from ftitan import random, tree
from ftitan.kernels import gdn as kg
from ftitan.kernels import op
from ftitan.models import qwen3_next
from ftitan.nn import gdn

TOL = dict(rtol=1e-5, atol=1e-5)
CHUNK = 16  # the kernel's smallest tile; T = 37 leaves a ragged last chunk of 5


def _case(b=2, t=37, hk=1, hv=2, dk=8, dv=12, seed=0, dtype=torch.float32):
    """Inputs as a Gated DeltaNet layer gives them; dk=8, dv=12 are not powers of two (masked columns)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=g)
    decay = -torch.rand(b, t, hv, generator=g) * 0.5
    beta = torch.rand(b, t, hv, generator=g)
    state = torch.randn(b, hv, dk, dv, generator=g)
    return tuple(x.to(dtype) for x in (q, k, v, decay, beta)), state


def _segments(t=37):
    """Row 0: three documents, one starting inside the first chunk and one inside the third; row 1: one."""
    return torch.tensor([[0] * 10 + [1] * 20 + [2] * (t - 30), [5] * t])


class _Spy:
    """Counts the kernel's forward and backward op calls (patched over kernels.gdn's module globals)."""

    def __init__(self, monkeypatch):
        self.fwd = self.bwd = 0
        fwd, bwd = kg._FWD, kg._BWD

        def spy_fwd(*a):
            self.fwd += 1
            return fwd(*a)

        def spy_bwd(*a):
            self.bwd += 1
            return bwd(*a)

        monkeypatch.setattr(kg, "_FWD", spy_fwd)
        monkeypatch.setattr(kg, "_BWD", spy_bwd)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("initial", [False, True])
@pytest.mark.parametrize(("t", "hk"), [(37, 1), (16, 2), (3, 1)])
def test_forward_matches_chunked_and_recurrent(t, hk, initial, packed, monkeypatch):
    (q, k, v, decay, beta), state = _case(t=t, hk=hk)
    state = state if initial else None
    segments = _segments(t) if packed and t > 30 else None
    spy = _Spy(monkeypatch)
    with op.interpret():
        o, s = kg.chunk_delta_rule(q, k, v, decay, beta, state, chunk=CHUNK, segments=segments)
    assert spy.fwd == 1
    for ref in (gdn.chunked_delta_rule, gdn.recurrent_delta_rule):
        kw = dict(chunk=CHUNK) if ref is gdn.chunked_delta_rule else {}
        ro, rs = ref(q, k, v, decay, beta, state, segments=segments, **kw)
        torch.testing.assert_close(o, ro, **TOL)
        torch.testing.assert_close(s, rs, **TOL)
    if segments is not None:  # the masks matter: the unpacked run differs
        assert (gdn.chunked_delta_rule(q, k, v, decay, beta, state)[0] - o).abs().max() > 1e-2


def test_value_blocks_split_the_state_columns(monkeypatch):
    (q, k, v, decay, beta), state = _case(t=21, dv=40, seed=9)  # 40 = blocks of 16, 16 and a ragged 8
    segments = torch.tensor([[0] * 5 + [1] * 16, [3] * 21])
    monkeypatch.setattr(kg, "_BLOCK_V", 16)
    with op.interpret():
        o, s = kg.chunk_delta_rule(q, k, v, decay, beta, state, chunk=CHUNK, segments=segments)
    ro, rs = gdn.recurrent_delta_rule(q, k, v, decay, beta, state, segments=segments)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(s, rs, **TOL)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, decay, beta, state)]
    with op.interpret():
        o, s = kg.chunk_delta_rule(*inputs, chunk=CHUNK, segments=segments)
        got = torch.autograd.grad(o.square().sum() + s.sum(), inputs)
    o, s = kg.chunk_delta_rule_reference(*inputs, chunk=CHUNK, segments=segments)
    for a, b in zip(got, torch.autograd.grad(o.square().sum() + s.sum(), inputs), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_kernel_chunk_does_not_change_the_result():
    (q, k, v, decay, beta), state = _case(t=40, seed=1)
    with op.interpret():
        small = kg.chunk_delta_rule(q, k, v, decay, beta, state, chunk=16)
        large = kg.chunk_delta_rule(q, k, v, decay, beta, state, chunk=32)
    for a, b in zip(small, large, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize(("t", "hk", "hv", "packed"), [(37, 1, 2, False), (37, 1, 2, True), (32, 2, 4, True)])
def test_gradients_match_the_reference(t, hk, hv, packed, monkeypatch):
    (q, k, v, decay, beta), state = _case(t=t, hk=hk, hv=hv, seed=2)
    segments = _segments(t) if packed else None
    g = torch.Generator().manual_seed(3)
    w_o, w_s = torch.randn(2, t, hv, 12, generator=g), torch.randn(2, hv, 8, 12, generator=g)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, decay, beta, state)]

    def loss(fn):
        o, s = fn(*inputs, chunk=CHUNK, segments=segments)
        return (o * w_o).sum() + (s * w_s).sum()

    want = torch.autograd.grad(loss(kg.chunk_delta_rule_reference), inputs)
    spy = _Spy(monkeypatch)
    with op.interpret():
        got = torch.autograd.grad(loss(kg.chunk_delta_rule), inputs)
    assert (spy.fwd, spy.bwd) == (1, 1)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_no_initial_state_gets_no_state_gradient():
    (q, k, v, decay, beta), _ = _case(t=20, seed=4)
    v = v.clone().requires_grad_()
    with op.interpret():
        o, s = kg.chunk_delta_rule(q, k, v, decay, beta, chunk=CHUNK)
        (dv,) = torch.autograd.grad(o.sum() + s.sum(), v)
    (want,) = torch.autograd.grad(sum(x.sum() for x in kg.chunk_delta_rule_reference(q, k, v, decay, beta)), v)
    torch.testing.assert_close(dv, want, **TOL)


def test_bf16_gradients_match_the_reference():
    (q, k, v, decay, beta), state = _case(seed=10, dtype=torch.bfloat16)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, decay, beta, state)]

    def grads(fn):
        o, s = fn(*inputs, chunk=CHUNK)
        return torch.autograd.grad(o.float().square().sum() + s.sum(), inputs)

    with op.interpret():
        got = grads(kg.chunk_delta_rule)
    for a, b in zip(got, grads(kg.chunk_delta_rule_reference), strict=True):
        assert a.dtype == b.dtype
        # both in fp32 from the same bf16 inputs; the cotangent 2 o differs by the output's bf16 rounding
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2e-2)


def test_bf16_matches_the_reference_within_output_rounding():
    (q, k, v, decay, beta), state = _case(seed=5, dtype=torch.bfloat16)
    with op.interpret():
        o, s = kg.chunk_delta_rule(q, k, v, decay, beta, state, chunk=CHUNK)
    ro, rs = kg.chunk_delta_rule_reference(q, k, v, decay, beta, state, chunk=CHUNK)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    torch.testing.assert_close(o.float(), ro.float(), rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(s, rs, **TOL)  # the state stays fp32 (inputs identical after rounding)


@pytest.mark.parametrize("initial", [True, False])
def test_compiled_gradients_with_autograd_grad_inside(initial, monkeypatch):
    (q, k, v, decay, beta), state = _case(t=21, seed=6)
    segments = torch.tensor([[0] * 9 + [1] * 12, [2] * 21])

    def grads(fn, q, k, v, decay, beta, state):
        xs = [x.detach().requires_grad_() for x in (q, k, v, decay, beta, state)]
        o, s = fn(*xs[:5], xs[5] if initial else None, chunk=CHUNK, segments=segments)
        return torch.autograd.grad(o.square().sum() + s.sum(), xs[:6] if initial else xs[:5])

    want = grads(kg.chunk_delta_rule_reference, q, k, v, decay, beta, state)
    graphs = []

    def backend(gm, example_inputs):  # aot_eager, recording the code dynamo captured (submodules included)
        graphs.append(gm.print_readable(print_output=False))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    # set and restored, not monkeypatched: undoing a monkeypatch of a dynamo config deletes the flag
    before, torch._dynamo.config.trace_autograd_ops = torch._dynamo.config.trace_autograd_ops, True
    try:
        with op.interpret():
            got = torch.compile(lambda *a: grads(kg.chunk_delta_rule, *a), fullgraph=True, backend=backend)(
                q, k, v, decay, beta, state
            )
    finally:
        torch._dynamo.config.trace_autograd_ops = before
    code = "".join(graphs)  # traced through the forward and backward ops, not the reference
    assert "ftitan_kernels.gdn_chunk_fwd" in code and "ftitan_kernels.gdn_chunk_bwd" in code
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_torch_func_transforms_step_aside_to_the_reference(monkeypatch):
    (q, k, v, decay, beta), state = _case(t=19, seed=7)
    spy = _Spy(monkeypatch)

    def out(fn, v, state):
        o, s = fn(q, k, v, decay, beta, state, chunk=CHUNK)
        return o.square().sum() + s.sum()

    tangent = torch.randn_like(v)
    with op.interpret():
        got_grad = torch.func.grad(lambda v: out(kg.chunk_delta_rule, v, state))(v)
        got_vmap = torch.func.vmap(lambda s: out(kg.chunk_delta_rule, v, s))(torch.stack([state, 2 * state]))
        got_jvp = torch.func.jvp(lambda v: out(kg.chunk_delta_rule, v, state), (v,), (tangent,))
    assert (spy.fwd, spy.bwd) == (0, 0)
    ref = kg.chunk_delta_rule_reference
    torch.testing.assert_close(got_grad, torch.func.grad(lambda v: out(ref, v, state))(v), **TOL)
    torch.testing.assert_close(got_vmap, torch.stack([out(ref, v, state), out(ref, v, 2 * state)]), **TOL)
    want_jvp = torch.func.jvp(lambda v: out(ref, v, state), (v,), (tangent,))
    for a, b in zip(got_jvp, want_jvp, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_nn_gdn_dispatches_on_kernels(monkeypatch):
    (q, k, v, decay, beta), state = _case(t=18, seed=8)
    spy = _Spy(monkeypatch)
    want = gdn.chunked_delta_rule(q, k, v, decay, beta, state, chunk=CHUNK)
    on_cpu = gdn.delta_rule(q, k, v, decay, beta, state, chunk=CHUNK, kernels="triton")  # no interpreter: reference
    assert spy.fwd == 0
    with op.interpret():
        got = gdn.delta_rule(q, k, v, decay, beta, state, chunk=CHUNK, kernels="triton")
        gdn.delta_rule(q, k, v, decay, beta, state, chunk=CHUNK)  # kernels="torch": the plain ops
    assert spy.fwd == 1
    for a, b, c in zip(got, on_cpu, want, strict=True):
        torch.testing.assert_close(a, c, **TOL)
        torch.testing.assert_close(b, c, rtol=0, atol=0)


def test_qwen3_next_with_triton_kernels_equals_torch(monkeypatch):
    cfg = qwen3_next.Config(
        vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=48, linear_k_heads=1,
        linear_v_heads=2, linear_k_dim=16, linear_v_dim=8, attention_every=2, max_seq_len=64, chunk=16,
    )  # fmt: skip
    params = qwen3_next.model(cfg).init(random.key(0))
    tokens = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(0))
    segments = torch.tensor([[0] * 11 + [1] * 12, [0] * 23])
    spy = _Spy(monkeypatch)
    want, _ = qwen3_next.model(cfg).apply(params, tokens, segments=segments)
    with op.interpret():
        got, _ = qwen3_next.model(attrs.evolve(cfg, kernels="triton")).apply(params, tokens, segments=segments)
    assert spy.fwd == 1  # one Gated DeltaNet layer
    torch.testing.assert_close(got, want, **TOL)


def test_qwen3_next_gradients_with_triton_kernels_equal_torch(monkeypatch):
    cfg = qwen3_next.Config(
        vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=48, linear_k_heads=1,
        linear_v_heads=2, linear_k_dim=16, linear_v_dim=8, max_seq_len=64, chunk=16,
    )  # fmt: skip
    params = qwen3_next.model(cfg).init(random.key(1))
    tokens = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(1))

    def grads(c):
        ps = tree.map(lambda x: x.detach().requires_grad_(), params)
        logits, _ = qwen3_next.model(c).apply(ps, tokens)
        return torch.autograd.grad(logits.square().mean(), tree.leaves(ps))

    want = grads(cfg)
    spy = _Spy(monkeypatch)
    with op.interpret():
        got = grads(attrs.evolve(cfg, kernels="triton"))
    assert (spy.fwd, spy.bwd) == (1, 1)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
