"""Qwen3-MoE: published sizes (vs HF on meta), HF parity (logits, aux loss) both ways on disk, training.

Parity tolerance: max abs logit difference <= 1e-5 in float32, as for the
dense models. Routing is discrete, so the test routers are scaled up (router
std ~0.5) to keep every top-k choice far from a tie that float32 rounding
could flip; HF and ftitan then pick the same experts and the outputs differ
by summation order only. The aux loss is a ratio of exact counts and fp32
probability sums: 1e-6 relative.
"""

import json

import attrs
import pytest
import safetensors.torch
import torch
import transformers

import ftitan as ft
from ftitan import random, tree
from ftitan.models import hf, qwen3_moe

ATOL = 1e-5

# ------------------------------------------------------------------ published sizes

# config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on the HF hub (transformers 4.51 format)
_HUB_COMMON = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 40960,
    "mlp_only_layers": [], "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
HUB_CONFIGS = {
    "qwen3_30b_a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, max_window_layers=48,
                          num_attention_heads=32, num_hidden_layers=48, num_key_value_heads=4),
    "qwen3_235b_a22b": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            max_window_layers=94, num_attention_heads=64, num_hidden_layers=94, num_key_value_heads=4),
}  # fmt: skip
# exact (total, active): total equals HF's num_parameters(); active = total - L * (E - top_k) * 3 * D * Fe
EXACT_PARAMS = {
    "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704),
    "qwen3_235b_a22b": (235_093_634_560, 22_190_763_520),
}
# model cards of the two checkpoints on the HF hub: "30.5B in total and 3.3B activated",
# "235B in total and 22B activated" (billions as printed; Qwen truncates: 3.353B reads "3.3B")
HEADLINE = {"qwen3_30b_a3b": ("30.5", "3.3"), "qwen3_235b_a22b": ("235", "22")}


def hub_config(flavor):
    return {**_HUB_COMMON, **HUB_CONFIGS[flavor]}


def close_to_headline(count, printed):
    # within 0.5%, or equal to the headline at its printed precision, rounded or truncated
    value = float(printed) * 1e9
    unit = 10 ** -len(printed.partition(".")[2]) * 1e9
    return abs(count - value) <= 0.005 * value or value - unit / 2 <= count < value + unit


@pytest.mark.parametrize("flavor", list(EXACT_PARAMS))
def test_published_flavors_match_hf_on_meta(flavor):
    cfg = qwen3_moe.FLAVORS[flavor]()
    assert hf.config_from_hf(hub_config(flavor)) == cfg  # the flavor is the published config.json
    params = qwen3_moe.model(cfg).init(random.key(0), dtype=torch.bfloat16, device="meta")
    assert all(x.device.type == "meta" for x in tree.leaves(params))
    with torch.device("meta"):
        hm = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**hub_config(flavor)))
    total, active = EXACT_PARAMS[flavor]
    assert tree.size(params) == sum(p.numel() for p in hm.parameters()) == total
    # active, counted independently of active_params: attention + router + top_k experts per layer, embed, head
    d, fe = cfg.dim, cfg.expert_dim
    attn = 2 * d * cfg.n_heads * cfg.head_dim + 2 * d * cfg.n_kv_heads * cfg.head_dim + 2 * cfg.head_dim
    per_layer = attn + 2 * d + cfg.n_experts * d + cfg.top_k * 3 * d * fe
    assert qwen3_moe.active_params(cfg) == cfg.n_layers * per_layer + 2 * cfg.vocab_size * d + d == active
    assert close_to_headline(total, HEADLINE[flavor][0]) and close_to_headline(active, HEADLINE[flavor][1])


def test_flavors_and_flops_count_active_weights():
    assert set(qwen3_moe.FLAVORS) == {"debug", *EXACT_PARAMS}
    cfg = qwen3_moe.Config.qwen3_30b_a3b()
    assert cfg.moe == ft.nn.MoEConfig(n_experts=128, top_k=8, expert_dim=768, norm_topk=True, aux_loss_coef=0.001)
    # 6 * (active matmul weights: active params minus embedding lookup and norms) + attention scores
    norms = cfg.n_layers * (2 * cfg.dim + 2 * cfg.head_dim) + cfg.dim
    matmul = qwen3_moe.active_params(cfg) - cfg.vocab_size * cfg.dim - norms
    scores = 6 * cfg.n_layers * 4096 * cfg.n_heads * cfg.head_dim
    assert qwen3_moe.model(cfg).flops_per_token(4096) == 6 * matmul + scores
    dense = attrs.evolve(cfg, dense_layers=(0, 47))  # a dense layer costs its full SwiGLU
    moe_layer = cfg.n_experts * cfg.dim + cfg.top_k * 3 * cfg.dim * cfg.expert_dim
    diff = qwen3_moe.flops_per_token(dense, 4096) - qwen3_moe.flops_per_token(cfg, 4096)
    assert diff == 6 * 2 * (3 * cfg.dim * cfg.ffn_dim - moe_layer)


# ------------------------------------------------------------------ config and params

TINY = qwen3_moe.Config(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                        n_experts=4, top_k=2, expert_dim=24, ffn_dim=40, max_seq_len=64)  # fmt: skip


@pytest.mark.parametrize(
    "change,message",
    [
        ({"top_k": 5}, "top_k=5 exceeds n_experts=4"),
        ({"dense_layers": (3,)}, r"dense_layers=\(3,\).*out of range: \[3\]"),
        ({"dense_layers": (0, 1, 2)}, "every layer is in dense_layers; use ftitan.models.qwen3"),
        ({"dense_layers": "01"}, "dense_layers='01'"),
        ({"n_kv_heads": 3}, "not a multiple of n_kv_heads"),
        ({"expert_dim": 0}, "expert_dim=0"),
        ({"aux_loss_coef": -1.0}, "aux_loss_coef=-1.0"),
    ],
)
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        attrs.evolve(TINY, **change)


def test_params_tree_layout_and_axes():
    cfg = attrs.evolve(TINY, dense_layers=[1])
    assert cfg.dense_layers == (1,) and cfg.moe_layers == (0, 2)
    m = qwen3_moe.model(cfg)
    params = m.init(random.key(0))
    layers = params["layers"]
    assert set(layers["0"]) == {"attn_norm", "attn", "mlp_norm", "moe"}
    assert set(layers["1"]) == {"attn_norm", "attn", "mlp_norm", "mlp"}
    assert tuple(layers["0"]["moe"]["router"].shape) == (4, 32)
    assert tuple(layers["2"]["moe"]["experts"]["w2"].shape) == (4, 32, 24)
    assert tuple(layers["1"]["mlp"]["w1"].shape) == (40, 32)
    assert m.param_axes["layers"]["0"]["moe"]["experts"]["w1"] == ("experts", "mlp", "embed")
    assert m.frozen == () and m.update_buffers is None


# ------------------------------------------------------------------ HF parity

CONFIGS = {
    # GQA, untied, H*Dh != D, a dense layer in the middle (HF mlp_only_layers), 8 experts top 2
    "gqa_dense1": qwen3_moe.Config(vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=24,
                                   n_experts=8, top_k=2, expert_dim=32, ffn_dim=80, dense_layers=(1,),
                                   max_seq_len=128, rope_theta=10_000.0),
    # tied, multi-query, top 3 of 6 without renormalization
    "mqa_tied_unnormed": qwen3_moe.Config(vocab_size=80, dim=48, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=16,
                                          n_experts=6, top_k=3, expert_dim=24, ffn_dim=64, norm_topk=False,
                                          tie_embeddings=True, max_seq_len=64),
}  # fmt: skip


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    hcfg = transformers.Qwen3MoeConfig(**{k: v for k, v in hf.config_to_hf(cfg).items() if k != "architectures"})
    m = transformers.Qwen3MoeForCausalLM._from_config(hcfg, attn_implementation="eager").eval()
    with torch.no_grad():  # distinct norms (HF inits ones) so mix-ups show; routers scaled off ties
        for name, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.5 if "mlp.gate." in name else 0.01))
    return m


def ftitan_params(cfg, seed=0):
    params = qwen3_moe.model(cfg).init(random.key(seed))
    g = torch.Generator().manual_seed(seed)

    def perturb(path, x):
        if path.endswith("router"):
            return 25 * x  # std 0.5: routing far from ties
        return x + 0.1 * torch.randn(x.shape, generator=g) if x.dim() == 1 else x

    return tree.map_with_path(perturb, params)


def tokens_for(cfg, b=2, t=20, seed=1):
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def hf_forward(m, tokens, position_ids=None):
    with torch.no_grad():
        return m(input_ids=tokens, position_ids=position_ids, output_router_logits=True)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_save_pretrained_then_load_hf(name, tmp_path):
    cfg = CONFIGS[name]
    hm = hf_model(cfg)
    hm.save_pretrained(tmp_path)
    # transformers 5 keeps experts fused in memory but writes the hub layout: one tensor per expert
    names = safetensors.torch.load_file(tmp_path / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.1.up_proj.weight" in names and not any("gate_up_proj" in n for n in names)
    cfg2, params = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    tokens = tokens_for(cfg)
    want = hf_forward(hm, tokens)
    for impl in ("sdpa", "math"):
        got, _, aux = qwen3_moe.model(attrs.evolve(cfg, attn_impl=impl)).apply_with_aux(params, tokens)
        assert (got - want.logits).abs().max() <= ATOL, impl
    torch.testing.assert_close(aux["moe.aux_loss"], want.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(aux["loss"], cfg.aux_loss_coef * want.aux_loss, rtol=1e-6, atol=0)
    n_moe = len(cfg.moe_layers)
    assert aux["moe.tokens_per_expert"].shape == (n_moe, cfg.n_experts)
    assert aux["moe.tokens_per_expert"].sum() == tokens.numel() * cfg.top_k * n_moe
    pos = torch.tensor([[5, 6, 7, 8, 40, 41, 42, 43, 44, 45] * 2, list(range(30, 50))])
    got, _ = qwen3_moe.model(cfg).apply(params, tokens, positions=pos)
    assert (got - hf_forward(hm, tokens, pos).logits).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_hf_then_from_pretrained_and_load_hf(name, tmp_path):
    cfg = CONFIGS[name]
    params = ftitan_params(cfg)
    tokens = tokens_for(cfg)
    got, _, aux = qwen3_moe.model(cfg).apply_with_aux(params, tokens)
    hf.save_hf(params, cfg, tmp_path)
    names = safetensors.torch.load_file(tmp_path / "model.safetensors").keys()
    e = cfg.n_experts - 1
    assert {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")} <= names
    cfg2, params2 = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(params2), tree.leaves(params), strict=True))
    hm = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hm.config.tie_word_embeddings == cfg.tie_embeddings and hm.config.norm_topk_prob == cfg.norm_topk
    want = hf_forward(hm, tokens)
    assert (got - want.logits).abs().max() <= ATOL
    torch.testing.assert_close(aux["moe.aux_loss"], want.aux_loss, rtol=1e-6, atol=0)


def test_import_errors_name_the_expert_tensors():
    cfg = CONFIGS["gqa_dense1"]
    state = hf.to_hf(ftitan_params(cfg), cfg)
    assert len(state) == 3 * 8 + 3 + 2 * (1 + 3 * 8) + 3  # attention + norms per layer, dense mlp, experts, outer
    gone = "model.layers.2.mlp.experts.5.down_proj.weight"
    with pytest.raises(KeyError, match=rf"missing \[{gone}\]"):
        hf.from_hf({k: v for k, v in state.items() if k != gone}, cfg)
    fused = {**state, "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(1)}  # transformers 5's layout: 3-D
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj: shape \(1,\); .*\(E, 2F, D\)"):
        hf.from_hf(fused, cfg)
    with pytest.raises(KeyError, match=r"unexpected \[model.layers.0.mlp.experts.9.up_proj.weight\]"):
        hf.from_hf({**state, "model.layers.0.mlp.experts.9.up_proj.weight": torch.zeros(32, 64)}, cfg)
    wrong = {**state, "model.layers.0.mlp.experts.3.gate_proj.weight": torch.zeros(31, 64)}
    culprit = r"layers.0.moe.experts.w1 \(from .*experts.3.gate_proj.weight\): .*\(31, 64\).*\(32, 64\)"
    with pytest.raises(ValueError, match=culprit):
        hf.from_hf(wrong, cfg)


def test_config_conversion():
    d = hub_config("qwen3_30b_a3b")
    cfg = hf.config_from_hf(d)
    assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg
    # HF's two ways of making layers dense: mlp_only_layers and decoder_sparse_step
    assert hf.config_from_hf({**d, "mlp_only_layers": [0, 5]}).dense_layers == (0, 5)
    assert hf.config_from_hf({**d, "decoder_sparse_step": 2}).moe_layers == tuple(range(1, 48, 2))
    assert hf.config_from_hf({**d, "decoder_sparse_step": 2, "mlp_only_layers": [1]}).moe_layers[:2] == (3, 5)
    assert not hf.config_from_hf({**d, "norm_topk_prob": None}).norm_topk
    with pytest.raises(ValueError, match="num_experts=0.*load it as a qwen3 model"):
        hf.config_from_hf({**d, "num_experts": 0})
    with pytest.raises(ValueError, match="decoder_sparse_step=0"):
        hf.config_from_hf({**d, "decoder_sparse_step": 0})
    with pytest.raises(ValueError, match="qwen3_moe: HF config use_sliding_window=True"):
        hf.config_from_hf({**d, "use_sliding_window": True})
    with pytest.raises(ValueError, match=r"lacks \['moe_intermediate_size'\]"):
        hf.config_from_hf({k: v for k, v in d.items() if k != "moe_intermediate_size"})
    assert json.loads(json.dumps(hf.config_to_hf(cfg)))["mlp_only_layers"] == []


# ------------------------------------------------------------------ training


def test_debug_config_trains_with_router_metrics_and_compiles():
    cfg = attrs.evolve(qwen3_moe.Config.debug(), n_layers=2)
    m = qwen3_moe.model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    opt = ft.optim.adamw(3e-3)
    step = ft.train.make_train_step(ft.train.next_token_loss(m), opt)
    state = ft.train.init_state(m.init(random.key(0)), opt)
    # compiled (aot_eager: the same aten ops) equals eager; 1e-6 allows decomposition reordering
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    c_state, c_metrics = compiled(state, batch)
    state, metrics = step(state, batch)
    torch.testing.assert_close(c_metrics["loss"], metrics["loss"], rtol=0, atol=1e-6)
    for a, b in zip(tree.leaves(c_state.params), tree.leaves(state.params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(c_metrics["moe.tokens_per_expert"], metrics["moe.tokens_per_expert"])
    # router statistics ride along in the metrics: every token goes to top_k experts in every MoE layer
    assert metrics["moe.tokens_per_expert"].shape == (2, cfg.n_experts)
    assert metrics["moe.tokens_per_expert"].sum() == batch["inputs"].numel() * cfg.top_k * 2
    # the weighted balancing loss is part of the training loss
    expected = metrics["ce_loss"] + cfg.aux_loss_coef * metrics["moe.aux_loss"]
    torch.testing.assert_close(metrics["loss"], expected, rtol=1e-6, atol=0)
    again, _ = step(ft.train.init_state(m.init(random.key(0)), opt), batch)  # deterministic on CPU
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(again.params), tree.leaves(state.params), strict=True))
    losses = [metrics["loss"].item()]
    for _ in range(29):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
    assert losses[-1] < 0.2 * losses[0], losses  # memorizes the batch: ~7.7 -> ~0.01
