"""RoPE against transformers' Llama implementation (bitwise) and RoPE's defining property."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from ftitan import nn

PUBLISHED = [  # (head_dim, theta, scaling) of Llama 3.1 8B/70B/405B and Llama 3.2 1B/3B
    (128, 500_000.0, nn.Llama3RopeScaling(factor=8.0)),
    (64, 500_000.0, nn.Llama3RopeScaling(factor=32.0)),
    (128, 500_000.0, nn.Llama3RopeScaling(factor=32.0)),
    (16, 10_000.0, nn.Llama3RopeScaling(factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0,
                                         original_max_position_embeddings=64)),  # fmt: skip
    (64, 10_000.0, None),
]


def hf_config(head_dim, theta, scaling):
    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings}  # fmt: skip
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=rope,
                       max_position_embeddings=131_072)  # fmt: skip


@pytest.mark.parametrize("head_dim,theta,scaling", PUBLISHED)
def test_inv_freq_matches_transformers_bitwise(head_dim, theta, scaling):
    cfg = hf_config(head_dim, theta, scaling)
    if scaling is None:
        want, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    torch.testing.assert_close(nn.rope_inv_freq(head_dim, theta, scaling), want, rtol=0, atol=0)


def test_scaling_touches_all_three_bands():
    # with this config the highest frequencies are kept, the lowest divided by factor, the middle blended
    head_dim, theta, scaling = PUBLISHED[0]
    base, scaled = nn.rope_inv_freq(head_dim, theta), nn.rope_inv_freq(head_dim, theta, scaling)
    ratio = base / scaled
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(8.0)
    assert ((ratio > 1.0) & (ratio < 8.0 - 1e-3)).any()


@pytest.mark.parametrize("head_dim,theta,scaling", PUBLISHED[:1] + PUBLISHED[-1:])
def test_cos_sin_and_rotation_match_transformers_bitwise(head_dim, theta, scaling):
    cfg = hf_config(head_dim, theta, scaling)
    positions = torch.tensor([[0, 1, 2, 3, 4000], [7, 8, 9, 10, 100_000]])
    x = torch.randn(2, 5, 3, head_dim)
    hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(x, positions)
    cos, sin = nn.rope_cos_sin(positions, nn.rope_inv_freq(head_dim, theta, scaling))
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=0)
    want, _ = apply_rotary_pos_emb(x, x, hf_cos, hf_sin, unsqueeze_dim=2)
    torch.testing.assert_close(nn.apply_rope(x, cos, sin), want, rtol=0, atol=0)


def test_table_lookup_equals_direct_angles():
    cos_t, sin_t = nn.rope_frequencies(32, 64, 10_000.0, nn.Llama3RopeScaling(original_max_position_embeddings=16))
    assert cos_t.shape == sin_t.shape == (64, 32)
    positions = torch.tensor([[3, 4, 5], [60, 61, 63]])
    x = torch.randn(2, 3, 2, 32)
    inv = nn.rope_inv_freq(32, 10_000.0, nn.Llama3RopeScaling(original_max_position_embeddings=16))
    direct = nn.apply_rope(x, *nn.rope_cos_sin(positions, inv))
    torch.testing.assert_close(nn.apply_rope(x, cos_t, sin_t, positions), direct, rtol=0, atol=0)


@given(m=st.integers(0, 200), n=st.integers(0, 200), shift=st.integers(0, 200))
@settings(max_examples=25, deadline=None)
def test_scores_depend_only_on_relative_position(m, n, shift):
    # <R_m q, R_n k> = <R_{m+s} q, R_{n+s} k>; angles up to 400 rad in fp32 -> atol 1e-4
    g = torch.Generator().manual_seed(m * 1000 + n)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    cos, sin = nn.rope_frequencies(16, 401, 10_000.0)

    def score(a, b):
        qa = nn.apply_rope(q, cos, sin, torch.tensor([a]))
        kb = nn.apply_rope(k, cos, sin, torch.tensor([b]))
        return (qa * kb).sum()

    torch.testing.assert_close(score(m, n), score(m + shift, n + shift), rtol=0, atol=1e-4)
    torch.testing.assert_close(nn.apply_rope(q, cos, sin, torch.tensor([m])).norm(), q.norm(), rtol=1e-6, atol=0)


def test_invalid_scaling_is_refused():
    with pytest.raises(ValueError, match="low_freq_factor"):
        nn.Llama3RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="head_dim=7"):
        nn.rope_inv_freq(7, 10_000.0)


def test_compiled_model_evaluates_cos_sin_once():
    """Every layer rotates q and k by the same tables: a compiled forward + backward evaluates cos and
    sin once, not inside each layer's kernels (as it did when they were returned as separate values)."""
    import attrs
    from torch._inductor.utils import run_and_get_code

    import ftitan as ft
    from ftitan.models import llama

    cfg = attrs.evolve(llama.Config.debug(), vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48,
                       max_seq_len=16)  # fmt: skip
    model = llama.model(cfg)
    params = model.init(ft.random.key(0))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grad_fn = torch.func.grad_and_value(ft.train.next_token_loss(model), has_aux=True)
    torch._dynamo.reset()
    (_, (loss, _)), codes = run_and_get_code(torch.compile(grad_fn, fullgraph=True), params,
                                             {"inputs": tokens, "targets": tokens})  # fmt: skip
    torch.testing.assert_close(loss, grad_fn(params, {"inputs": tokens, "targets": tokens})[1][0])
    src = "\n".join(codes)
    assert (src.count(".cos()"), src.count(".sin()")) == (1, 1), "cos/sin evaluated more than once"
