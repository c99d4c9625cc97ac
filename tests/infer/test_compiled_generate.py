"""Compiled generation across models and shapes in one process: eager tokens, one compile per shape.

Every model's decode steps are closures over the same code, and dynamo keeps
compiled graphs, the recompile limit and its automatic-dynamic size profile
per code object. A second model, batch size or prompt length used to count as
a recompile of the first: sizes that differed became symbolic (where the
attention mask check misfired) and after 8 compiles the fullgraph compile
failed. Now each model's steps have their own budget and static shapes, one
graph per (batch size, ``slots_for`` bucket).

The backend here runs dynamo's captured graph as is, counting graphs: the
defect is in dynamo's caching, before any backend, and this keeps the 8
compiles to a few seconds. ``NEW = 3`` runs the decode step only (the greedy
chunk is compiled the same way at 4x the tracing; tests/infer/test_generate.py
compiles it, and the slow test runs the reported inductor case with both).
"""

import importlib

import pytest
import torch
import transformers

import ftitan as ft
from ftitan import tree
from ftitan.infer import generate, slots_for
from ftitan.models import hf, llama, qwen3_moe

LLAMA = llama.Config(vocab_size=96, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=128,
                     rope_theta=10_000.0)  # fmt: skip
QWEN3_MOE = qwen3_moe.Config(vocab_size=80, dim=48, n_layers=1, n_heads=3, n_kv_heads=1, head_dim=16, n_experts=4,
                             top_k=2, expert_dim=16, ffn_dim=32, max_seq_len=128)  # fmt: skip
NEW = 3  # new tokens: 1 from the prefill, then 2 compiled decode steps

# prompt lengths of each generate call: batch sizes 1, 2, 3; slots_for(longest + NEW) buckets 16, 32, 64;
# the last three reuse a (batch size, bucket) an earlier call compiled
REQUESTS = [(5,), (9, 3), (30, 4, 12), (20, 2, 2), (7, 8), (6,), (3, 25, 1)]
SHAPES = {(1, 16), (2, 16), (3, 64), (3, 32)}


class CountingBackend:
    """A dynamo backend that runs the captured graph as is, recording whether each graph it is given has
    symbolic sizes."""

    def __init__(self) -> None:
        self.symbolic: list[bool] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        sizes = [d for x in example_inputs if isinstance(x, torch.Tensor) for d in x.shape]
        self.symbolic.append(any(isinstance(x, torch.SymInt) for x in [*example_inputs, *sizes]))
        return gm


def params_of(model, seed=0):
    params = model.init(ft.random.key(seed))
    g = torch.Generator().manual_seed(seed)
    # norms off 1, weights scaled up and routers far from ties: the greedy paths are not constant
    return tree.map_with_path(
        lambda p, x: x + 0.1 * torch.randn(x.shape, generator=g) if x.dim() == 1 else (25 if "router" in p else 4) * x,
        params,
    )


def test_slot_buckets():
    assert [slots_for(n) for n in (1, 16, 17, 33, 1000, 1024, 1025, 3000)] == [16, 16, 32, 64, 1024, 1024, 2048, 3072]
    with pytest.raises(ValueError, match="n=0"):
        slots_for(0)


def test_many_models_and_shapes_compile_once_each_and_give_the_eager_tokens(monkeypatch):
    # each model gets len(SHAPES) graphs of the one decode-step code object: 8 in all fit only
    # because every model's steps have their own recompile budget
    monkeypatch.setattr(importlib.import_module("ftitan.infer.generate"), "MAX_SHAPES", len(SHAPES))
    g = torch.Generator().manual_seed(0)
    backend = CountingBackend()  # one backend for every model, as with compile=True
    seen = set()
    for cfg in (LLAMA, QWEN3_MOE):
        model = ft.models.registry.model_for(cfg)
        params = params_of(model)
        for lens in REQUESTS:
            prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
            want = generate(model, params, prompts, max_new_tokens=NEW)
            with torch._dynamo.config.patch(recompile_limit=len(SHAPES)):
                assert generate(model, params, prompts, max_new_tokens=NEW, compile=backend) == want, (cfg, lens)
            seen.add((type(cfg), len(lens), slots_for(max(lens) + NEW)))
            assert len(backend.symbolic) == len(seen), (type(cfg).__module__, lens)  # one graph per new shape
    assert {key[1:] for key in seen} == SHAPES and len(seen) == 2 * len(SHAPES)
    assert not any(backend.symbolic)  # static shapes: no model's sizes turned another's graphs symbolic


def test_attention_mask_check_holds_under_symbolic_sizes():
    """The check that failed in the report: a static (B, T, S) mask against keys whose S dynamo made
    symbolic (as automatic dynamic did when a second model compiled); it must compare the sizes."""
    q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 37, 2, 8), torch.randn(2, 37, 2, 8)
    mask = torch.rand(2, 1, 37, generator=torch.Generator().manual_seed(0)) < 0.7
    mask[..., 0] = True  # every query sees a key
    torch._dynamo.maybe_mark_dynamic(k, 1)
    torch._dynamo.maybe_mark_dynamic(v, 1)
    attend = torch.compile(lambda q, k, v, m: ft.nn.attention(q, k, v, causal=False, mask=m), fullgraph=True,
                           backend="eager")  # fmt: skip
    torch.testing.assert_close(attend(q, k, v, mask), ft.nn.attention(q, k, v, causal=False, mask=mask))


def _hf_models():
    torch.manual_seed(0)
    llama_cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=256,
        rope_parameters=dict(rope_type="llama3", rope_theta=10_000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64),
    )  # fmt: skip
    moe_cfg = transformers.Qwen3MoeConfig(
        vocab_size=120, hidden_size=48, num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=3, head_dim=32,
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[0, 1, 2, 4], max_position_embeddings=256,
    )  # fmt: skip
    return [(transformers.LlamaForCausalLM._from_config(llama_cfg), (57, 9)),
            (transformers.Qwen3MoeForCausalLM._from_config(moe_cfg), (21, 6))]  # fmt: skip


@pytest.mark.slow
def test_reported_case_hf_llama_then_qwen3_moe_under_inductor():
    """The report: HF-imported Llama (5 layers, llama3 RoPE) then Qwen3-MoE (dense 0,1,2,4), inductor."""
    g = torch.Generator().manual_seed(1)
    for hm, lens in _hf_models():
        cfg = hf.config_from_hf(hm.config.to_dict())
        model, params = ft.models.registry.model_for(cfg), hf.from_hf(hm.state_dict(), cfg)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
        for new in (16, 9):
            want = generate(model, params, prompts, max_new_tokens=new)
            assert generate(model, params, prompts, max_new_tokens=new, compile=True) == want
