"""YaRN RoPE and Multi-head Latent Attention against transformers' DeepSeek-V3 and DeepSeek's own rotation.

Tolerances: YaRN frequencies and cos/sin are bitwise (same float32 ops as
transformers). The attention layer is compared at 1e-6 absolute on O(0.1)
outputs: same float32 math, different matmul/softmax summation orders.
"""

import math

import attrs
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from ftitan import nn, random
from ftitan.nn import mla as M
from ftitan.nn.rope import YarnRopeScaling, rope_attention_factor, rope_inv_freq, yarn_mscale

YARNS = [  # (rope head dim, theta, scaling): DeepSeek-V3, Kimi K2, Kimi K2.5, and small ones hitting every branch
    (64, 10_000.0, YarnRopeScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)),
    (64, 50_000.0, YarnRopeScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                                   mscale=1.0, mscale_all_dim=1.0)),
    (64, 50_000.0, YarnRopeScaling(factor=64.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)),
    (16, 10_000.0, YarnRopeScaling(factor=4.0, original_max_position_embeddings=64)),
    (16, 10_000.0, YarnRopeScaling(factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0,
                                   truncate=False)),
    (16, 10_000.0, YarnRopeScaling(factor=8.0, original_max_position_embeddings=64, attention_factor=0.5)),
]  # fmt: skip


def yarn_hf_config(head_dim, theta, s, **kw):
    rope = {"rope_type": "yarn", "rope_theta": theta, **{k: v for k, v in attrs.asdict(s).items() if v is not None}}
    return transformers.DeepseekV3Config(
        qk_rope_head_dim=head_dim, rope_parameters=rope,
        max_position_embeddings=int(s.original_max_position_embeddings * s.factor), **kw,
    )  # fmt: skip


@pytest.mark.parametrize("head_dim,theta,scaling", YARNS)
def test_yarn_inv_freq_and_attention_factor_match_transformers_bitwise(head_dim, theta, scaling):
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](yarn_hf_config(head_dim, theta, scaling))
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, scaling), want, rtol=0, atol=0)
    assert rope_attention_factor(scaling) == factor


def test_yarn_keeps_fast_dims_and_interpolates_slow_ones():
    head_dim, theta, s = YARNS[0]
    ratio = rope_inv_freq(head_dim, theta) / rope_inv_freq(head_dim, theta, s)
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(40.0)
    assert ((ratio > 1.0) & (ratio < 40.0 - 1e-3)).any()
    assert rope_attention_factor(s) == 1.0 and rope_attention_factor(None) == 1.0


@pytest.mark.parametrize(
    "change,message",
    [({"factor": 0.5}, "factor=0.5"), ({"beta_fast": 0.5}, "beta_slow"), ({"mscale": 0.0}, "mscale=0.0"),
     ({"original_max_position_embeddings": 0}, "original_max_position_embeddings=0")],
)  # fmt: skip
def test_yarn_validation(change, message):
    with pytest.raises(ValueError, match=message):
        YarnRopeScaling(**{"factor": 4.0, "original_max_position_embeddings": 64, **change})


CFG = M.MLAConfig(n_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
YARN = YarnRopeScaling(factor=4.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=1.0)


def test_softmax_scale_includes_yarn_mscale():
    assert CFG.softmax_scale == 16**-0.5
    v3 = attrs.evolve(CFG, rope_scaling=YARNS[0][2])
    assert v3.softmax_scale == pytest.approx(16**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert yarn_mscale(1.0, 5.0) == 1.0


@pytest.mark.parametrize(
    "change,message",
    [({"qk_rope_head_dim": 7}, "must be even"), ({"q_lora_rank": 0}, "q_lora_rank=0"),
     ({"attn_impl": "flash"}, "attn_impl"), ({"rope_scaling": {"factor": 4}}, "YarnRopeScaling")],
)  # fmt: skip
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        attrs.evolve(CFG, **change)


def hf_attention(cfg: M.MLAConfig, dim: int):
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta,
                **{k: v for k, v in attrs.asdict(cfg.rope_scaling).items() if v is not None}}  # fmt: skip
    hcfg = transformers.DeepseekV3Config(
        hidden_size=dim, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_parameters=rope,
        rope_interleave=cfg.rope_interleave, max_position_embeddings=64,
    )  # fmt: skip
    hcfg._attn_implementation = "eager"
    return hf_ds.DeepseekV3Attention(hcfg, layer_idx=0), hf_ds.DeepseekV3RotaryEmbedding(hcfg)


HF_NAMES = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
            "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
            "wo": "o_proj"}  # fmt: skip


@pytest.mark.parametrize(
    "cfg",
    [CFG, attrs.evolve(CFG, q_lora_rank=None), attrs.evolve(CFG, rope_scaling=YARN),
     attrs.evolve(CFG, rope_interleave=False, attn_impl="math")],
    ids=["q_lora", "plain_q", "yarn", "rotate_half_math"],
)  # fmt: skip
def test_mla_matches_transformers_attention(cfg):
    dim = 32
    attn, rotary = hf_attention(cfg, dim)
    params = M.init_mla(random.key(0), dim, cfg, std=0.2)
    g = torch.Generator().manual_seed(0)
    params = {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.dim() == 1 else v for k, v in params.items()}
    attn.load_state_dict({f"{HF_NAMES[k]}.weight": v for k, v in params.items()})
    x = torch.randn(2, 11, dim, generator=g)
    positions = torch.tensor([list(range(11)), [3, 4, 5, 6, 7, 30, 31, 32, 33, 34, 60]])
    hf_cos, hf_sin = rotary(x, positions)
    cos, sin = M.mla_rope(positions, cfg)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=0)
    mask = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = attn(x, (hf_cos, hf_sin), mask)
    got = M.mla(x, params, cos, sin, cfg)
    assert want.abs().max() > 0.05
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_interleaved_rope_is_deepseeks_complex_rotation():
    # DeepSeek's reference rotates pairs (x0, x1), (x2, x3), ... as complex numbers and keeps them interleaved;
    # ftitan's output is that result with evens and odds gathered (the same permutation for q and k)
    d, positions = 16, torch.arange(9)
    x = torch.randn(1, 9, 2, d)
    inv_freq = rope_inv_freq(d, 10_000.0)
    freqs_cis = torch.polar(torch.ones(9, d // 2), torch.outer(positions.float(), inv_freq))
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(1, 9, 2, d // 2, 2)) * freqs_cis[None, :, None])
    ref = ref.flatten(-2)
    cos, sin = M.mla_rope(positions, attrs.evolve(CFG, qk_rope_head_dim=d))
    got = M._rope(x, cos, sin, interleave=True)
    torch.testing.assert_close(got, torch.cat((ref[..., 0::2], ref[..., 1::2]), -1), rtol=0, atol=1e-6)


def test_attention_with_narrower_values_sdpa_math_agree_and_are_causal():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 7, 3, 10, generator=g), torch.randn(2, 7, 3, 10, generator=g)
    v = torch.randn(2, 7, 3, 4, generator=g)  # narrower values than keys, as in MLA
    a = nn.attention(q, k, v, scale=0.3, impl="sdpa")
    b = nn.attention(q, k, v, scale=0.3, impl="math")
    assert a.shape == (2, 7, 3, 4)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    v2 = v.clone()
    v2[:, 4:] += 1.0  # future values do not leak into earlier queries
    torch.testing.assert_close(nn.attention(q, k, v2, scale=0.3)[:, :4], a[:, :4], rtol=0, atol=1e-6)
    # fewer queries than keys (a cache): bottom-right aligned, same as the last rows of the full product
    tail = nn.attention(q[:, 5:], k, v, scale=0.3, impl="math")
    torch.testing.assert_close(tail, b[:, 5:], rtol=0, atol=1e-6)
    torch.testing.assert_close(nn.attention(q[:, 5:], k, v, scale=0.3), b[:, 5:], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="impl='flash'"):
        nn.attention(q, k, v, scale=0.3, impl="flash")  # type: ignore[arg-type]


def test_params_shapes_and_axes():
    p = M.mla_params(32, CFG)
    assert {k: v.shape for k, v in p.items()} == {
        "wq_a": (24, 32), "q_norm": (24,), "wq_b": (64, 24), "wkv_a": (24, 32), "kv_norm": (16,),
        "wkv_b": (80, 16), "wo": (32, 48)}  # fmt: skip
    assert p["wkv_a"].axes == ("kv_lora", "embed") and p["wq_b"].axes == ("heads", "q_lora")
    plain = M.mla_params(32, attrs.evolve(CFG, q_lora_rank=None))
    assert plain["wq"].shape == (64, 32) and "wq_a" not in plain
