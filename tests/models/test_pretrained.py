"""``ft.models.from_pretrained``: HF directories (``save_pretrained``'s files) and ftitan run directories
in one call; ``Model``'s one-line repr.

HF parity tolerance: max abs logit difference <= 1e-5 in float32 (same math, different summation orders).
"""

import json

import pytest
import torch
import transformers

import ftitan as ft
from ftitan import tree
from ftitan.models import llama
from ftitan.train.trainer import train

ATOL = 1e-5
TOKENS = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))


def hf_qwen3_moe(directory):
    """A tiny random transformers Qwen3-MoE written with ``save_pretrained``; returns the live model."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=40, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
    )  # fmt: skip
    m = transformers.Qwen3MoeForCausalLM._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.5 if "mlp.gate." in name else 0.05))
    m.save_pretrained(directory)
    return m


def test_hf_directory(tmp_path):
    hm = hf_qwen3_moe(tmp_path)
    model, params = ft.models.from_pretrained(tmp_path)
    with torch.no_grad():
        want = hm(input_ids=TOKENS).logits
    assert (model.apply(params, TOKENS)[0] - want).abs().max() <= ATOL
    assert repr(model) == "Model(qwen3_moe, vocab=96, dim=32, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, " \
                          f"params={tree.size(params) / 1e3:.1f}K)"  # fmt: skip
    _, half = ft.models.from_pretrained(tmp_path, dtype="bfloat16", device="cpu")
    assert {x.dtype for x in tree.leaves(half)} == {torch.bfloat16}
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(tree.leaves(params), tree.leaves(half), strict=True))


def test_run_directory_gives_what_generate_run_loads(tmp_path, tiny_run_cfg):
    cfg, run = tiny_run_cfg, tmp_path / "run"
    trained = train(cfg, progress=False)["params"]
    model, params = ft.models.from_pretrained(run, dtype=torch.bfloat16)  # load_run's params, as `generate --run`
    assert model.config == cfg.model and isinstance(model.config, llama.Config)
    assert {x.dtype for x in tree.leaves(params)} == {torch.bfloat16}
    assert all(torch.equal(a, b.to(torch.bfloat16)) for a, b in zip(tree.leaves(params), tree.leaves(trained),
                                                                     strict=True))  # fmt: skip
    assert not all(torch.equal(a, b) for a, b in zip(tree.leaves(trained), tree.leaves(model.init(ft.random.key(
        cfg.seed))), strict=True))  # fmt: skip  (the trained weights, not a fresh init)


def test_neither_kind_of_directory_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        ft.models.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"neither an HF model directory .* nor an ftitan run directory"):
        ft.models.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))  # no model_type, not a run's config
    with pytest.raises(ValueError, match="neither"):
        ft.models.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **ft.models.config_to_hf(
        llama.Config.debug())}))  # fmt: skip
    with pytest.raises(FileNotFoundError, match="model.safetensors"):  # an HF config without its weights
        ft.models.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"dtype='int8' is not a floating-point torch dtype"):
        ft.models.from_pretrained(tmp_path, dtype="int8")


def test_model_repr_is_one_line_without_functions():
    text = repr(llama.model(llama.Config.debug()))
    assert text == "Model(llama, vocab=2048, dim=256, layers=4, heads=8, kv_heads=2, params=4.07M)"
    assert "\n" not in text and "function" not in text and " at 0x" not in text
