"""Qwen3-Next / Qwen3.5 (dense, MoE): Gated DeltaNet forms, HF parity, checkpoints, sizes, cache generation.

Parity tolerance: max abs logit difference <= 1e-5 in float32 (measured ~2e-7), as for the other
families; the routers of the MoE configs are scaled up (std ~0.5) so that no top-k choice is near a
tie that float32 rounding could flip. The chunked and recurrent delta rules differ by summation
order only: <= 1e-5 over 1..300 tokens. transformers' Gated DeltaNet classes run their own pure-torch
fallback here (``fla`` is not installed, see FACTS.md: with it and triton both present they fail on CPU).
"""

import json

import attrs
import pytest
import torch
import transformers

import ftitan as ft
from ftitan import random, tree
from ftitan.infer import init_cache
from ftitan.infer.step import make_decode_step, make_prefill
from ftitan.models import hf, qwen3_5, qwen3_next
from ftitan.nn import gdn

ATOL = 1e-5
HF_CLASSES = {"qwen3_next": transformers.Qwen3NextForCausalLM, "qwen3_5_text": transformers.Qwen3_5ForCausalLM,
              "qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM}  # fmt: skip


def tiny(variant="qwen3_next", moe=True, **kw):
    experts = dict(n_experts=8, top_k=2, expert_dim=32, shared_expert_dim=48) if moe else {}
    return qwen3_next.Config(
        vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96, linear_k_heads=2,
        linear_v_heads=4, linear_k_dim=16, linear_v_dim=8, variant=variant, max_seq_len=512, chunk=16, **experts, **kw,
    )  # fmt: skip


CONFIGS = {
    "next_moe": tiny("qwen3_next"),
    "next_dense1": tiny("qwen3_next", dense_layers=(1,), attention_every=2),  # mlp_only_layers, attention 1 and 3
    "qwen3_5_dense_tied": tiny("qwen3_5", moe=False, tie_embeddings=True, partial_rotary=0.5),
    "qwen3_5_moe": tiny("qwen3_5"),
}


def random_params(cfg, seed=0):
    """Init params with nonzero norm scales (zero-centered norms start at 0) and decisive routers."""
    params = qwen3_next.model(cfg).init(random.key(seed))
    g = torch.Generator().manual_seed(seed)

    def perturb(path, x):
        if x.dim() == 1 and not path.endswith(("A_log", "dt_bias")):
            return x + 0.2 * torch.randn(x.shape, generator=g)
        if path.endswith("router"):
            return 25 * x
        return x

    return tree.map_with_path(perturb, params)


def hf_model(cfg, params):
    d = hf.config_to_hf(cfg)
    hm = HF_CLASSES[d["model_type"]]._from_config(transformers.AutoConfig.for_model(**d), attn_implementation="eager")
    hm.load_state_dict(hf.to_hf(params, cfg, layout="module"), strict=True)
    return hm.eval()


# ------------------------------------------------------------------ the delta rule and the conv


def test_chunked_equals_recurrent_over_1_to_300_tokens():
    g = torch.Generator().manual_seed(0)
    b, hk, hv, dk, dv = 2, 2, 4, 16, 8
    full = [torch.randn(b, 300, h, d, generator=g) for h, d in ((hk, dk), (hk, dk), (hv, dv))]
    decay, beta = -2 * torch.rand(b, 300, hv, generator=g), torch.rand(b, 300, hv, generator=g)
    state0 = torch.randn(b, hv, dk, dv, generator=g)
    worst = 0.0
    for t in (1, 2, 15, 16, 17, 63, 64, 65, 129, 300):
        q, k, v = (x[:, :t] for x in full)
        ref, ref_s = gdn.recurrent_delta_rule(q, k, v, decay[:, :t], beta[:, :t], state0)
        got, got_s = gdn.chunked_delta_rule(q, k, v, decay[:, :t], beta[:, :t], state0, chunk=16)
        worst = max(worst, float((got - ref).abs().max()), float((got_s - ref_s).abs().max()))
    assert worst <= ATOL, worst
    # transformers' own chunked fallback (q/k heads repeated to the value heads there) agrees too
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v = full
    hf_o, hf_s = torch_chunk_gated_delta_rule(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g=decay,
                                              beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = gdn.chunked_delta_rule(q, k, v, decay, beta)
    assert float((o - hf_o).abs().max()) <= ATOL and float((s - hf_s).abs().max()) <= ATOL


def test_padding_tokens_leave_the_state_and_the_conv_state_unchanged():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 9, 1, 4, generator=g), torch.randn(1, 9, 1, 4, generator=g)
    v = torch.randn(1, 9, 1, 3, generator=g)
    decay, beta = -torch.rand(1, 9, 1, generator=g), torch.rand(1, 9, 1, generator=g)
    keep = torch.ones(1, 9, 1)
    keep[:, 5:] = 0  # the last 4 tokens are padding: no decay, no write
    _, s_pad = gdn.chunked_delta_rule(q, k, v, decay * keep, beta * keep, chunk=4)
    _, s_real = gdn.chunked_delta_rule(q[:, :5], k[:, :5], v[:, :5], decay[:, :5], beta[:, :5], chunk=4)
    torch.testing.assert_close(s_pad, s_real, rtol=0, atol=1e-6)
    x, w = torch.randn(2, 6, 5, generator=g), torch.randn(5, 4, generator=g)
    _, state = gdn.causal_conv(x, w, stop=torch.tensor([6, 2]))
    assert torch.equal(state[0], x[0, 3:]) and torch.equal(state[1, 1:], x[1, :2]) and not state[1, 0].any()


# ------------------------------------------------------------------ HF parity and checkpoints


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_and_module_state_round_trips(name):
    cfg = CONFIGS[name]
    params = random_params(cfg)
    hm = hf_model(cfg, params)
    tokens = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hm(tokens).logits
    got, _ = qwen3_next.model(cfg).apply(params, tokens)
    assert float((got - ref).abs().max()) <= ATOL
    back = hf.from_hf(hm.state_dict(), cfg)  # transformers 5's live layout: fused experts
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(back), tree.leaves(params), strict=True))


def test_checkpoints_on_disk_both_directions(tmp_path):
    cfg = CONFIGS["qwen3_5_moe"]
    params = random_params(cfg, seed=4)
    hf.save_hf(params, cfg, tmp_path / "ft")  # ftitan -> hub files -> transformers
    hm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ft", attn_implementation="eager").eval()
    assert type(hm) is transformers.Qwen3_5MoeForCausalLM
    tokens = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(5))
    want, _ = qwen3_next.model(cfg).apply(params, tokens)
    with torch.no_grad():
        assert float((hm(tokens).logits - want).abs().max()) <= ATOL
    hm.save_pretrained(tmp_path / "hf")  # transformers -> hub files -> ftitan
    cfg2, params2 = hf.load_hf(tmp_path / "hf")
    assert attrs.evolve(cfg2, chunk=cfg.chunk) == cfg  # the chunk size is ftitan's own (not in HF configs)
    _, streamed = hf.load_hf_sharded(tmp_path / "hf")  # leaf by leaf (fused experts, permuted conv rows)
    for got in (params2, streamed):
        assert all(torch.equal(a, b) for a, b in zip(tree.leaves(got), tree.leaves(params), strict=True))


def test_multimodal_checkpoint_imports_its_text_decoder(tmp_path):
    text = CONFIGS["qwen3_5_dense_tied"]
    params = random_params(text, seed=6)
    d = {k: v for k, v in hf.config_to_hf(text).items() if k not in ("architectures", "model_type")}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=1, num_position_embeddings=16)  # fmt: skip
    mm_cfg = transformers.Qwen3_5Config(text_config=d, vision_config=vision, tie_word_embeddings=True)
    mm = transformers.Qwen3_5ForConditionalGeneration._from_config(mm_cfg, attn_implementation="eager").eval()
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in hf.to_hf(params, text).items()}  # fmt: skip
    missing, unexpected = mm.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") or k == "lm_head.weight" for k in missing)  # tied
    mm.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5"
    cfg, got = hf.load_hf(tmp_path)  # the vision tower's tensors are skipped
    assert attrs.evolve(cfg, chunk=text.chunk) == text
    _, streamed = hf.load_hf_sharded(tmp_path)
    for x in (got, streamed):
        assert all(torch.equal(a, b) for a, b in zip(tree.leaves(x), tree.leaves(params), strict=True))


# published configs (text_config of the hub's Qwen/Qwen3.5-* config.json; Qwen3-Next-80B-A3B's config.json)
# and their parameter counts as transformers' own models built on meta count them
PUBLISHED = {
    "qwen3_5_0_8b": 752_393_024, "qwen3_5_2b": 1_881_825_088, "qwen3_5_4b": 4_205_751_296,
    "qwen3_5_9b": 8_953_803_264, "qwen3_5_27b": 26_895_998_464, "qwen3_5_35b_a3b": 34_660_610_688,
    "qwen3_5_122b_a10b": 122_111_526_912, "qwen3_5_397b_a17b": 396_346_350_336, "qwen3_next_80b_a3b": 79_674_391_296,
}  # fmt: skip


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_flavors_match_transformers_on_meta(flavor):
    cfg = qwen3_next.FLAVORS[flavor]() if flavor in qwen3_next.FLAVORS else qwen3_5.FLAVORS[flavor]()
    d = hf.config_to_hf(cfg)
    assert hf.config_from_hf(d) == cfg
    with torch.device("meta"):
        hm = HF_CLASSES[d["model_type"]](transformers.AutoConfig.for_model(**d))
    params = qwen3_next.model(cfg).init(random.key(0), dtype=torch.bfloat16, device="meta")
    assert tree.size(params) == sum(p.numel() for p in hm.parameters()) == PUBLISHED[flavor]
    # active: every weight but the unchosen experts, counted on HF's own modules
    inactive = sum(p.numel() for n, p in hm.named_parameters() if ".experts." in n) * (
        1 - cfg.top_k / max(cfg.n_experts, 1))  # fmt: skip
    assert qwen3_next.active_params(cfg) == PUBLISHED[flavor] - inactive


# ------------------------------------------------------------------ generation with the hybrid cache


@pytest.mark.parametrize("padding", ["left", "right"])
def test_prefill_and_decode_equal_the_full_forward(padding):
    cfg = CONFIGS["next_moe"]
    m = qwen3_next.model(cfg)
    params = random_params(cfg, seed=7)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (37, 20, 5)]
    t = max(len(p) for p in prompts)
    tokens = torch.zeros(3, t, dtype=torch.long)
    for b, p in enumerate(prompts):
        if padding == "right":
            tokens[b, : len(p)] = p
        else:
            tokens[b, t - len(p) :] = p
    cache = init_cache(m, params, batch=3, slots=64)
    assert set(cache.layers["0"]) == {"conv", "ssm"} and set(cache.layers["3"]) == {"k", "v"}
    logits, cache = make_prefill(m, donate=True)(params, tokens, cache, lengths=torch.tensor([37, 20, 5]),
                                                 padding=padding)  # fmt: skip
    decode = make_decode_step(m)
    new = torch.randint(0, cfg.vocab_size, (5, 3), generator=g)
    worst = 0.0
    for i in range(6):
        for b, p in enumerate(prompts):
            full, _ = m.apply(params, torch.cat([p, new[:i, b]])[None])
            worst = max(worst, float((full[0, -1] - logits[b]).abs().max()))
        if i < 5:
            logits, cache = decode(params, new[i], cache)
    assert worst <= ATOL, worst


def test_generate_batched_compiled_equals_one_by_one():
    cfg = CONFIGS["qwen3_5_dense_tied"]
    m = qwen3_next.model(cfg)
    params = random_params(cfg, seed=9)
    prompts = [[5, 9, 2, 7, 1, 3, 3], [4, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    alone = [ft.infer.generate(m, params, [p], max_new_tokens=6)[0] for p in prompts]
    assert ft.infer.generate(m, params, prompts, max_new_tokens=6, compile="aot_eager") == alone
    assert ft.infer.generate(m, params, prompts, max_new_tokens=6, padding="right") == alone


# ------------------------------------------------------------------ config, training


@pytest.mark.parametrize(
    "change,message",
    [
        ({"linear_v_heads": 3}, "linear_v_heads=3 must be a multiple of linear_k_heads=2"),
        ({"partial_rotary": 0.01}, "partial_rotary=0.01"),
        ({"variant": "qwen4"}, "variant='qwen4'"),
        ({"top_k": 9}, "top_k=9 exceeds n_experts=8"),
        ({"dense_layers": (7,)}, r"dense_layers: \[7\] outside"),
        ({"attn_impl": "batch_invariant"}, "batch-invariant mode is not implemented for the Gated DeltaNet"),
    ],
)
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        attrs.evolve(CONFIGS["next_moe"], **change)


def test_packed_documents_compute_what_each_document_computes_alone():
    cfg = CONFIGS["next_moe"]
    m = qwen3_next.model(cfg)
    params = random_params(cfg, seed=10)
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (7, 19, 1, 13)]  # 40 tokens, chunk 16
    segments = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    packed, _ = m.apply(params, torch.cat(docs)[None], segments=segments)
    alone = torch.cat([m.apply(params, d[None])[0] for d in docs], dim=1)
    assert float((packed - alone).abs().max()) <= ATOL
    # the rule and the conv alone: chunked with resets == recurrent with resets
    q, k = torch.randn(1, 40, 2, 8, generator=g), torch.randn(1, 40, 2, 8, generator=g)
    v, decay, beta = torch.randn(1, 40, 4, 4, generator=g), -torch.rand(1, 40, 4, generator=g), torch.rand(1, 40, 4)
    ref, ref_s = gdn.recurrent_delta_rule(q, k, v, decay, beta, segments=segments)
    got, got_s = gdn.chunked_delta_rule(q, k, v, decay, beta, chunk=16, segments=segments)
    assert float((got - ref).abs().max()) <= ATOL and float((got_s - ref_s).abs().max()) <= ATOL


def test_debug_model_trains_and_compiles_with_router_metrics():
    # one Gated DeltaNet layer and one gated attention layer, both with MoE + shared expert (the recipes
    # qwen3.5-debug / qwen3.5-moe-debug / qwen3-next-debug train the debug flavors through the CLI)
    for cfg in (qwen3_next.Config.debug(),):
        cfg = attrs.evolve(cfg, n_layers=2, attention_every=2, vocab_size=256, dim=64, expert_dim=32,
                           shared_expert_dim=32)  # fmt: skip
        m = qwen3_next.model(cfg)
        params = m.init(random.key(0))
        opt = ft.optim.adamw(lr=3e-3)
        step = torch.compile(ft.train.make_train_step(ft.train.next_token_loss(m), opt), backend="aot_eager",
                             fullgraph=True)  # fmt: skip
        state = ft.train.init_state(params, opt)
        tok = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
        batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
        losses = []
        for _ in range(8):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        assert losses[-1] < losses[0] - 0.5 and "moe.aux_loss" in metrics, (losses, sorted(metrics))


def test_pipeline_stages_compose_to_apply():
    cfg = CONFIGS["next_moe"]
    m = qwen3_next.model(cfg)
    params = random_params(cfg, seed=12)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(13))
    want, _ = m.apply(params, tokens, logits=False)
    h, stats, _ = m.stage(params, tokens, layers=range(0, 3), first=True, last=False)  # 3 Gated DeltaNet layers
    h, more, _ = m.stage(params, h, layers=range(3, 4), first=False, last=True)  # the attention layer
    assert torch.equal(h, want) and sorted({**stats, **more}) == [0, 1, 2, 3]


def test_environment_has_no_fla():
    # transformers' linear-attention classes fail on CPU when `fla` and triton are both installed (FACTS.md);
    # the parity tests above rely on its pure-torch fallback
    import importlib.util

    assert importlib.util.find_spec("fla") is None, "uninstall flash-linear-attention (fla): see FACTS.md"


def test_bf16_checkpoint_generates_through_from_pretrained(tmp_path):
    cfg = CONFIGS["qwen3_5_moe"]
    hf.save_hf(random_params(cfg, seed=14), cfg, tmp_path)
    model, params = ft.models.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert params["layers"]["0"]["gdn"]["wqkv"].dtype == torch.bfloat16
    prompt = [5, 17, 3, 99, 42, 7]
    cache = init_cache(model, params, batch=1, slots=16)
    assert cache.layers["0"]["ssm"].dtype == torch.float32  # the delta-rule state stays float32 in bf16
    logits, cache = make_prefill(model)(params, torch.tensor([prompt[:-1]]), cache)
    logits, _ = make_decode_step(model)(params, torch.tensor(prompt[-1:]), cache)
    full, _ = model.apply(params, torch.tensor([prompt]))
    assert logits.dtype == torch.bfloat16
    # chunked (prefill) and recurrent (decode) forms round differently in bf16 activations: ~1e-2 of logits ~1
    torch.testing.assert_close(logits[0].float(), full[0, -1].float(), rtol=0, atol=5e-2)
    assert len(ft.infer.generate(model, params, [prompt], max_new_tokens=4)[0]) == 4
