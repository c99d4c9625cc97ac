"""The trainer's distributed Muon, on one process: its per-head blocks, its block placement's rules, and its
single-process path (plain tensors: what every rank computes when nothing is split) against ``ft.optim.muon``.
The distributed path is checked on gloo ranks in ``tests/parallel/test_flexshard.py``."""

from __future__ import annotations

import attrs
import torch

import ftitan as ft
from ftitan import parallel
from ftitan.flexshard import mesh as mm
from ftitan.models import deepseek_v3, llama


def _llama():
    return llama.model(attrs.evolve(llama.Config.debug(), vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    ffn_dim=128))  # fmt: skip


def test_head_blocks_cut_every_attention_projection_per_head():
    blocks = mm.head_blocks(_llama())  # head_dim 16: rows of q / k / v, columns of o
    assert blocks == {"layers.*.attn.wq": (-2, 16), "layers.*.attn.wk": (-2, 16), "layers.*.attn.wv": (-2, 16),
                      "layers.*.attn.wo": (-1, 16)}  # fmt: skip
    cfg = deepseek_v3.Config.debug()  # MLA: q heads of qk_nope + qk_rope, kv heads of qk_nope + v, o of v
    blocks = mm.head_blocks(deepseek_v3.model(cfg))
    assert blocks == {"layers.*.attn.wq_b": (-2, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
                      "layers.*.attn.wkv_b": (-2, cfg.qk_nope_head_dim + cfg.v_head_dim),
                      "layers.*.attn.wo": (-1, cfg.v_head_dim)}  # fmt: skip


def test_single_process_path_is_optim_muon_bit_for_bit():
    model = _llama()
    params = model.init(ft.random.key(0))
    blocks = mm.head_blocks(model)
    g = torch.Generator().manual_seed(1)
    grads = [ft.tree.map(lambda x: torch.randn(x.shape, generator=g), params) for _ in range(2)]
    kw = dict(lr=0.02, adamw_lr=1e-3, blocks=blocks, nesterov_style="optax")
    ref_opt, opt = ft.optim.muon_with_adamw(params, **kw), mm.mesh_muon_with_adamw(None, params, **kw)
    a, b = params, params
    sa, sb = ref_opt.init(a), opt.init(b)
    for gr in grads:
        ua, sa = ref_opt.update(gr, sa, a)
        ub, sb = opt.update(gr, sb, b)
        a, b = ft.optim.apply_updates(a, ua), ft.optim.apply_updates(b, ub)
    assert all(torch.equal(x, y) for x, y in zip(ft.tree.leaves(a), ft.tree.leaves(b), strict=True))
    assert all(torch.equal(x, y) for x, y in zip(ft.tree.leaves(sa), ft.tree.leaves(sb), strict=True))
    assert not torch.equal(a["layers"]["0"]["attn"]["wq"], params["layers"]["0"]["attn"]["wq"])


def test_block_rules_store_whole_heads_and_experts_over_dp_shard():
    model = _llama()
    shapes = model.init(ft.random.key(0), device="meta")
    sizes = {"dp_shard": 4}
    rules = mm.block_rules(parallel.default_rules(), model, sizes)
    placed = parallel.dump(parallel.resolve(shapes, model.param_axes, rules, sizes))
    assert placed["layers.0.attn.wq"] == "(dp_shard, -)" and placed["layers.0.attn.wo"] == "(-, dp_shard)"
    assert placed["layers.0.mlp.w1"] == "(-, dp_shard)"  # no heads: the model dim, as before
    assert rules.mesh_axes("experts") == ("ep", "dp_shard")
    # with tp the heads dim is tp's (dp_shard is outer to tp on a shared dim: the blocks would interleave)
    tp_rules = mm.block_rules(parallel.default_rules(), model, {"dp_shard": 2, "tp": 2})
    assert tp_rules.overrides == () and tp_rules.mesh_axes("heads") == ("tp",)
    assert mm.block_rules(parallel.default_rules(), model, {"dp_shard": 2, "ep": 2}).mesh_axes("experts") == ("ep",)
