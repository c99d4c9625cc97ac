"""Linear, embedding, SwiGLU and parameter specs: values, axes, init determinism."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from ftitan import nn, random, tree


def test_linear_is_x_w_transpose_plus_b():
    x, w, b = torch.randn(2, 3, 5), torch.randn(4, 5), torch.randn(4)
    torch.testing.assert_close(nn.linear(x, w, b), x @ w.T + b)
    torch.testing.assert_close(nn.linear(x, w), x @ w.T)


def test_embed_gathers_rows():
    table = torch.randn(10, 4)
    tokens = torch.tensor([[1, 9], [0, 1]])
    torch.testing.assert_close(nn.embed(tokens, table), table[tokens], rtol=0, atol=0)


def test_swiglu_matches_llama_mlp():
    # silu is written out as x * sigmoid(x) (see nn/mlp.py), HF calls the fused
    # kernel: a few float32 ulps apart, so rtol 1e-6 (bf16/HF parity needs 1e-5)
    ref = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=2))
    x = torch.randn(2, 3, 16)
    p = {"w1": ref.gate_proj.weight, "w2": ref.down_proj.weight, "w3": ref.up_proj.weight}
    with torch.no_grad():
        torch.testing.assert_close(nn.swiglu(x, **p), ref(x), rtol=1e-6, atol=1e-7)


def test_specs_give_shapes_and_axes():
    specs = {"mlp": nn.swiglu_params(16, 40), "emb": nn.embed_param(100, 16), "n": nn.norm_param(16),
             "b": nn.bias_param(40, axis="mlp")}  # fmt: skip
    assert nn.shapes(specs)["mlp"] == {"w1": (40, 16), "w2": (16, 40), "w3": (40, 16)}
    assert nn.axes(specs)["mlp"]["w2"] == ("embed", "mlp")
    assert nn.axes(specs)["emb"] == ("vocab", "embed")
    assert nn.axes(specs)["n"] == ("norm",)
    params = nn.init(specs, random.key(0))
    assert tree.map(lambda x: tuple(x.shape), params) == nn.shapes(specs)
    torch.testing.assert_close(params["n"], torch.ones(16), rtol=0, atol=0)
    torch.testing.assert_close(params["b"], torch.zeros(40), rtol=0, atol=0)


def test_init_is_deterministic_and_path_keyed():
    specs = {"a": {"w": nn.linear_param(8, 6, axes=("mlp", "embed"))}, "z": nn.embed_param(5, 8)}
    k = random.key(3)
    p1, p2 = nn.init(specs, k), nn.init(specs, k)
    for x, y in zip(tree.leaves(p1), tree.leaves(p2), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    # a leaf is drawn from fold_in(key, its path) and nothing else
    alone = nn.init(specs["a"]["w"], random.fold_in(k, "a.w"))
    torch.testing.assert_close(p1["a"]["w"], alone, rtol=0, atol=0)
    assert not torch.equal(nn.init(specs, random.key(4))["a"]["w"], p1["a"]["w"])


def test_truncated_init_respects_bound_and_std():
    w = nn.init_linear(random.key(0), 256, 512, std=0.02)
    assert w.shape == (512, 256)
    assert w.abs().max() <= 0.06 + 1e-7
    assert 0.017 < w.std() < 0.021  # truncation at 3 std shrinks std by ~1.3%


def test_meta_init_allocates_nothing_and_keeps_dtype():
    p = nn.init_swiglu(random.key(0), 4096, 14336, dtype=torch.bfloat16, device="meta")
    assert all(x.device.type == "meta" and x.dtype == torch.bfloat16 for x in tree.leaves(p))


def test_param_spec_validation():
    with pytest.raises(ValueError, match="one logical axis"):
        nn.Param(shape=(3, 4), axes=("embed",), init=nn.zeros_init)
    with pytest.raises(TypeError, match="nn.Param"):
        nn.init({"w": torch.zeros(3)}, random.key(0))
