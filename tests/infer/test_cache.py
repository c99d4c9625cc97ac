"""KV cache, prefill and decode_step against the full forward, for every family.

Tolerance: 1e-5 absolute on float32 logits. The cached path runs the same
ops as the full forward, only the attention sees the keys through the cache
(masked, in slot order), so the logits differ by float32 summation order.
"""

import attrs
import pytest
import torch

import ftitan as ft
from ftitan import tree
from ftitan.infer import KVCache, init_cache, make_decode_step, make_prefill
from ftitan.models import deepseek_v3, llama, qwen3, qwen3_moe

ATOL = 1e-5

LLAMA = attrs.evolve(llama.Config.debug(), vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96)
QWEN3 = qwen3.Config(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
                     max_seq_len=128)  # fmt: skip
QWEN3_MOE = attrs.evolve(qwen3_moe.Config.debug(), vocab_size=96, n_layers=2)
DEEPSEEK = attrs.evolve(deepseek_v3.Config.debug(), vocab_size=96, n_layers=2)

MODELS = {
    "llama": llama.model(LLAMA),
    "llama_math": llama.model(attrs.evolve(LLAMA, attn_impl="math")),
    "qwen3": qwen3.model(QWEN3),
    "qwen3_moe": qwen3_moe.model(QWEN3_MOE),
    "deepseek_v3": deepseek_v3.model(DEEPSEEK),
}
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [11, 2], [70, 71, 72, 73]]


def params_of(model, seed=0):
    params = model.init(ft.random.key(seed))
    g = torch.Generator().manual_seed(seed)  # norms off 1 so a mix-up of scales shows
    return tree.map(lambda x: x + 0.1 * torch.randn(x.shape, generator=g) if x.dim() == 1 else x, params)


def padded(prompts, side):
    t = max(map(len, prompts))
    rows = [p + [0] * (t - len(p)) if side == "right" else [0] * (t - len(p)) + p for p in prompts]
    return torch.tensor(rows), torch.tensor([len(p) for p in prompts])


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_then_decode_logits_equal_the_full_forward(name, side):
    model, steps = MODELS[name], 5
    params = params_of(model)
    tokens, lengths = padded(PROMPTS, side)
    cache = init_cache(model, params, batch=len(PROMPTS), slots=tokens.shape[1] + steps)
    logits, cache = make_prefill(model)(params, tokens, cache, lengths=lengths, padding=side)
    seqs, got = [list(p) for p in PROMPTS], [[logits[i]] for i in range(len(PROMPTS))]
    decode_step = make_decode_step(model)
    for step in range(steps):
        nxt = torch.tensor([(7 * step + 13 * i) % 96 for i in range(len(PROMPTS))])  # any tokens: logits must match
        for i, s in enumerate(seqs):
            s.append(int(nxt[i]))
        logits, cache = decode_step(params, nxt, cache)
        for i in range(len(PROMPTS)):
            got[i].append(logits[i])
    for i, s in enumerate(seqs):  # each row alone, no padding, no cache
        full, _ = model.apply(params, torch.tensor([s]))
        want = full[0, len(PROMPTS[i]) - 1 :]
        torch.testing.assert_close(torch.stack(got[i]), want, rtol=0, atol=ATOL)


def test_cache_shapes_come_from_the_model():
    llama_cache = init_cache(MODELS["llama"], params_of(MODELS["llama"]), batch=2, slots=10)
    assert list(llama_cache.layers) == ["0", "1", "2"]
    assert llama_cache.layers["2"]["k"].shape == (2, 10, 2, 16) and llama_cache.layers["2"]["v"].shape == (2, 10, 2, 16)
    mla = init_cache(MODELS["deepseek_v3"], params_of(MODELS["deepseek_v3"]), batch=1, slots=4)
    m = DEEPSEEK.mla
    assert mla.layers["0"]["k"].shape == (1, 4, DEEPSEEK.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
    assert mla.layers["0"]["v"].shape == (1, 4, DEEPSEEK.n_heads, m.v_head_dim)
    bf16 = init_cache(MODELS["llama"], params_of(MODELS["llama"]), batch=1, slots=4, dtype=torch.bfloat16)
    assert bf16.layers["0"]["k"].dtype == torch.bfloat16 and bf16.start.dtype == torch.long


def test_steps_are_pure_and_the_cache_is_a_tree():
    model = MODELS["llama"]
    params = params_of(model)
    cache = init_cache(model, params, batch=1, slots=8)
    before = tree.map(torch.clone, cache)
    _, after = make_prefill(model)(params, torch.tensor([[1, 2, 3]]), cache)
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(cache), tree.leaves(before), strict=True))
    assert isinstance(after, KVCache) and after.end.tolist() == [3] and after.start.tolist() == [0]
    assert len(tree.leaves(after)) == 2 * 3 + 2  # k, v per layer; start, end


def test_decode_step_compiles_once_across_steps_and_batch_contents():
    model = MODELS["llama"]
    params = params_of(model)
    prefill = make_prefill(model)
    decode_step = torch.compile(make_decode_step(model), fullgraph=True, backend="aot_eager")
    eager_step = make_decode_step(model)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompts, side in (([[1, 2, 3], [4, 5, 6]], "right"), ([[7], [8, 9, 10]], "left"), ([[11, 12], [13]], "right")):
            tokens, lengths = padded(prompts, side)
            cache = init_cache(model, params, batch=2, slots=8)
            logits, cache = prefill(params, tokens, cache, lengths=lengths, padding=side)
            eager = cache
            for _ in range(4):
                nxt = logits.argmax(-1)
                logits, cache = decode_step(params, nxt, cache)
                want, eager = eager_step(params, nxt, eager)
                torch.testing.assert_close(logits, want, rtol=0, atol=ATOL)


def test_prefill_refuses_what_does_not_fit():
    model = MODELS["llama"]
    params = params_of(model)
    prefill = make_prefill(model)
    with pytest.raises(ValueError, match=r"slots>=5"):
        prefill(params, torch.zeros(1, 5, dtype=torch.long), init_cache(model, params, batch=1, slots=4))
    with pytest.raises(ValueError, match="lengths"):
        prefill(params, torch.zeros(2, 3, dtype=torch.long), init_cache(model, params, batch=2, slots=4),
                lengths=torch.tensor([3, 0]))  # fmt: skip
    with pytest.raises(ValueError, match="padding"):
        prefill(params, torch.zeros(1, 3, dtype=torch.long), init_cache(model, params, batch=1, slots=4), padding="up")
    with pytest.raises(ValueError, match="causal"):
        init_cache(model, params, batch=1, slots=4).attend(0, *[torch.zeros(1, 1, 2, 16)] * 3, causal=False)


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_fused_projections_compute_the_same_function(name):
    model = MODELS[name]
    params = params_of(model)
    fused = ft.infer.fuse_projections(params)
    tokens = torch.tensor(PROMPTS[0])[None]
    want, _ = model.apply(params, tokens)
    got, _ = model.apply(fused, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    paths = set(tree.paths(fused))
    if name == "deepseek_v3":  # MLA has no wq/wk/wv; its dense layers' SwiGLU fuses
        assert "layers.0.mlp.w13" in paths and not any(p.endswith("wqkv") for p in paths)
    else:
        assert "layers.0.attn.wqkv" in paths and "layers.0.attn.wq" not in paths
    if name == "qwen3_moe":  # 3-D experts stay as they are
        assert any(p.endswith("moe.experts.w1") for p in paths)
    assert ft.infer.fuse_projections(fused) == fused  # idempotent: nothing left to fuse
    for path, (into, lo, hi) in ft.infer.fused_slices(params).items():
        leaf = dict(zip(tree.paths(params), tree.leaves(params), strict=True))[path]
        assert torch.equal(dict(zip(tree.paths(fused), tree.leaves(fused), strict=True))[into][lo:hi], leaf)


def test_donated_steps_write_in_place_and_compute_the_pure_values_bitwise():
    model = MODELS["llama"]
    params = params_of(model)
    tokens, lengths = padded(PROMPTS, "left")
    pure = init_cache(model, params, batch=3, slots=tokens.shape[1] + 3)
    donated = tree.map(torch.clone, pure)
    want, pure = make_prefill(model)(params, tokens, pure, lengths=lengths, padding="left")
    got, out = make_prefill(model, donate=True)(params, tokens, donated, lengths=lengths, padding="left")
    assert torch.equal(got, want) and out.layers["1"]["k"] is donated.layers["1"]["k"]  # written in place
    step, donating = make_decode_step(model), torch.compile(make_decode_step(model, donate=True), backend="aot_eager")
    for token in ([1, 2, 3], [4, 5, 6]):
        want, pure = step(params, torch.tensor(token), pure)
        got, out = donating(params, torch.tensor(token), out)
        assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(out), tree.leaves(pure), strict=True))
