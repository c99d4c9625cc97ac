"""``attn_impl="gemm"``: causal query blocks as GEMMs (alone, windowed, over packed documents) agree with a
float64 reference, differentiate under autograd, ``torch.func`` and ``torch.compile``, and run SDPA wherever
they do not apply."""

import importlib

import attrs
import pytest
import torch

import ftitan as ft
from ftitan import nn
from ftitan import tree as T
from ftitan.models import llama

A = importlib.import_module("ftitan.nn.attention")  # the module (``ftitan.nn.attention`` is also the function)


def reference(q, k, v, *, window=None, segments=None):
    # float64, K/V repeated per query head (HF's repeat_kv), the mask written out: causal, within the
    # window (key j > query i - window), the same document
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(q.shape[2])[None, :]
    hidden = (j > i) | (j <= i - window if window is not None else torch.zeros_like(j > i))
    hidden = hidden[None].expand(q.shape[0], -1, -1)
    if segments is not None:
        hidden = hidden | (segments[:, :, None] != segments[:, None, :])
    scores = scores.masked_fill(hidden[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def packed(b, t, seed=0):
    # (B, T) document ids: each row cut at random places (documents across block boundaries, one-token
    # documents), ids not starting at 0 nor contiguous
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(b, t, generator=g) < 0.08).cumsum(1)
    return starts * 3 + 7


def qkv(b=2, t=130, h=4, kv=2, dh=16, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, t, h, dh, generator=g).to(dtype),
        torch.randn(b, t, kv, dh, generator=g).to(dtype),
        torch.randn(b, t, kv, dv or dh, generator=g).to(dtype),
    )


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls that ran the blocked GEMMs (not the SDPA fallback)."""
    calls = []
    real = A._gemm

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(A, "_gemm", counted)
    return calls


# T 130: two whole blocks of 64 and a partial one; T 5: one partial block; GQA 4/2, 4/1, MHA, Dv < Dh
@pytest.mark.parametrize("t,h,kv,dv", [(130, 4, 2, None), (130, 4, 1, 8), (64, 3, 3, None), (5, 6, 2, None)])
def test_matches_reference(spy, t, h, kv, dv):
    q, k, v = qkv(t=t, h=h, kv=kv, dv=dv)
    want = reference(q, k, v)
    torch.testing.assert_close(nn.attention(q, k, v, impl="gemm"), want.float(), rtol=0, atol=1e-5)
    q64, k64, v64 = (x.double() for x in (q, k, v))  # float64: the same function to rounding
    torch.testing.assert_close(nn.attention(q64, k64, v64, impl="gemm"), want, rtol=0, atol=1e-12)
    assert len(spy) == 2  # the GEMM path ran, not the SDPA fallback


@pytest.fixture(params=["blocks", "bands"])
def form(request, monkeypatch):
    """Each windowed case runs the causal blocks (keys before a block's window skipped) and, with the row
    cap lowered to 64 so that these rows pass it, the bands of :func:`_gemm_banded`."""
    if request.param == "bands":
        monkeypatch.setattr(A, "GEMM_MAX_SEQ", 64)
    return request.param


# windows inside one block, across block edges, five blocks of a 300-token row; documents; both (packed
# rows of a sliding-window model)
@pytest.mark.parametrize("t,window,docs", [(130, 1, False), (130, 5, False), (130, 64, False), (300, 20, False),
                                           (130, 20, True), (130, 60, True)])  # fmt: skip
def test_windows_match_reference(spy, form, t, window, docs):
    assert A._banded(t, window) == (form == "bands")
    check_reference(spy, t, window, packed(2, t) if docs else None)


# wider windows (a block's span of keys barely shorter than the row: never bands), documents alone
@pytest.mark.parametrize("window,docs", [(70, False), (130, False), (None, True)])
def test_wide_windows_and_documents_match_reference(spy, window, docs):
    assert not A._banded(130, window)
    check_reference(spy, 130, window, packed(2, 130) if docs else None)


def check_reference(spy, t, window, segments):
    q, k, v = qkv(t=t)
    want = reference(q, k, v, window=window, segments=segments)
    got = nn.attention(q, k, v, impl="gemm", window=window, segments=segments)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-5)
    q64, k64, v64 = (x.double() for x in (q, k, v))
    torch.testing.assert_close(nn.attention(q64, k64, v64, impl="gemm", window=window, segments=segments), want,
                               rtol=0, atol=1e-12)  # fmt: skip
    assert len(spy) == 2


def test_bfloat16_matches_math(spy):
    # both round the scores' GEMM to bf16 and softmax in float32
    q, k, v = qkv(dtype=torch.bfloat16)
    got = nn.attention(q, k, v, impl="gemm")
    assert got.dtype == torch.bfloat16 and len(spy) == 1
    torch.testing.assert_close(got.float(), nn.attention(q, k, v, impl="math").float(), rtol=0, atol=2e-2)


def test_gradients_match_reference_and_gradcheck(monkeypatch):
    q, k, v = qkv(t=130)
    w = torch.linspace(-1, 1, q.numel()).view_as(q)
    grads = {}
    for name, fn in (("gemm", lambda *x: nn.attention(*x, impl="gemm")), ("ref", reference)):
        xs = [x.double().clone().requires_grad_() if name == "ref" else x.clone().requires_grad_() for x in (q, k, v)]
        (fn(*xs) * w).sum().backward()
        grads[name] = [x.grad for x in xs]
    for a, b in zip(grads["gemm"], grads["ref"], strict=True):
        torch.testing.assert_close(a, b.float(), rtol=0, atol=2e-5)
    monkeypatch.setattr(A, "GEMM_BLOCK", 3)  # 4 blocks of a 10-token row, small enough for finite differences
    xs = [x.double().requires_grad_() for x in qkv(b=2, t=10, h=2, kv=1, dh=4)]
    assert torch.autograd.gradcheck(lambda *x: nn.attention(*x, impl="gemm"), xs)
    segments = torch.tensor([[0] * 4 + [1] * 6, [5] * 2 + [6] * 7 + [8]])
    attend = lambda *x: nn.attention(*x, impl="gemm", window=4, segments=segments)  # noqa: E731
    assert torch.autograd.gradcheck(attend, xs)  # the causal blocks, keys before the window skipped
    monkeypatch.setattr(A, "GEMM_MAX_SEQ", 4)
    assert A._banded(10, 4) and torch.autograd.gradcheck(attend, xs)  # bands: spans of 6 keys


@pytest.mark.parametrize("window", [None, 20])  # the causal blocks; bands (the row cap lowered to 64)
def test_functional_transforms_run_it_as_plain_ops(monkeypatch, spy, window):
    # grad, vmap and jvp see matmuls, pads, unfolds and a softmax: no fallback needed, the math form's values
    if window is not None:
        monkeypatch.setattr(A, "GEMM_MAX_SEQ", 64)
    q, k, v = (x.double() for x in qkv(t=100))
    assert A._banded(100, window) == (window is not None)
    f = lambda q: nn.attention(q, k, v, impl="gemm", window=window)  # noqa: E731
    m = lambda q: nn.attention(q, k, v, impl="math", window=window)  # noqa: E731
    torch.testing.assert_close(torch.func.grad(lambda q: f(q).pow(2).sum())(q),
                               torch.func.grad(lambda q: m(q).pow(2).sum())(q), rtol=0, atol=1e-12)  # fmt: skip
    tangent = torch.randn_like(q)
    torch.testing.assert_close(torch.func.jvp(f, (q,), (tangent,))[1], torch.func.jvp(m, (q,), (tangent,))[1],
                               rtol=0, atol=1e-12)  # fmt: skip
    rows = torch.func.vmap(lambda q, k, v: nn.attention(q[None], k[None], v[None], impl="gemm", window=window)[0])(
        q, k, v)
    torch.testing.assert_close(rows, m(q), rtol=0, atol=1e-12)
    assert len(spy) == 3  # once under each transform: none fell back


@pytest.mark.parametrize("kw,cap", [({}, 1024), ({"segments": packed(2, 130), "window": 40}, 1024),
                                    ({"segments": packed(2, 130), "window": 40}, 64)],
                         ids=["causal", "blocks-window-documents", "bands-window-documents"])  # fmt: skip
def test_compiled_fullgraph_forward_and_backward(monkeypatch, spy, kw, cap):
    monkeypatch.setattr(A, "GEMM_MAX_SEQ", cap)
    q, k, v = qkv(t=130)  # segments: a graph input

    def loss(q, k, v, kw):
        return nn.attention(q, k, v, impl="gemm", **kw).sin().sum()

    eager = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v, kw)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.compile(loss, fullgraph=True)(*xs, kw).backward()
    for a, b in zip(eager, (x.grad for x in xs), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert len(spy) == 2  # eager and traced


def test_dynamic_lengths_under_compile_run_sdpa(spy):
    # a graph with symbolic lengths cannot loop over their blocks without specializing: it runs SDPA, one
    # graph for every length (no recompile); static lengths run the blocks
    dynamic = torch.compile(lambda q, k, v: nn.attention(q, k, v, impl="gemm"), dynamic=True, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in (70, 130):
            q, k, v = qkv(t=t)
            torch.testing.assert_close(dynamic(q, k, v), reference(q, k, v).float(), rtol=0, atol=1e-5)
    assert spy == []
    static = torch.compile(lambda q, k, v: nn.attention(q, k, v, impl="gemm"), dynamic=False, fullgraph=True)
    q, k, v = qkv(t=70)
    torch.testing.assert_close(static(q, k, v), reference(q, k, v).float(), rtol=0, atol=1e-5)
    assert len(spy) >= 1


def test_sdpa_runs_where_it_does_not_apply(spy):
    # a prefix-LM (not a refinement of causal), a mask, fewer queries than keys (a KV cache), rows past
    # GEMM_MAX_SEQ, too many saved bytes: the outputs are SDPA's, bit for bit, and the GEMM path never ran
    q, k, v = qkv(t=12)
    for prefix in (3, torch.tensor([2, 5])):
        assert torch.equal(nn.attention(q, k, v, impl="gemm", prefix=prefix),
                           nn.attention(q, k, v, impl="sdpa", prefix=prefix))  # fmt: skip
    mask = torch.rand(12, 12, generator=torch.Generator().manual_seed(1)) < 0.7
    mask |= torch.eye(12, dtype=torch.bool)
    assert torch.equal(nn.attention(q, k, v, impl="gemm", causal=False, mask=mask),
                       nn.attention(q, k, v, impl="sdpa", causal=False, mask=mask))  # fmt: skip
    assert torch.equal(nn.attention(q[:, -3:], k, v, impl="gemm"), nn.attention(q[:, -3:], k, v, impl="sdpa"))
    assert not A.gemm_applies(*qkv(b=1, t=A.GEMM_MAX_SEQ + 1, h=1, kv=1, dh=1)[:2])
    assert A.gemm_applies(*qkv(b=1, t=A.GEMM_MAX_SEQ, h=1, kv=1, dh=1)[:2])
    wide = torch.empty(64, A.GEMM_MAX_SEQ, 32, 8)  # 64 rows of 32 heads at 1024: 1.1 GiB of probabilities
    assert not A.gemm_applies(wide, wide[:, :, :8])
    assert not A.gemm_applies(*(x.to(torch.int64) for x in qkv(t=4)[:2]))
    assert spy == []


def test_windowed_rows_past_the_cap_run_banded(spy):
    # a window narrower than the row bands it: rows past GEMM_MAX_SEQ run the bands (the causal rule alone
    # runs SDPA there), their graph the same size at every length
    t = A.GEMM_MAX_SEQ + 70
    q, k, v = qkv(b=1, t=t, h=2, kv=1, dh=4)
    assert A.gemm_applies(q, k, window=8) and not A.gemm_applies(q, k)
    segments = packed(1, t)
    got = nn.attention(q, k, v, impl="gemm", window=8, segments=segments)
    torch.testing.assert_close(got, reference(q, k, v, window=8, segments=segments).float(), rtol=0, atol=1e-5)
    assert len(spy) == 1
    wide = torch.empty(64, 4 * A.GEMM_MAX_SEQ, 32, 8)  # its probabilities past GEMM_MAX_SAVED: SDPA
    assert not A.gemm_applies(wide, wide[:, :, :8], window=512)


def test_auto_runs_it_on_the_cpu(spy):
    q, k, v = qkv(t=70)
    assert torch.equal(nn.attention(q, k, v, impl="auto"), nn.attention(q, k, v, impl="gemm"))
    assert len(spy) == 2


@pytest.mark.parametrize("packed_rows", [False, True])
def test_llama_step_with_gemm_attention(monkeypatch, spy, packed_rows):
    # a model config transform: logits and gradients of the SDPA model's to float32 rounding, and the train
    # step's torch.func and autograd paths give identical gradients (plain ops on both); packed rows (the
    # post-training packer's segments and positions) run the blocks too
    monkeypatch.setattr(A, "GEMM_BLOCK", 4)  # 12 tokens in 3 blocks
    base = attrs.evolve(llama.Config.debug(), vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_dim=48, max_seq_len=16)  # fmt: skip
    gemm, sdpa = (llama.model(ft.config.with_attn_impl(impl)(base)) for impl in ("gemm", "sdpa"))
    assert gemm.config.attn_impl == "gemm"
    params = gemm.init(ft.random.key(0))
    tokens = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if packed_rows:
        segments = torch.tensor([[0] * 5 + [1] * 7, [0] * 12, [2] * 3 + [3] * 2 + [4] * 7])
        batch |= {"segments": segments, "positions": nn.document_positions(segments)}
    packed = {k: batch[k] for k in ("segments", "positions") if k in batch}
    torch.testing.assert_close(gemm.apply(params, batch["inputs"], **packed),
                               sdpa.apply(params, batch["inputs"], **packed), rtol=0, atol=1e-5)  # fmt: skip
    g_func, (l_func, _) = ft.train.value_and_grad(ft.train.next_token_loss(gemm), impl="func")(params, batch)
    g_auto, (l_auto, _) = ft.train.value_and_grad(ft.train.next_token_loss(gemm), impl="autograd")(params, batch)
    g_sdpa, _ = ft.train.value_and_grad(ft.train.next_token_loss(sdpa), impl="autograd")(params, batch)
    assert torch.equal(l_func, l_auto)
    for path, a, b, c in zip(T.paths(g_func), T.leaves(g_func), T.leaves(g_auto), T.leaves(g_sdpa), strict=True):
        assert torch.equal(a, b), path
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6, msg=path)
    assert len(spy) == 2 * 3  # two layers in the forward and in both of the gemm model's steps


def test_sliding_window_model_runs_the_blocks(spy):
    # Muse Glimmer: sliding layers (window 64) and a global one, T 150 over three blocks: logits and
    # gradients of the SDPA model's
    from ftitan.models import muse_glimmer

    base = attrs.evolve(muse_glimmer.Config.debug(), vocab_size=96, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                        ffn_dim=96)  # fmt: skip
    gemm, sdpa = (muse_glimmer.model(ft.config.with_attn_impl(impl)(base)) for impl in ("gemm", "sdpa"))
    params = gemm.init(ft.random.key(0))
    tokens = torch.randint(0, 96, (2, 151), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    torch.testing.assert_close(gemm.apply(params, batch["inputs"]), sdpa.apply(params, batch["inputs"]),
                               rtol=0, atol=1e-5)  # fmt: skip
    assert len(spy) == base.n_layers  # the sliding layers and the global one
    g_gemm, _ = ft.train.value_and_grad(ft.train.next_token_loss(gemm), impl="autograd")(params, batch)
    g_sdpa, _ = ft.train.value_and_grad(ft.train.next_token_loss(sdpa), impl="autograd")(params, batch)
    for path, a, b in zip(T.paths(g_gemm), T.leaves(g_gemm), T.leaves(g_sdpa), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=path)
