"""``attn_impl="flex"``: FlexAttention's mask functions give the masks of SDPA and the math form.

FlexAttention runs forward only on CPU (no input requiring grad), so its parity is checked under
``torch.no_grad``, eager and compiled (``fullgraph=True``); with gradients it runs SDPA with the same
mask, whose gradients must equal SDPA's exactly. fp32 tolerance for flex vs sdpa/math: 2e-6
absolute and relative on O(1) outputs: FlexAttention's softmax is computed blockwise (online
rescaling over 128-key tiles, measured differences <= 1e-6), the others over the whole row.
"""

import attrs
import pytest
import torch

from ftitan import nn, random
from ftitan.models import llama, muse_glimmer
from ftitan.nn import flex
from ftitan.nn.attention import causal_mask, document_mask, window_mask

TOL = {"atol": 2e-6, "rtol": 2e-6}
SEGMENTS_150 = [0] * 40 + [1] * 90 + [2] * 20  # three documents, one across the 128-token block boundary


def qkv(b=2, t=150, s=150, h=4, kv=2, dh=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, heads, dh, generator=g) for n, heads in ((t, h), (s, kv), (s, kv)))


def explicit_mask(b, t, s, seed=1):
    # a random (B, T, S) mask whose every query sees at least its own diagonal key
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, t, s, generator=g) < 0.3
    return m | (torch.arange(s)[None, None, :] == torch.arange(t)[None, :, None] + (s - t))


def kinds(b, t, s):
    """Every mask kind as nn.attention keywords, for B rows of T queries over S keys."""
    out = {
        "causal": {},
        "full": {"causal": False},
        "window": {"window": 17},
        "prefix": {"prefix": 33},
        "prefix_rows": {"prefix": torch.tensor([5, 140, 0, 70][:b])},
        "mask": {"causal": False, "mask": explicit_mask(b, t, s)},
        "mask_window": {"causal": False, "mask": explicit_mask(b, t, s), "window": 40},
    }
    if t == s:  # packed rows: every query in its own row's document
        seg = torch.tensor([SEGMENTS_150[:t], [7] * (t // 2) + [8] * (t - t // 2)][:b])
        out["document"] = {"segments": seg}
        out["document_window"] = {"segments": seg, "window": 9}
    return out


SHAPES = [(2, 150, 150, 4, 2), (2, 3, 150, 4, 1), (1, 37, 37, 2, 2)]  # odd lengths, decode (T < S), MHA


@pytest.mark.parametrize("b,t,s,h,kv", SHAPES)
def test_flex_forward_equals_sdpa_and_math_for_every_mask(b, t, s, h, kv):
    q, k, v = qkv(b, t, s, h, kv)
    for name, kw in kinds(b, t, s).items():
        with torch.no_grad():
            got = nn.attention(q, k, v, impl="flex", **kw)
            for impl in ("sdpa", "math"):
                torch.testing.assert_close(got, nn.attention(q, k, v, impl=impl, **kw), **TOL, msg=f"{name} {impl}")


def test_mask_functions_are_the_helpers_masks():
    b, t, s = 2, 150, 150
    seg = torch.tensor([SEGMENTS_150, [3] * 150])
    for tt in (150, 5):
        got = flex.dense(flex.mask_of(b, tt, s, causal=True))
        assert torch.equal(got, causal_mask(tt, s))
        got = flex.dense(flex.mask_of(b, tt, s, causal=True, window=12))
        assert torch.equal(got, causal_mask(tt, s) & window_mask(tt, s, 12))
    assert torch.equal(flex.dense(flex.mask_of(b, t, s, causal=True, segments=seg)), document_mask(seg))
    m = explicit_mask(b, 4, s)
    assert torch.equal(flex.dense(flex.mask_of(b, 4, s, causal=False, mask=m)), m)
    assert flex.dense(flex.mask_of(b, t, s, causal=False)) is None  # nothing masked: no block mask either


def prefix_lm_by_hand(prefix, t, s):
    # the definition, one (row, query, key) at a time: prefix keys are seen by every query of the row,
    # later keys by the queries at or after them (query i sits at key position i + s - t)
    out = torch.zeros(len(prefix), t, s, dtype=torch.bool)
    for r, p in enumerate(prefix):
        for i in range(t):
            for j in range(s):
                out[r, i, j] = j < p or j <= i + s - t
    return out


@pytest.mark.parametrize("t", [20, 6])
def test_prefix_lm_mask_equals_one_built_by_hand(t):
    prefix, s = [0, 7, 20], 20
    want = prefix_lm_by_hand(prefix, t, s)
    assert torch.equal(flex.dense(flex.mask_of(3, t, s, causal=True, prefix=torch.tensor(prefix))), want)
    q, k, v = qkv(3, t, s, 4, 2)
    with torch.no_grad():
        expected = nn.attention(q, k, v, impl="math", causal=False, mask=want)
        for impl in ("flex", "sdpa", "math"):
            torch.testing.assert_close(nn.attention(q, k, v, impl=impl, prefix=torch.tensor(prefix)), expected, **TOL)
    if t == s:  # a prefix query sees a later prefix key (bidirectional), a query after it no later key
        assert want[1, 0, 6] and not want[1, 7, 8]


def test_static_block_masks_are_built_once_per_shape_and_tensor_masks_per_call():
    q, k, v = qkv(2, 150, 150, 4, 2)
    flex.clear_block_mask_cache()
    with torch.no_grad():
        first = nn.attention(q, k, v, impl="flex", window=17)
        assert flex.block_mask_cache_info() == {"hits": 0, "builds": 1, "size": 1}
        again = nn.attention(q, k, v, impl="flex", window=17)
        assert flex.block_mask_cache_info() == {"hits": 1, "builds": 1, "size": 1}  # reused, not rebuilt
        nn.attention(q, k, v, impl="flex", window=18)  # another window: another entry
        nn.attention(q[:, :5], k, v, impl="flex")  # another kind and T: another entry
        nn.attention(q, k, v, impl="flex", segments=torch.zeros(2, 150, dtype=torch.long))  # per batch
        nn.attention(q, k, v, impl="flex", prefix=torch.tensor([3, 4]))  # per batch
    assert flex.block_mask_cache_info() == {"hits": 1, "builds": 3, "size": 3}
    assert torch.equal(first, again)
    m = flex.mask_of(2, 150, 150, causal=True, window=17)
    assert flex.block_mask(m, device=q.device) is flex.block_mask(m, device=q.device)


@pytest.mark.parametrize("name", ["causal", "window", "prefix_rows", "mask", "document_window"])
def test_flex_compiles_fullgraph(name):
    # aot_eager: dynamo traces the dispatch, the block-mask build and the flex HOP in one graph
    b, t, s, h, kv = 2, 150, 150, 4, 2
    q, k, v = qkv(b, t, s, h, kv)
    kw = kinds(b, t, s)[name]
    fn = torch.compile(lambda q, k, v, kw: nn.attention(q, k, v, impl="flex", **kw), fullgraph=True,
                       backend="aot_eager")  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(fn(q, k, v, kw), nn.attention(q, k, v, impl="sdpa", **kw), **TOL)


@pytest.mark.slow  # an inductor compile: ~20 s cold
def test_flex_compiles_with_inductor_on_cpu():
    # inductor's CPU FlexAttention kernel: GQA, odd length, packed documents AND a window
    b, t, s, h, kv = 2, 150, 150, 4, 2
    q, k, v = qkv(b, t, s, h, kv)
    kw = kinds(b, t, s)["document_window"]
    fn = torch.compile(lambda q, k, v, seg: nn.attention(q, k, v, impl="flex", segments=seg, window=9), fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(fn(q, k, v, kw["segments"]), nn.attention(q, k, v, impl="math", **kw), **TOL)


def grads(impl, kw, q, k, v, *, func):
    def loss(q, k, v):
        return (nn.attention(q, k, v, impl=impl, **kw) * torch.linspace(-1, 1, q.shape[-1])).sum()

    if func:
        return torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(loss(*leaves), leaves)


@pytest.mark.parametrize("func", [False, True], ids=["autograd", "torch.func"])
def test_grad_fallback_gives_sdpas_gradients(func):
    # with inputs requiring grad on CPU (autograd) or under torch.func.grad, flex runs SDPA with the same
    # mask: the same kernel on the same mask, so the gradients are equal bit for bit
    b, t, s, h, kv = 2, 150, 150, 4, 2
    q, k, v = qkv(b, t, s, h, kv)
    for name, kw in kinds(b, t, s).items():
        for got, want in zip(grads("flex", kw, q, k, v, func=func), grads("sdpa", kw, q, k, v, func=func),
                             strict=True):  # fmt: skip
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_fallback_under_jvp_vmap_and_compiled_grad():
    q, k, v = qkv(2, 40, 40, 4, 2)
    kw = {"window": 7, "prefix": 5}
    tangent = torch.randn_like(q)

    def f(impl):
        return lambda q: nn.attention(q, k, v, impl=impl, **kw)

    for got, want in zip(torch.func.jvp(f("flex"), (q,), (tangent,)), torch.func.jvp(f("sdpa"), (q,), (tangent,)),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    qs = torch.stack([q, 2 * q])  # two query sets over the same keys
    torch.testing.assert_close(torch.func.vmap(f("flex"))(qs), torch.func.vmap(f("sdpa"))(qs), rtol=0, atol=0)
    # compiled: the choice is a constant of the trace (a flex call with grad would raise on CPU)
    compiled = torch.compile(lambda q, k, v: grads("flex", kw, q, k, v, func=True), fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(q, k, v), grads("sdpa", kw, q, k, v, func=True), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the compiled graph may fuse differently


def test_auto_is_gemm_on_cpu_and_runs_checks():
    q, k, v = qkv(2, 30, 30, 4, 2)
    auto = nn.attention(q, k, v, impl="auto", window=5)
    assert torch.equal(auto, nn.attention(q, k, v, impl="gemm", window=5))
    torch.testing.assert_close(auto, nn.attention(q, k, v, impl="sdpa", window=5), rtol=0, atol=1e-5)
    assert flex.runs(q, k, v)  # no grad needed here
    assert not flex.runs(q.requires_grad_(), k, v)
    with torch.no_grad():
        assert flex.runs(q, k, v)


def test_errors_name_the_problem():
    q, k, v = qkv(2, 10, 10, 4, 2)
    with pytest.raises(ValueError, match="pass causal=True"):
        nn.attention(q, k, v, impl="flex", causal=False, segments=torch.zeros(2, 10, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must be \(B, T\) = \(2, 10\)"):
        nn.attention(q, k, v, impl="flex", segments=torch.zeros(2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must be \(B,\) = \(2,\) int lengths"):
        nn.attention(q, k, v, impl="flex", prefix=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="int >= 0"):
        nn.attention(q, k, v, impl="flex", prefix=-1)
    with pytest.raises(ValueError, match="expected one of"):
        llama.Config.debug().__class__(**{**attrs.asdict(llama.Config.debug(), recurse=False), "attn_impl": "flash"})


def small(cls_cfg, **kw):
    return attrs.evolve(cls_cfg, vocab_size=256, dim=64, ffn_dim=128, **kw)


MODELS = {
    # 4 layers: 3 sliding (window 64 < T) and 1 global NoPE layer
    "muse_glimmer": (muse_glimmer, small(muse_glimmer.Config.debug(), head_dim=16)),
    "llama": (llama, small(llama.Config.debug(), n_layers=2)),
}


@pytest.mark.parametrize("family", list(MODELS))
def test_model_with_flex_matches_sdpa_logits_and_loss_gradients(family):
    module, cfg = MODELS[family]
    params = module.model(cfg).init(random.key(0))
    tokens = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    flex_model, sdpa_model = (module.model(attrs.evolve(cfg, attn_impl=impl)) for impl in ("flex", "sdpa"))
    with torch.no_grad():  # flex itself runs (forward only on CPU)
        got, _ = flex_model.apply(params, tokens)
        want, _ = sdpa_model.apply(params, tokens)
    # logits are O(1); the attention difference (<= 1e-6) passes through a few layers
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)

    def loss(model):
        def fn(p):
            logits, _ = model.apply(p, tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

        return torch.func.grad_and_value(fn)(params)

    (g_flex, l_flex), (g_sdpa, l_sdpa) = loss(flex_model), loss(sdpa_model)
    assert torch.equal(l_flex, l_sdpa)  # the fallback is SDPA with the same mask: the same computation
    torch.testing.assert_close(g_flex, g_sdpa, rtol=0, atol=0)


def test_packed_rows_with_flex_equal_each_document_alone():
    # Muse Glimmer: sliding layers (window 64) and a global NoPE layer over three packed documents
    module, cfg = MODELS["muse_glimmer"]
    model = module.model(attrs.evolve(cfg, attn_impl="flex"))
    params = model.init(random.key(1))
    lengths = (40, 90, 20)
    docs = [torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    segments = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    with torch.no_grad():
        packed, _ = model.apply(params, torch.cat(docs, dim=1), segments=segments)
        alone = torch.cat([model.apply(params, d)[0] for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=2e-5)


def test_kv_cache_prefill_and_decode_with_flex_equal_the_full_forward():
    # the cache hands nn.attention an explicit (B, T, S) mask of ragged rows and windows: flex takes it as a
    # mask function (block mask per call); Muse Glimmer's sliding layers (window 64) see a window over slots
    from ftitan.infer import init_cache, make_decode_step, make_prefill

    module, cfg = MODELS["muse_glimmer"]
    model = module.model(attrs.evolve(cfg, attn_impl="flex", window=8))
    params = model.init(random.key(2))
    prompts = [[5, 17, 3, 88, 41, 9, 60, 7, 1, 2, 3], [11, 2]]
    tokens = torch.tensor([[0] * (11 - len(p)) + p for p in prompts])  # left-padded
    steps = 4
    with torch.no_grad():
        cache = init_cache(model, params, batch=2, slots=11 + steps)
        logits, cache = make_prefill(model)(params, tokens, cache, lengths=torch.tensor([11, 2]), padding="left")
        got, seqs = [[logits[i]] for i in range(2)], [list(p) for p in prompts]
        decode_step = make_decode_step(model)
        for step in range(steps):
            nxt = torch.tensor([(7 * step + 13 * i) % cfg.vocab_size for i in range(2)])
            for i, s in enumerate(seqs):
                s.append(int(nxt[i]))
            logits, cache = decode_step(params, nxt, cache)
            for i in range(2):
                got[i].append(logits[i])
        for i, s in enumerate(seqs):  # each row alone, no padding, no cache
            full, _ = model.apply(params, torch.tensor([s]))
            torch.testing.assert_close(torch.stack(got[i]), full[0, len(prompts[i]) - 1 :], atol=2e-5, rtol=2e-5)


def _families_with_attn_impl():
    from ftitan.models import hf

    heavy = {"deepseek_v3", "qwen3_next", "qwen3_moe"}  # ~10 s each here: MoE / linear-attention debug models
    return [pytest.param(f, id=f.name, marks=[pytest.mark.slow] if f.name in heavy else [])
            for f in hf.families() if "attn_impl" in attrs.fields_dict(f.config_type)]  # fmt: skip


@pytest.mark.parametrize("family", _families_with_attn_impl())
def test_every_family_with_attn_impl_runs_flex(family):
    # each family's debug model (MLA's narrower values, Qwen3-Next's gated attention among linear layers, MoE)
    # accepts attn_impl="flex" and "auto" and gives sdpa's logits (no_grad: FlexAttention itself runs)
    cfg = family.config_type.debug()
    params = family.model(cfg).init(random.key(0))
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, _ = family.model(attrs.evolve(cfg, attn_impl="sdpa")).apply(params, tokens)
        for impl in ("flex", "auto"):
            got, _ = family.model(attrs.evolve(cfg, attn_impl=impl)).apply(params, tokens)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=impl)
