"""LoRA as a model transform: exact at init, adapters-only training, merge, compile, sharding rules.

Tolerances: at init ``B = 0`` so ``W + 0`` is ``W`` bit for bit and the
logits are identical (rtol = atol = 0). Merged vs unmerged after training:
both compute ``W + s * B @ A`` in float32, once inside ``apply`` and once in
``merge``, with the same ops; 1e-5 leaves room for the fused kernels'
ordering differences between two calls.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

import ftitan as ft
from ftitan.models import deepseek_v3, llama, lora

SHRINK: dict[str, Any] = {
    "vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48,
    "n_experts": 4, "top_k": 2, "moe_ffn_dim": 16, "n_groups": 2, "topk_groups": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "max_seq_len": 64,
}  # fmt: skip
FAMILIES = {"llama": llama, "deepseek_v3": deepseek_v3}
RANK, ALPHA = 4, 8.0
B, T = 2, 8


def _base(name: str, **overrides: Any) -> ft.models.Model:
    family = FAMILIES[name]
    cfg = family.Config.debug()
    fields = {f.name for f in attrs.fields(type(cfg))}
    return family.model(attrs.evolve(cfg, **{k: v for k, v in {**SHRINK, **overrides}.items() if k in fields}))


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SHRINK["vocab_size"], (B, T + 1), generator=g)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:].clone()}


def _train(lm: ft.models.Model, params: Any, steps: int = 3) -> tuple[ft.train.TrainState, Any]:
    opt = ft.optim.adamw(1e-2, weight_decay=0.0)
    step = ft.train.make_train_step(
        ft.train.next_token_loss(lm), opt, trainable=lora.TRAINABLE, update_buffers=lm.update_buffers
    )
    state = ft.train.init_state(params, opt, trainable=lora.TRAINABLE)
    for i in range(steps):
        state, _ = step(state, _batch(i))
    return state, step


def test_default_targets():
    assert set(lora.lora(_base("llama"), rank=RANK, alpha=ALPHA).config.paths) == {
        f"layers.{i}.{m}.{w}" for i in range(2) for m, ws in (("attn", "wq wk wv wo"), ("mlp", "w1 w2 w3"))
        for w in ws.split()
    }  # fmt: skip
    paths = set(lora.lora(_base("deepseek_v3"), rank=RANK, alpha=ALPHA).config.paths)
    assert {f"layers.1.attn.{w}" for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")} <= paths
    assert not any("experts" in p or "norm" in p or "router" in p for p in paths)


def test_bad_targets_name_the_leaf():
    with pytest.raises(ValueError, match="experts.w1"):
        lora.lora(_base("deepseek_v3"), rank=RANK, alpha=ALPHA, targets=["layers.*.moe.experts.*"])
    with pytest.raises(ValueError, match="select no 2-D param"):
        lora.lora(_base("llama"), rank=RANK, alpha=ALPHA, targets="nothing.*")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_init_equals_base_exactly(name: str):
    base = _base(name)
    lm = lora.lora(base, rank=RANK, alpha=ALPHA)
    params = lm.init(ft.random.key(0))
    tokens = _batch()["inputs"]
    torch.testing.assert_close(lm.apply(params, tokens)[0], base.apply(base.init(ft.random.key(0)), tokens)[0],
                               rtol=0, atol=0)  # fmt: skip
    a = params["lora"]["layers"]["0"]["attn"]["wo"]["A"]
    assert a.shape[0] == RANK and a.abs().max() > 0  # A random, B zero
    assert not params["lora"]["layers"]["0"]["attn"]["wo"]["B"].any()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_training_touches_adapters_only_and_merge_matches(name: str):
    lm = lora.lora(_base(name), rank=RANK, alpha=ALPHA)
    params = lm.init(ft.random.key(1))
    before = ft.tree.map(torch.clone, params)
    state, _ = _train(lm, params)
    state_paths = ft.tree.paths(state.opt_state)
    assert not [p for p in state_paths if "base." in p]  # no moments for the base leaves
    adapters = ft.tree.size(state.params["lora"])
    assert ft.tree.size(state.opt_state) - 2 * adapters <= 4  # two moments of each adapter, and step counts
    base_paths, base_leaves, _ = ft.tree.flatten_with_paths(state.params["base"])
    for p, new, old in zip(base_paths, base_leaves, ft.tree.leaves(before["base"]), strict=True):
        if not p.endswith("router_bias"):  # DeepSeek-V3's balancing bias moves via update_buffers, by design
            assert torch.equal(new, old), p
    assert state.params["base"]["embed"] is params["base"]["embed"]  # not differentiated: the same tensor
    assert state.params["lora"]["layers"]["0"]["attn"]["wo"]["B"].abs().max() > 0  # the adapters trained
    merged = lora.merge(state.params, scale=lm.config.scale)
    assert ft.tree.structure(merged) == ft.tree.structure(state.params["base"])
    base = _base(name)
    tokens = _batch(7)["inputs"]
    torch.testing.assert_close(base.apply(merged, tokens)[0], lm.apply(state.params, tokens)[0], rtol=1e-5, atol=1e-5)


def test_generate_with_the_lora_model_equals_the_merged_base():
    lm = lora.lora(_base("llama"), rank=RANK, alpha=ALPHA)
    state, _ = _train(lm, lm.init(ft.random.key(1)))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    got = ft.infer.generate(lm, state.params, prompts, max_new_tokens=6)  # greedy
    want = ft.infer.generate(_base("llama"), lora.merge(state.params, scale=lm.config.scale), prompts, max_new_tokens=6)
    assert got == want and lm.config.vocab_size == SHRINK["vocab_size"]


def test_compiled_step_fullgraph():
    lm = lora.lora(_base("llama", n_layers=1), rank=RANK, alpha=ALPHA)  # one layer: compile time is per layer
    params = lm.init(ft.random.key(2))
    opt = ft.optim.adamw(1e-2, weight_decay=0.0)
    step = ft.train.make_train_step(ft.train.next_token_loss(lm), opt, trainable=lora.TRAINABLE)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager = comp = ft.train.init_state(params, opt, trainable=lora.TRAINABLE)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(2):
            eager, em = step(eager, _batch(i))
            comp, cm = compiled(comp, _batch(i))
            torch.testing.assert_close(cm["loss"], em["loss"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(comp.params, eager.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_param_axes_resolve_fsdp_tp(name: str):
    lm = lora.lora(_base(name), rank=RANK, alpha=ALPHA)
    meta = lm.init(ft.random.key(0), device="meta")
    shardings = ft.parallel.resolve(meta, lm.param_axes, ft.parallel.default_rules(), {"dp_shard": 2, "tp": 2})
    placed = ft.parallel.dump(shardings)
    assert placed["lora.layers.0.attn.wo.A"] == "(-, tp)"  # A: (rank, in = heads) follows wo's in dim
    assert placed["lora.layers.0.attn.wo.B"] == "(dp_shard, -)"  # B: (out = embed, rank) follows wo's out dim
    assert placed["base.layers.0.attn.wo"] == "(dp_shard, tp)"


def _trained_lora() -> tuple[ft.models.Model, ft.models.Model, Any]:
    base = _base("llama", n_layers=1)
    lm = lora.lora(base, rank=RANK, alpha=ALPHA)
    params = lm.init(ft.random.key(3))
    g = torch.Generator().manual_seed(0)  # trained-looking adapters: B non-zero
    params["lora"] = ft.tree.map(lambda x: 0.1 * torch.randn(x.shape, generator=g), params["lora"])
    return base, lm, params


def test_peft_round_trip(tmp_path):
    base, lm, params = _trained_lora()
    lora.save_peft(params, lm.config, tmp_path)
    lm2, params2 = lora.load_peft(tmp_path, base, params["base"])
    assert set(lm2.config.paths) == set(lm.config.paths) and lm2.config.scale == lm.config.scale
    torch.testing.assert_close(params2, params, rtol=0, atol=0)


def test_peft_parity(tmp_path):
    """Our adapter files under ``peft.PeftModel`` over the transformers model: float32 logits within
    1e-5 (PEFT adds ``x @ A^T @ B^T`` to the frozen layer's output; we merge into ``W``)."""
    import peft
    import transformers

    base, lm, params = _trained_lora()
    ft.models.save_hf(params["base"], base.config, tmp_path / "base")
    lora.save_peft(params, lm.config, tmp_path / "adapter")
    hm = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    pm = peft.PeftModel.from_pretrained(hm, tmp_path / "adapter").eval()
    tokens = _batch(5)["inputs"]
    with torch.no_grad():
        theirs = pm(input_ids=tokens).logits
    torch.testing.assert_close(lm.apply(params, tokens)[0], theirs, rtol=1e-5, atol=1e-5)
