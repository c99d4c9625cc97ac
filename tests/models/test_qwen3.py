"""Qwen3 dense: published sizes (vs HF on meta), HF logits parity both ways, checkpoints, training.

Parity tolerance: max abs logit difference <= 1e-5 in float32. ftitan and
``transformers.Qwen3ForCausalLM`` (eager attention) run the same float32
math in different summation orders on O(1) logits.
"""

import json

import attrs
import pytest
import torch
import transformers

import ftitan as ft
from ftitan import random, tree
from ftitan.models import hf, qwen3

ATOL = 1e-5

# ------------------------------------------------------------------ published sizes

# config.json of each Qwen/Qwen3-* checkpoint on the HF hub (transformers 4.51 format), the fields that differ
_HUB_COMMON = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 151936,
}  # fmt: skip
HUB_CONFIGS = {
    "qwen3_0_6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, max_window_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_1_7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, max_window_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, max_window_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, max_window_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3_14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, max_window_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3_32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, max_window_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
}  # fmt: skip

# exact counts (equal to HF's num_parameters(); 0.6B's 596,049,920 is also KerasHub's preset count)
EXACT_PARAMS = {
    "qwen3_0_6b": 596_049_920,
    "qwen3_1_7b": 1_720_574_976,
    "qwen3_4b": 4_022_468_096,
    "qwen3_8b": 8_190_735_360,
    "qwen3_14b": 14_768_307_200,
    "qwen3_32b": 32_762_123_264,
}
# headline (total, non-embedding) counts of the Qwen3 model cards on the HF hub, in billions as printed;
# "non-embedding" excludes the embedding table and the untied head
HEADLINE = {
    "qwen3_0_6b": ("0.6", "0.44"),
    "qwen3_1_7b": ("1.7", "1.4"),
    "qwen3_4b": ("4.0", "3.6"),
    "qwen3_8b": ("8.2", "6.95"),
    "qwen3_14b": ("14.8", "13.2"),
    "qwen3_32b": ("32.8", "31.2"),
}


def hub_config(flavor):
    return {**_HUB_COMMON, **HUB_CONFIGS[flavor]}


def close_to_headline(count, printed):
    # within 0.5%, or (rounded small-model headlines: 0.6/1.7/4.0) within half a unit of the last printed digit
    value = float(printed) * 1e9
    half_unit = 0.5 * 10 ** -len(printed.partition(".")[2]) * 1e9
    return abs(count - value) <= max(0.005 * value, half_unit)


@pytest.mark.parametrize("flavor", list(EXACT_PARAMS))
def test_published_flavors_match_hf_on_meta(flavor):
    cfg = qwen3.FLAVORS[flavor]()
    assert hf.config_from_hf(hub_config(flavor)) == cfg  # the flavor is the published config.json
    params = qwen3.model(cfg).init(random.key(0), dtype=torch.bfloat16, device="meta")
    assert all(x.device.type == "meta" for x in tree.leaves(params))
    with torch.device("meta"):
        hm = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**hub_config(flavor)))
    n = tree.size(params)
    assert n == sum(p.numel() for p in hm.parameters()) == EXACT_PARAMS[flavor]
    embedding = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    total, non_embedding = HEADLINE[flavor]
    assert close_to_headline(n, total) and close_to_headline(n - embedding, non_embedding)


def test_flavors_are_registered():
    assert set(qwen3.FLAVORS) == {"debug", *EXACT_PARAMS}
    assert [qwen3.FLAVORS[f]().tie_embeddings for f in EXACT_PARAMS] == [True, True, True, False, False, False]
    cfg = qwen3.Config.qwen3_0_6b()
    assert cfg.n_heads * cfg.head_dim == 2 * cfg.dim  # head_dim is not dim // n_heads
    assert hash(cfg) == hash(qwen3.Config.qwen3_0_6b())


@pytest.mark.parametrize("flavor", ["qwen3_8b", "qwen3_0_6b"])
def test_flops_per_token_counts_matmul_weights(flavor):
    # independent count: every 2-D param except the embedding lookup (the head is the embedding when tied)
    cfg = qwen3.FLAVORS[flavor]()
    m = qwen3.model(cfg)
    params = m.init(random.key(0), device="meta")
    n = sum(x.numel() for p, x in zip(*tree.flatten_with_paths(params)[:2]) if x.dim() == 2 and p != "embed")
    n += params["embed"].numel() if cfg.tie_embeddings else 0
    assert m.flops_per_token(4096) == 6 * n + 6 * cfg.n_layers * 4096 * cfg.n_heads * cfg.head_dim


# ------------------------------------------------------------------ config and params

TINY = qwen3.Config(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=48, max_seq_len=64)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"n_kv_heads": 3}, "not a multiple of n_kv_heads"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
        ({"head_dim": 0}, "head_dim=0"),
        ({"attn_impl": "flash"}, "attn_impl='flash'"),
        ({"ffn_dim": 4.5}, "ffn_dim=4.5"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=f"qwen3.Config.*{message}"):
        attrs.evolve(TINY, **change)


def test_params_tree_layout_and_axes():
    m = qwen3.model(TINY)
    params = m.init(random.key(0))
    assert list(params) == ["embed", "layers", "norm", "head"]
    attn = params["layers"]["0"]["attn"]
    assert set(attn) == {"wq", "wk", "wv", "wo", "q_norm", "k_norm"}
    assert tuple(attn["wq"].shape) == (64, 32) and tuple(attn["wo"].shape) == (32, 64)  # H*Dh = 64 != D = 32
    assert tuple(attn["q_norm"].shape) == tuple(attn["k_norm"].shape) == (16,)
    axes = tree.structure(params).flatten_up_to(m.param_axes)
    assert all(len(ax) == x.dim() for x, ax in zip(tree.leaves(params), axes, strict=True))
    assert m.param_axes["layers"]["1"]["attn"]["k_norm"] == ("norm",)
    assert "head" not in qwen3.model(attrs.evolve(TINY, tie_embeddings=True)).param_axes


# ------------------------------------------------------------------ HF parity

CONFIGS = {
    # GQA, untied, H*Dh (96) != D (64), 11 layers (so "10" follows "9")
    "gqa_untied": qwen3.Config(vocab_size=96, dim=64, n_layers=11, n_heads=4, n_kv_heads=2, head_dim=24,
                               ffn_dim=80, max_seq_len=128, rope_theta=10_000.0),
    # tied, multi-query (KV == 1), Qwen3's rope base
    "mqa_tied": qwen3.Config(vocab_size=80, dim=48, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=16,
                             ffn_dim=64, max_seq_len=64, tie_embeddings=True, norm_eps=1e-5),
}  # fmt: skip


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    hcfg = transformers.Qwen3Config(**{k: v for k, v in hf.config_to_hf(cfg).items() if k != "architectures"})
    m = transformers.Qwen3ForCausalLM._from_config(hcfg, attn_implementation="eager").eval()
    with torch.no_grad():  # HF inits norms to ones; make every weight distinct so mix-ups show
        for name, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.01))
    return m


def ftitan_params(cfg, seed=0):
    params = qwen3.model(cfg).init(random.key(seed))
    g = torch.Generator().manual_seed(seed)
    return tree.map(lambda x: x + 0.1 * torch.randn(x.shape, generator=g) if x.dim() == 1 else x, params)


def hf_logits(m, tokens, position_ids=None):
    with torch.no_grad():
        return m(input_ids=tokens, position_ids=position_ids).logits


def tokens_for(cfg, b=2, t=20, seed=1):
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_to_ftitan(name):
    cfg = CONFIGS[name]
    hm = hf_model(cfg)
    assert hf.config_from_hf(hm.config.to_dict()) == cfg
    params = hf.from_hf(hm.state_dict(), cfg)
    tokens = tokens_for(cfg)
    want = hf_logits(hm, tokens)
    for impl in ("sdpa", "math"):
        got, _ = qwen3.model(attrs.evolve(cfg, attn_impl=impl)).apply(params, tokens)
        assert (got - want).abs().max() <= ATOL, impl
    pos = torch.tensor([[5, 6, 7, 8, 40, 41, 42, 43, 44, 45] * 2, list(range(100, 120))])
    got, _ = qwen3.model(cfg).apply(params, tokens, positions=pos)
    assert (got - hf_logits(hm, tokens, pos)).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ftitan_to_hf(name):
    cfg = CONFIGS[name]
    params = ftitan_params(cfg)
    tokens = tokens_for(cfg)
    got, _ = qwen3.model(cfg).apply(params, tokens)
    hm = hf_model(cfg, seed=123)
    result = hm.load_state_dict(hf.to_hf(params, cfg), strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if cfg.tie_embeddings else [])
    assert (got - hf_logits(hm, tokens)).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_hf_then_from_pretrained_and_load_hf(name, tmp_path):
    cfg = CONFIGS[name]
    params = ftitan_params(cfg)
    tokens = tokens_for(cfg)
    got, _ = qwen3.model(cfg).apply(params, tokens)
    hf.save_hf(params, cfg, tmp_path)
    cfg2, params2 = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(params2), tree.leaves(params), strict=True))
    hm = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hm.config.tie_word_embeddings == cfg.tie_embeddings
    assert (got - hf_logits(hm, tokens)).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_save_pretrained_then_load_hf(name, tmp_path):
    cfg = CONFIGS[name]
    hm = hf_model(cfg)
    hm.save_pretrained(tmp_path)
    cfg2, params = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    got, _ = qwen3.model(cfg2).apply(params, tokens_for(cfg))
    assert (got - hf_logits(hm, tokens_for(cfg))).abs().max() <= ATOL


def test_tied_hub_checkpoint_with_stored_head_loads():
    # Qwen3-0.6B/1.7B/4B files carry lm_head.weight next to the tied embedding; it is skipped
    cfg = CONFIGS["mqa_tied"]
    state = hf.to_hf(ftitan_params(cfg), cfg)
    params = hf.from_hf({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, cfg)
    assert "head" not in params
    with pytest.raises(KeyError, match=r"missing \[model.layers.1.self_attn.k_norm.weight\]"):
        hf.from_hf({k: v for k, v in state.items() if "1.self_attn.k_norm" not in k}, cfg)


def test_config_conversion_refuses_what_qwen3_lacks():
    d = hub_config("qwen3_8b")
    assert hf.config_from_hf(d) == qwen3.Config.qwen3_8b()
    assert hf.config_from_hf(hf.config_to_hf(qwen3.Config.qwen3_8b())) == qwen3.Config.qwen3_8b()
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ValueError, match="qwen3: HF rope type 'yarn'.*drop rope_scaling"):
        hf.config_from_hf({**d, "rope_scaling": yarn})
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        hf.config_from_hf({**d, "use_sliding_window": True, "sliding_window": 4096})
    with pytest.raises(ValueError, match="attention_bias=True"):
        hf.config_from_hf({**d, "attention_bias": True})
    with pytest.raises(ValueError, match=r"lacks \['intermediate_size'\]"):
        hf.config_from_hf({k: v for k, v in d.items() if k != "intermediate_size"})
    assert json.loads(json.dumps(hf.config_to_hf(qwen3.Config.debug())))["head_dim"] == 32


# ------------------------------------------------------------------ training


def test_debug_config_trains_and_compiles():
    cfg = attrs.evolve(qwen3.Config.debug(), n_layers=2)
    m = qwen3.model(cfg)
    params = m.init(random.key(0))
    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    opt = ft.optim.adamw(3e-3)
    step = ft.train.make_train_step(ft.train.next_token_loss(m), opt)
    state = ft.train.init_state(params, opt)
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
    assert losses[-1] < 0.2 * losses[0], losses  # memorizes the batch: ~7.7 -> ~0.02
    # compiled apply equals eager (aot_eager runs the same aten ops; 1e-6 allows decomposition reordering)
    eager, _ = m.apply(state.params, batch["inputs"])
    compiled, _ = torch.compile(m.apply, fullgraph=True, backend="aot_eager")(state.params, batch["inputs"])
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)
