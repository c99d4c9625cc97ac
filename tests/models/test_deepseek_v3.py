"""DeepSeek-V3 / Kimi K2 / Moonlight: configs, parameter counts, HF parity both ways, balancing bias, training.

HF parity tolerance: max abs logit difference <= 1e-5 in float32. Both sides
run the same float32 math (ftitan SDPA or explicit softmax vs HF eager
attention; the same routing ops); 1e-5 leaves room for different summation
orders (the experts' outputs are summed in another order than HF's
``index_add_``) on O(1) logits. No expert choice in these seeded configs is
within float32 rounding of a tie (a flipped choice would move logits by far
more than 1e-5; the observed differences are ~1e-7).
"""

import resource

import attrs
import pytest
import torch
import transformers
from safetensors import safe_open

import ftitan
from ftitan import random, tree
from ftitan.models import deepseek_v3 as ds
from ftitan.models import hf
from ftitan.nn.rope import YarnRopeScaling

ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    # these matmuls are tiny: a second thread gains nothing, and when other jobs share the 2 cores
    # OpenMP's spinning barriers made the 30-step training test ~50x slower (113 s instead of 2 s)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = ds.Config(
    vocab_size=96, dim=32, n_layers=3, n_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=12, ffn_dim=48, n_dense_layers=1, n_experts=8, top_k=2, moe_ffn_dim=16,
    n_groups=4, topk_groups=2, routed_scale=2.5, max_seq_len=64,
)  # fmt: skip

CONFIGS = {
    # V3-like: low-rank q, YaRN with mscale != mscale_all_dim (cos/sin and softmax both rescaled), 4 groups pick 2
    "v3_yarn_groups": attrs.evolve(TINY, rope_scaling=YarnRopeScaling(
        factor=4.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=1.0)),
    # Moonlight-like: plain wq, 2 shared experts, no groups, eps 1e-5, 2 dense blocks, 11 blocks ("10" after "9")
    "moonlight_plain_q": attrs.evolve(TINY, q_lora_rank=None, n_layers=11, n_dense_layers=2, n_shared_experts=2,
                                      n_groups=1, topk_groups=1, routed_scale=2.446, norm_eps=1e-5,
                                      rope_theta=50_000.0, norm_topk=False),
    # Kimi-K2-like YaRN (beta_fast == beta_slow) with HF's rotate-half rope layout
    "k2_yarn_rotate_half": attrs.evolve(TINY, rope_interleave=False, rope_scaling=YarnRopeScaling(
        factor=4.0, original_max_position_embeddings=16, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
        mscale_all_dim=1.0)),
}  # fmt: skip


def perturbed(params, seed=0, scale=0.1):
    # norms start at ones and the bias at zeros; perturb the vectors so mix-ups and the bias show
    g = torch.Generator().manual_seed(seed)
    return tree.map(lambda x: x + scale * torch.randn(x.shape, generator=g) if x.dim() == 1 else x, params)


def hf_config(cfg):
    return transformers.DeepseekV3Config(**{k: v for k, v in hf.config_to_hf(cfg).items() if k != "architectures"})


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    m = transformers.DeepseekV3ForCausalLM._from_config(hf_config(cfg), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.05))
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return m


def hf_logits(m, tokens, position_ids=None):
    with torch.no_grad():
        return m(input_ids=tokens, position_ids=position_ids).logits


def tokens_for(cfg, b=2, t=20, seed=1):
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ configs


@pytest.mark.parametrize(
    "change,message",
    [({"n_dense_layers": 3}, "n_dense_layers=3"), ({"qk_rope_head_dim": 7}, "must be even"),
     ({"top_k": 9}, "top_k=9 exceeds"), ({"n_groups": 3}, "not divisible by n_groups"),
     ({"attn_impl": "flash"}, "attn_impl='flash'"), ({"dim": 0}, "dim=0"), ({"score_func": "relu"}, "score_func"),
     ({"rope_scaling": {"factor": 4}}, "rope_scaling")],
)  # fmt: skip
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        attrs.evolve(TINY, **change)


def test_flavors_frozen_hashable_and_registered():
    assert set(ds.FLAVORS) == {
        "debug", "deepseek_v3_16b", "deepseek_v3_671b", "moonlight_16b_a3b", "kimi_k2", "kimi_k2_5", "kimi_k2_6",
        "kimi_k2_7"}  # fmt: skip
    cfg = ds.Config.deepseek_v3_671b()
    assert hash(cfg) == hash(ds.Config.deepseek_v3_671b()) and cfg.mla.qk_head_dim == 192
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.dim = 8  # type: ignore[misc]
    assert hf.family_of(cfg).name == "deepseek_v3" and hf.family_of("kimi_k2").name == "deepseek_v3"


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("flavor", [f for f in ds.FLAVORS if f != "debug"])
def test_meta_param_counts_equal_transformers(flavor):
    # HF on the meta device, same shapes (HF has no MTP modules); its state_dict includes
    # e_score_correction_bias (a buffer there, our router_bias). Routing does not change shapes.
    cfg = ds.FLAVORS[flavor]()
    before = rss_bytes()
    params = ds.model(cfg).init(random.key(0), dtype=torch.bfloat16, device="meta")
    assert rss_bytes() - before < 64 * 2**20
    with torch.device("meta"):
        hm = transformers.DeepseekV3ForCausalLM(hf_config(attrs.evolve(cfg, score_func="sigmoid")))
    assert tree.size(params) == sum(x.numel() for x in hm.state_dict().values()) == ds.param_counts(cfg)[0]


# (total, active) as counted here, and the published figures they are checked against:
# - DeepSeek-V3 Technical Report (2024): "671B total parameters, 37B activated for each token". The
#   activated figure leaves out the embedding lookup: 36.63B (+0.9% off; the headline is rounded to 1B).
# - Kimi K2 model card / tech report: "1T total, 32B activated"; the HF-computed 1.026T (e.g. unsloth's
#   card "1.026T") is what the architecture gives. The tech report's table says 1.04T (1.3% above the
#   architecture's count) and 32.6B; its activated count without the lookup is 31.69B.
# - Moonlight (Liu et al. 2025, Table): 15.29B total and 2.24B activated *without embeddings*;
#   headline "16B-A3B" (15.96B total, 2.91B activated with both tables).
# - DeepSeek-V2-Lite (DeepSeek-V2 paper, = TorchTitan's 16B shape): 15.7B total, "2.4B activated" (2.45B).
EXACT = {
    "deepseek_v3_671b": (671_026_419_200, 37_552_297_472),
    "kimi_k2": (1_026_408_232_448, 32_861_500_928),
    "kimi_k2_5": (1_026_408_232_448, 32_861_500_928),
    "moonlight_16b_a3b": (15_960_110_208, 2_914_776_192),
    "deepseek_v3_16b": (15_706_485_888, 2_661_151_872),
}
PUBLISHED = [  # (flavor, which count, published value, relative tolerance)
    ("deepseek_v3_671b", "total", 671e9, 0.005),
    ("deepseek_v3_671b", "active_no_lookup", 37e9, 0.0135),  # 37B rounded to the nearest 1B
    ("kimi_k2", "total", 1.026e12, 0.005),
    ("kimi_k2", "active_no_lookup", 32e9, 0.016),  # 32B rounded to the nearest 1B
    ("moonlight_16b_a3b", "total", 16e9, 0.005),
    ("moonlight_16b_a3b", "total_no_embeddings", 15.29e9, 0.005),
    ("moonlight_16b_a3b", "active_no_embeddings", 2.24e9, 0.005),
    ("deepseek_v3_16b", "total", 15.7e9, 0.005),
]


@pytest.mark.parametrize("flavor", list(EXACT))
def test_param_counts_exact(flavor):
    assert ds.param_counts(ds.FLAVORS[flavor]()) == EXACT[flavor]


@pytest.mark.parametrize("flavor,which,value,rel", PUBLISHED)
def test_param_counts_match_published(flavor, which, value, rel):
    cfg = ds.FLAVORS[flavor]()
    total, active = ds.param_counts(cfg)
    emb = cfg.vocab_size * cfg.dim
    got = {"total": total, "active_no_lookup": active - emb, "total_no_embeddings": total - 2 * emb,
           "active_no_embeddings": active - 2 * emb}[which]  # fmt: skip
    assert abs(got - value) <= rel * value, f"{flavor} {which}: {got:,} vs published {value:,.0f}"


@pytest.mark.parametrize("flavor", ["deepseek_v3_671b", "moonlight_16b_a3b", "debug"])
def test_flops_per_token_counts_active_matmul_weights(flavor):
    # independent count: every 2-D/3-D weight except the embedding table, experts scaled to those used
    cfg = ds.FLAVORS[flavor]()
    params = ds.model(cfg).init(random.key(0), device="meta")
    n = 0
    for path, x in zip(*tree.flatten_with_paths(params)[:2], strict=True):
        if path == "embed" or x.dim() == 1:
            continue
        n += x.numel() * cfg.top_k // cfg.n_experts if ".experts." in path else x.numel()
    attn = 3 * cfg.n_layers * 4096 * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    assert ds.model(cfg).flops_per_token(4096) == 6 * n + attn
    total, active = ds.param_counts(cfg)
    norms_and_bias = sum(x.numel() for x in tree.leaves(params) if x.dim() == 1)
    assert n == active - cfg.vocab_size * cfg.dim - norms_and_bias


# ------------------------------------------------------------------ params and apply


def test_params_tree_layout_axes_and_fp32_bias():
    m = ds.model(TINY)
    params = m.init(random.key(0), dtype=torch.bfloat16)
    assert list(params) == ["embed", "layers", "norm", "head"]
    assert set(params["layers"]["0"]) == {"attn_norm", "attn", "mlp_norm", "mlp"}
    assert set(params["layers"]["1"]) == {"attn_norm", "attn", "mlp_norm", "moe"}
    moe = params["layers"]["2"]["moe"]
    assert tuple(moe["experts"]["w1"].shape) == (8, 16, 32) and tuple(moe["shared"]["w2"].shape) == (32, 16)
    assert moe["router_bias"].dtype == torch.float32 and moe["router"].dtype == torch.bfloat16
    assert not moe["router_bias"].any()
    axes = tree.structure(params).flatten_up_to(m.param_axes)
    for x, ax in zip(tree.leaves(params), axes, strict=True):
        assert isinstance(ax, tuple) and len(ax) == x.dim()
    assert m.param_axes["layers"]["2"]["moe"]["experts"]["w2"] == ("experts", "embed", "mlp")
    assert m.frozen == ("layers.*.moe.router_bias",)
    frozen = [p for p in tree.paths(params) if any(tree.match(p, g) for g in m.frozen)]
    assert frozen == ["layers.1.moe.router_bias", "layers.2.moe.router_bias"]


def test_apply_shapes_hidden_head_aux_and_impls():
    m = ds.model(TINY)
    params = perturbed(m.init(random.key(0)))
    tokens = tokens_for(TINY, t=10)
    logits, cache, aux = m.apply_with_aux(params, tokens)
    hidden, _ = m.apply(params, tokens, logits=False)
    assert logits.shape == (2, 10, 96) and hidden.shape == (2, 10, 32) and cache is None
    torch.testing.assert_close(hidden @ m.head(params).T, logits, rtol=1e-6, atol=1e-6)
    assert aux["moe.tokens_per_expert"].shape == (2, 8)
    assert torch.equal(aux["moe.tokens_per_expert"].sum(-1), torch.full((2,), 2.0 * 20))  # N tokens x top_k
    assert aux["loss"] == 0.0  # aux_loss_coef 0: the balancing bias does the balancing
    math_logits, _ = ds.model(attrs.evolve(TINY, attn_impl="math")).apply(params, tokens)
    torch.testing.assert_close(math_logits, logits, rtol=0, atol=1e-5)


def test_bias_steers_selection_and_gets_no_gradient():
    m = ds.model(TINY)
    params = perturbed(m.init(random.key(0)))
    tokens = tokens_for(TINY, t=12)
    base, _ = m.apply(params, tokens)
    zero_bias = tree.map_with_path(lambda p, x: torch.zeros_like(x) if p.endswith("router_bias") else x, params)
    assert not torch.allclose(m.apply(zero_bias, tokens)[0], base, atol=1e-4)  # selection changed
    ungrouped = ds.model(attrs.evolve(TINY, n_groups=1, topk_groups=1))
    assert not torch.allclose(ungrouped.apply(params, tokens)[0], base, atol=1e-4)  # group limit bites

    def loss(p):
        return m.apply(p, tokens)[0].logsumexp(-1).mean()

    grads = torch.func.grad(loss)(params)
    assert not grads["layers"]["1"]["moe"]["router_bias"].any()
    assert grads["layers"]["1"]["moe"]["router"].abs().sum() > 0  # the weights do train the router


def test_compiled_apply_and_grad_match_eager():
    # fullgraph through routing, dispatch and grouped matmuls; aot_eager runs the same aten ops as eager
    m = ds.model(attrs.evolve(TINY, n_layers=2, attn_impl="math"))
    params = perturbed(m.init(random.key(0)))
    tokens = tokens_for(TINY, t=8)
    eager, _ = m.apply(params, tokens)
    compiled, _ = torch.compile(m.apply, fullgraph=True, backend="aot_eager")(params, tokens)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)
    step = torch.func.grad_and_value(lambda p, t: m.apply(p, t)[0].logsumexp(-1).mean())
    g_eager, v_eager = step(params, tokens)
    g_comp, v_comp = torch.compile(step, fullgraph=True, backend="aot_eager")(params, tokens)
    torch.testing.assert_close(v_comp, v_eager, rtol=0, atol=1e-6)
    for a, b in zip(tree.leaves(g_comp), tree.leaves(g_eager), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ HF parity


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_save_pretrained_to_ftitan(name, tmp_path):
    cfg = CONFIGS[name]
    hm = hf_model(cfg)
    hm.save_pretrained(tmp_path)  # hub layout: one tensor per expert
    index = tmp_path / "model.safetensors"
    with safe_open(index, "pt") as f:
        assert "model.layers.2.mlp.experts.7.up_proj.weight" in set(f.keys())
    cfg2, params = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    tokens = tokens_for(cfg)
    want = hf_logits(hm, tokens)
    assert want.abs().max() > 0.5
    for impl in ("sdpa", "math"):
        got, _ = ds.model(attrs.evolve(cfg, attn_impl=impl)).apply(params, tokens)
        assert (got - want).abs().max() <= ATOL, impl
    pos = torch.tensor([[5, 6, 7, 8, 40, 41, 42, 43, 44, 45] * 2, list(range(30, 50))])
    got, _ = ds.model(cfg).apply(params, tokens, positions=pos)
    assert (got - hf_logits(hm, tokens, pos)).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ftitan_save_hf_to_from_pretrained(name, tmp_path):
    cfg = CONFIGS[name]
    # weights x3 (std 0.06) so logits are O(1); vectors perturbed, the routing bias included
    params = perturbed(tree.map(lambda x: x * 3 if x.dim() > 1 else x, ds.model(cfg).init(random.key(1))))
    tokens = tokens_for(cfg)
    got, _ = ds.model(cfg).apply(params, tokens)
    hf.save_hf(params, cfg, tmp_path)
    names = set(hf.to_hf(params, cfg))
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in names and not any("gate_up_proj" in n for n in names)
    cfg2, params2 = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    for a, b in zip(tree.leaves(params2), tree.leaves(params), strict=True):
        assert torch.equal(a, b)
    hm = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    want = hf_logits(hm, tokens)
    assert want.abs().max() > 0.5
    assert (got - want).abs().max() <= ATOL


# ------------------------------------------------------------------ config conversion and import errors

V3_HUB = {  # deepseek-ai/DeepSeek-V3 config.json (transformers 4.x remote-code format), minus quantization_config
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
K2_HUB = {**V3_HUB, "model_type": "kimi_k2", "first_k_dense_replace": 1, "max_position_embeddings": 131072,
          "n_group": 1, "n_routed_experts": 384, "num_attention_heads": 64, "num_key_value_heads": 64,
          "num_nextn_predict_layers": 0, "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "topk_group": 1,
          "bos_token_id": 163584, "eos_token_id": 163585, "vocab_size": 163840,
          "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"}}  # fmt: skip
MOONLIGHT_HUB = {**V3_HUB, "first_k_dense_replace": 1, "hidden_size": 2048, "intermediate_size": 11264,
                 "max_position_embeddings": 8192, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64,
                 "n_shared_experts": 2, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
                 "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "q_lora_rank": None, "rms_norm_eps": 1e-05,
                 "rope_scaling": None, "rope_theta": 50000.0, "routed_scaling_factor": 2.446, "topk_group": 1,
                 "vocab_size": 163840}  # fmt: skip


def test_config_from_hub_configs():
    assert hf.config_from_hf(V3_HUB) == ds.Config.deepseek_v3_671b()
    assert hf.config_from_hf(K2_HUB) == ds.Config.kimi_k2()
    assert hf.config_from_hf(MOONLIGHT_HUB) == ds.Config.moonlight_16b_a3b()
    for flavor in ("deepseek_v3_671b", "kimi_k2", "kimi_k2_5", "moonlight_16b_a3b", "debug"):
        cfg = ds.FLAVORS[flavor]()
        d = hf.config_to_hf(cfg)
        assert d["model_type"] == "deepseek_v3" and d["num_key_value_heads"] == cfg.n_heads
        assert hf.config_from_hf(d) == cfg
        assert hf.config_from_hf(hf_config(cfg).to_dict()) == cfg  # through transformers' own config class


def test_config_conversion_refusals():
    with pytest.raises(ValueError, match="quantized .*'fp8'.*dequantize"):
        hf.config_from_hf({**V3_HUB, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="scoring_func='softmax'"):
        hf.config_from_hf({**V3_HUB, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="num_key_value_heads=1"):
        hf.config_from_hf({**V3_HUB, "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="'llama3'"):
        hf.config_from_hf({**V3_HUB, "rope_scaling": {"type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="score_func='softmax' .*set score_func='sigmoid'"):
        hf.config_to_hf(ds.Config.deepseek_v3_16b())
    with pytest.raises(ValueError, match="latent_norm_eps"):
        hf.config_to_hf(attrs.evolve(TINY, latent_norm_eps=1e-5))


def test_import_errors_name_the_tensors():
    cfg = TINY
    state = hf.to_hf(ds.model(cfg).init(random.key(0)), cfg)
    assert len(state) == 3 + 3 * 9 + 2 * (2 + 3 * 8 + 3) + 3  # top, attention+norms per block, MoE, dense mlp
    missing = {k: v for k, v in state.items() if k != "model.layers.2.mlp.experts.5.down_proj.weight"}
    with pytest.raises(KeyError, match=r"missing \[model.layers.2.mlp.experts.5.down_proj.weight\]"):
        hf.from_hf(missing, cfg)
    with pytest.raises(KeyError, match=r"unexpected \[model.layers.1.mlp.experts.8.up_proj.weight\]"):
        hf.from_hf({**state, "model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(1)}, cfg)
    wrong = {**state, "model.layers.1.mlp.experts.3.gate_proj.weight": torch.zeros(16, 30)}
    culprit = r"layers.1.moe.experts.w1 \(from .*experts.3.gate_proj.weight\).*\(16, 30\).*\(16, 32\)"
    with pytest.raises(ValueError, match=culprit):
        hf.from_hf(wrong, cfg)
    # ignored: V3's multi-token-prediction module (layer L) and old rotary buffers
    extra = {**state, "model.layers.3.eh_proj.weight": torch.zeros(1),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}  # fmt: skip
    hf.from_hf(extra, cfg)


# ------------------------------------------------------------------ balancing bias and training


def batch_for(cfg, b=4, t=32, seed=0):
    x = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def test_router_bias_is_a_state_update_outside_the_gradient():
    m = ds.model(TINY)
    params = perturbed(m.init(random.key(0)))
    batch = batch_for(TINY)
    opt = ftitan.optim.chain(ftitan.optim.adamw(1e-2, weight_decay=0.1), ftitan.optim.freeze(m.frozen))
    loss_fn = ftitan.train.next_token_loss(m)
    state = ftitan.train.init_state(params, opt)

    # the optimizer (Adam and weight decay) leaves the bias alone; the router weights do train
    plain, _ = ftitan.train.make_train_step(loss_fn, opt)(state, batch)
    for i in ("1", "2"):
        assert torch.equal(plain.params["layers"][i]["moe"]["router_bias"], params["layers"][i]["moe"]["router_bias"])
        assert not torch.equal(plain.params["layers"][i]["moe"]["router"], params["layers"][i]["moe"]["router"])

    # update_buffers moves it by rate * sign(mean load - load): overloaded experts' bias goes down
    step = ftitan.train.make_train_step(loss_fn, opt, update_buffers=m.update_buffers)
    new, metrics = step(state, batch)
    load = metrics["moe.tokens_per_expert"]  # (L_moe, E)
    for j, i in enumerate(("1", "2")):
        delta = new.params["layers"][i]["moe"]["router_bias"] - params["layers"][i]["moe"]["router_bias"]
        over, under = load[j] > load[j].mean(), load[j] < load[j].mean()
        assert over.any() and (delta[over] < 0).all() and (delta[under] > 0).all()
        torch.testing.assert_close(delta, 1e-3 * torch.sign(load[j].mean() - load[j]), rtol=0, atol=1e-7)
        assert torch.equal(new.params["layers"][i]["moe"]["router"], plain.params["layers"][i]["moe"]["router"])
    with pytest.raises(KeyError, match="moe.tokens_per_expert"):
        m.update_buffers(params, {})


def test_update_buffers_alone_balances_the_load():
    # fixed weights, a skewed router (init std 0.2): only the bias moves, and the most loaded expert's
    # load falls from ~1.9x the mean towards the mean (~1.06x after 40 updates)
    m = ds.model(attrs.evolve(TINY, bias_update_rate=3e-3, init_std=0.2))
    params = m.init(random.key(3))
    tokens = batch_for(TINY, b=8, t=64)["inputs"]
    loads = []
    for _ in range(40):
        _, _, aux = m.apply_with_aux(params, tokens)
        loads.append(aux["moe.max_load"].item())
        params = m.update_buffers(params, aux)
    assert loads[0] > 1.5 and loads[-1] < 0.7 * loads[0], loads


def test_debug_config_trains_and_is_deterministic():
    cfg = ds.Config.debug()
    m = ds.model(cfg)
    batch = batch_for(cfg, b=4, t=32)
    opt = ftitan.optim.chain(ftitan.optim.adamw(3e-3), ftitan.optim.freeze(m.frozen))
    step = ftitan.train.make_train_step(ftitan.train.next_token_loss(m), opt, update_buffers=m.update_buffers)

    def run(n):
        state, losses = ftitan.train.init_state(m.init(random.key(0)), opt), []
        for _ in range(n):
            state, metrics = step(state, batch)
            losses.append(metrics["loss"].item())
        return losses, metrics

    losses, metrics = run(30)
    assert losses[-1] < 0.5 * losses[0], losses
    assert set(metrics) >= {"loss", "ce_loss", "grad_norm", "moe.tokens_per_expert", "moe.aux_loss", "moe.max_load"}
    assert run(3)[0] == losses[:3]  # bit-identical rerun on CPU
