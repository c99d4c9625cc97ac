"""HF interop edges against live transformers 5 models: fused in-memory experts both ways, zero shared
experts, and HF config defaults that ftitan cannot take.

The references are transformers' own classes built from their own configs (not from ftitan's
``config_to_hf``). Tolerance: max abs logit difference <= 1e-5 in float32, as the families'
parity tests (same math, different summation orders on O(1) logits).
"""

import pytest
import torch
import transformers

from ftitan import tree
from ftitan.models import hf, registry

ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls; a second thread only contends with other jobs
    yield
    torch.set_num_threads(threads)


def qwen3_moe_config(**kw):
    return transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], **kw,
    )  # fmt: skip


def deepseek_v3_config(**kw):
    return transformers.DeepseekV3Config(**{
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 0, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        **kw,
    })  # fmt: skip


def live(config, seed=0):
    """A transformers model from ``config`` with every weight off its init (distinct norms, routers off ties)."""
    torch.manual_seed(seed)
    cls = transformers.AutoModelForCausalLM.from_config(config).__class__
    m = cls._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.5 if "mlp.gate." in name else 0.05))
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return m


def logits(m, tokens):
    with torch.no_grad():
        return m(input_ids=tokens).logits


TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
CASES = {
    "qwen3_moe": lambda: qwen3_moe_config(),
    "qwen3_moe_tied": lambda: qwen3_moe_config(tie_word_embeddings=True),
    "deepseek_v3_no_shared": lambda: deepseek_v3_config(),
    "deepseek_v3_shared": lambda: deepseek_v3_config(n_shared_experts=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_live_state_dict_round_trip(name):
    hm = live(CASES[name]())
    state = hm.state_dict()
    assert any(k.endswith("experts.gate_up_proj") and v.dim() == 3 for k, v in state.items())  # fused in memory
    cfg = hf.config_from_hf(hm.config.to_dict())
    params = hf.from_hf(state, cfg)
    got, _ = registry.model_for(cfg).apply(params, TOKENS)
    want = logits(hm, TOKENS)
    assert (got - want).abs().max() <= ATOL
    # back into another live model: strict, every tensor replaced
    other = live(hm.config, seed=1)
    assert (logits(other, TOKENS) - want).abs().max() > 1e-2
    other.load_state_dict(hf.to_hf(params, cfg, layout="module"), strict=True)
    assert (logits(other, TOKENS) - want).abs().max() <= ATOL
    # the hub layout (what save_pretrained writes) holds the same values, per expert
    hub = hf.to_hf(params, cfg)
    assert not any("gate_up_proj" in k for k in hub) and any(".experts.3.up_proj.weight" in k for k in hub)
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(hf.from_hf(hub, cfg)), tree.leaves(params), strict=True))


def test_zero_shared_experts_through_files(tmp_path):
    hm = live(deepseek_v3_config())
    hm.save_pretrained(tmp_path / "hf")  # zero-size shared-expert tensors in the file
    cfg, params = hf.load_hf(tmp_path / "hf")
    assert cfg.n_shared_experts == 0
    want = logits(hm, TOKENS)
    assert (registry.model_for(cfg).apply(params, TOKENS)[0] - want).abs().max() <= ATOL
    hf.save_hf(params, cfg, tmp_path / "ft")
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ft", attn_implementation="eager").eval()
    assert (logits(back, TOKENS) - want).abs().max() <= ATOL


def test_refusals_name_the_field_and_the_fix():
    d = deepseek_v3_config().to_dict()
    # transformers fills num_key_value_heads=128 when a DeepseekV3Config is built without it
    unset = transformers.DeepseekV3Config(**{k: v for k, v in d.items() if k != "num_key_value_heads"}).to_dict()
    assert unset["num_key_value_heads"] == 128
    with pytest.raises(ValueError, match=r"num_key_value_heads=128 != num_attention_heads=4.*set num_key_value_heads=4"):
        hf.config_from_hf(unset)
    # a config.json without the field means "as many as the heads"
    assert hf.config_from_hf({k: v for k, v in d.items() if k != "num_key_value_heads"}).n_heads == 4
    cfg = hf.config_from_hf(d)
    state = live(deepseek_v3_config()).state_dict()
    filled = {**state, "model.layers.2.mlp.shared_experts.up_proj.weight": torch.zeros(16, 32)}
    with pytest.raises(ValueError, match=r"shared_experts.up_proj.weight: checkpoint shape \(16, 32\).*empty \(0, 32\)"):
        hf.from_hf(filled, cfg)
    bad = {**state, "model.layers.1.mlp.experts.down_proj": torch.zeros(4, 32)}
    with pytest.raises(ValueError, match=r"experts.down_proj: shape \(4, 32\)"):
        hf.from_hf(bad, cfg)
    with pytest.raises(ValueError, match=r"layout='flat'"):
        hf.to_hf(hf.from_hf(state, cfg), cfg, layout="flat")


def test_dtype_keeps_float32_leaves():
    hm = live(deepseek_v3_config())
    cfg = hf.config_from_hf(hm.config.to_dict())
    params = hf.from_hf(hm.state_dict(), cfg, dtype=torch.bfloat16)
    flat = dict(zip(*tree.flatten_with_paths(params)[:2], strict=True))
    assert flat["layers.1.moe.router_bias"].dtype == torch.float32  # as init(dtype=bfloat16) keeps it
    assert flat["layers.1.moe.experts.w1"].dtype == torch.bfloat16 and flat["embed"].dtype == torch.bfloat16
