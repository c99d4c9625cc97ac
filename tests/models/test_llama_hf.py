"""Llama <-> transformers.LlamaForCausalLM: logits parity both ways, on disk, and import errors.

Tolerance: max abs logit difference <= 1e-5 in float32. Both sides run the
same float32 math (ftitan SDPA or explicit softmax vs HF eager attention);
1e-5 leaves room for different summation orders on O(1) logits.
"""

import json

import attrs
import pytest
import safetensors.torch
import torch
import transformers

from ftitan import random, tree
from ftitan.models import hf, llama

ATOL = 1e-5

CONFIGS = {
    # GQA, untied, Llama-3 scaling hitting all three frequency bands, 11 layers (so "10" follows "9")
    "gqa_untied_scaled": llama.Config(
        vocab_size=96, dim=64, n_layers=11, n_heads=4, n_kv_heads=2, ffn_dim=80, max_seq_len=128,
        rope_theta=10_000.0, rope_scaling=llama.Llama3RopeScaling(factor=8.0, original_max_position_embeddings=64),
    ),
    # tied, multi-head (KV == H), plain RoPE
    "mha_tied": llama.Config(
        vocab_size=80, dim=48, n_layers=2, n_heads=3, n_kv_heads=3, ffn_dim=64, max_seq_len=64,
        rope_theta=10_000.0, tie_embeddings=True, norm_eps=1e-6,
    ),
    # tied, multi-query (KV == 1), Llama 3.2 style scaling
    "mqa_tied_scaled": llama.Config(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=96, max_seq_len=256,
        rope_scaling=llama.Llama3RopeScaling(factor=32.0, original_max_position_embeddings=32),
        tie_embeddings=True,
    ),
}  # fmt: skip


def hf_model(cfg: llama.Config, seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    hcfg = transformers.LlamaConfig(**{k: v for k, v in hf.config_to_hf(cfg).items() if k != "architectures"})
    m = transformers.LlamaForCausalLM._from_config(hcfg, attn_implementation="eager").eval()
    with torch.no_grad():  # HF inits norms to ones; make every weight distinct so mix-ups show
        for name, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.01))
    return m


def ftitan_params(cfg: llama.Config, seed: int = 0):
    params = llama.model(cfg).init(random.key(seed))
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
        got, _ = llama.model(attrs.evolve(cfg, attn_impl=impl)).apply(params, tokens)
        assert (got - want).abs().max() <= ATOL, impl
    # positions: HF position_ids and ftitan positions place tokens the same way
    pos = torch.tensor([[5, 6, 7, 8, 40, 41, 42, 43, 44, 45] * 2, list(range(100, 120))])
    got, _ = llama.model(cfg).apply(params, tokens, positions=pos)
    assert (got - hf_logits(hm, tokens, pos)).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ftitan_to_hf(name):
    cfg = CONFIGS[name]
    params = ftitan_params(cfg)
    tokens = tokens_for(cfg)
    got, _ = llama.model(cfg).apply(params, tokens)
    hm = hf_model(cfg, seed=123)
    result = hm.load_state_dict(hf.to_hf(params, cfg), strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if cfg.tie_embeddings else [])
    if cfg.tie_embeddings:
        assert hm.lm_head.weight is hm.model.embed_tokens.weight
    assert (got - hf_logits(hm, tokens)).abs().max() <= ATOL


@pytest.mark.parametrize("name", ["gqa_untied_scaled", "mqa_tied_scaled"])
def test_save_load_round_trip_and_from_pretrained(name, tmp_path):
    cfg = CONFIGS[name]
    params = ftitan_params(cfg)
    tokens = tokens_for(cfg)
    got, _ = llama.model(cfg).apply(params, tokens)
    hf.save_hf(params, cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # no temp files
    cfg2, params2 = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    for a, b in zip(tree.leaves(params2), tree.leaves(params), strict=True):
        assert torch.equal(a, b)
    hm = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hm.config.tie_word_embeddings == cfg.tie_embeddings
    assert (got - hf_logits(hm, tokens)).abs().max() <= ATOL
    _, bf = hf.load_hf(tmp_path, dtype=torch.bfloat16)
    assert all(x.dtype == torch.bfloat16 for x in tree.leaves(bf))


def test_hf_save_pretrained_loads(tmp_path):
    cfg = CONFIGS["mha_tied"]
    hm = hf_model(cfg)
    hm.save_pretrained(tmp_path)
    cfg2, params = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    tokens = tokens_for(cfg)
    got, _ = llama.model(cfg2).apply(params, tokens)
    assert (got - hf_logits(hm, tokens)).abs().max() <= ATOL


def test_sharded_checkpoint_loads(tmp_path):
    cfg = CONFIGS["mha_tied"]
    params = ftitan_params(cfg)
    state = {k: v.contiguous() for k, v in hf.to_hf(params, cfg).items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        safetensors.torch.save_file({k: state[k] for k in keys}, tmp_path / file)
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(cfg)))
    _, loaded = hf.load_hf(tmp_path)
    for a, b in zip(tree.leaves(loaded), tree.leaves(params), strict=True):
        assert torch.equal(a, b)


def test_import_errors_name_the_tensors():
    cfg = CONFIGS["mha_tied"]
    state = hf.to_hf(ftitan_params(cfg), cfg)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(KeyError, match=r"missing \[model.layers.1.mlp.up_proj.weight\]"):
        hf.from_hf(missing, cfg)
    with pytest.raises(KeyError, match=r"unexpected \[model.layers.2.mlp.up_proj.weight\]"):
        hf.from_hf({**state, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)}, cfg)
    wrong = {**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 48)}
    with pytest.raises(ValueError, match=r"layers.0.attn.wk .*k_proj.*\(16, 48\).*\(48, 48\)"):
        hf.from_hf(wrong, cfg)
    # ignored: rotary buffers of old exports, and a tied head some exports still carry
    extra = {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8), "lm_head.weight": torch.zeros(1)}
    hf.from_hf(extra, cfg)


def test_config_conversion():
    cfg = llama.Config.llama3_1_8b()
    d = hf.config_to_hf(cfg)
    assert d["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}  # fmt: skip
    assert hf.config_from_hf(d) == cfg
    # transformers 4.x / Meta's HF export format: rope_theta + rope_scaling
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"}
    legacy |= {"rope_theta": 500_000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}  # fmt: skip
    assert hf.config_from_hf(legacy) == cfg
    with pytest.raises(ValueError, match="attention_bias=True"):
        hf.config_from_hf({**d, "attention_bias": True})
    with pytest.raises(ValueError, match="'yarn'"):
        hf.config_from_hf({**d, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ValueError, match="no HF family registered for 'gpt2'"):
        hf.config_from_hf({**d, "model_type": "gpt2"})
