"""``hf.load_hf_sharded`` without a layout: the same params as ``hf.load_hf``, read leaf by leaf.

Exact equality (``torch.equal``, same dtypes): both convert with the same elementwise casts. Sharded
loads on ranks are tested in tests/parallel/test_init.py (fake and gloo ranks).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import attrs
import pytest
import safetensors.torch
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import ftitan as ft
from ftitan.models import hf
from tests.tiny_families import tiny_config

FAMILIES = sorted(f.name for f in hf.families())


def tiny(name: str, **kw: Any) -> Any:
    return tiny_config(name, **{"n_layers": 3, "n_dense_layers": 1, **kw})


def save(directory: Path, name: str, dtype: torch.dtype, **kw: Any) -> Path:
    cfg = tiny(name, **kw)
    return hf.save_hf(hf.family_of(cfg).model(cfg).init(ft.random.key(4), dtype=dtype), cfg, directory)


def assert_same(a: Any, b: Any) -> None:
    pa, la, _ = ft.tree.flatten_with_paths(a)
    pb, lb, _ = ft.tree.flatten_with_paths(b)
    assert pa == pb
    for p, x, y in zip(pa, la, lb, strict=True):
        assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), p


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FAMILIES)
def test_equals_load_hf_for_every_family(tmp_path, name, stored):
    directory = save(tmp_path, name, stored)
    for dtype in (None, torch.float32, torch.bfloat16):
        cfg, params = hf.load_hf_sharded(directory, dtype=dtype)
        ref_cfg, ref = hf.load_hf(directory, dtype=dtype)
        assert cfg == ref_cfg
        assert_same(params, ref)
        if name == "deepseek_v3":  # as init(dtype=bfloat16) keeps it
            assert params["layers"]["1"]["moe"]["router_bias"].dtype == torch.float32


def test_tied_embeddings(tmp_path):
    directory = save(tmp_path, "qwen3", torch.float32, tie_embeddings=True)
    assert_same(hf.load_hf_sharded(directory)[1], hf.load_hf(directory)[1])


def hf_moe(directory: Path, kind: str) -> Path:
    """A tiny random transformers MoE written by ``save_pretrained`` in three shards (hub per-expert names)."""
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[0])  # fmt: skip
    else:
        config = transformers.DeepseekV3Config(
            vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=0,
            first_k_dense_replace=1, n_group=1, topk_group=1)  # fmt: skip
    m = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b))
    m.save_pretrained(directory, max_shard_size="40KB")
    assert (directory / hf.WEIGHTS_INDEX_FILE).exists()
    return directory


def write_fused(directory: Path, state: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """``state`` (a live transformers-5 ``state_dict``: fused experts) as one safetensors file."""
    directory.mkdir()
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, directory / hf.WEIGHTS_FILE)
    (directory / hf.CONFIG_FILE).write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_transformers_checkpoints_sharded_and_fused(tmp_path, kind):
    hub = hf_moe(tmp_path / "hub", kind)
    cfg, params = hf.load_hf(hub)
    for dtype in (None, torch.bfloat16):
        assert_same(hf.load_hf_sharded(hub, dtype=dtype)[1], hf.load_hf(hub, dtype=dtype)[1])
    # transformers 5's in-memory layout (experts.gate_up_proj / experts.down_proj) as files
    state = hf.to_hf(params, cfg, layout="module")
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    fused = write_fused(tmp_path / "fused", state, json.loads((hub / hf.CONFIG_FILE).read_text()))
    assert_same(hf.load_hf_sharded(fused)[1], params)
    assert_same(hf.load_hf_sharded(fused, dtype=torch.bfloat16)[1], hf.load_hf(fused, dtype=torch.bfloat16)[1])


def _error(fn: Any) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


def test_errors_are_those_of_load_hf(tmp_path):
    directory = save(tmp_path / "ok", "qwen3_moe", torch.float32)
    state = safetensors.torch.load_file(directory / hf.WEIGHTS_FILE)
    config = json.loads((directory / hf.CONFIG_FILE).read_text())
    expert = "model.layers.1.mlp.experts.2.up_proj.weight"
    cases = {
        "missing": {k: v for k, v in state.items() if k != expert},
        "unexpected": {**state, "model.layers.9.mlp.gate.weight": torch.zeros(2)},
        "expert_shape": {**state, expert: torch.zeros(3, 32)},
        "leaf_shape": {**state, "model.norm.weight": torch.zeros(31)},
        "fused_shape": {**state, "model.layers.1.mlp.experts.gate_up_proj": torch.zeros(4, 3, 32)},
    }
    for case, broken in cases.items():
        d = write_fused(tmp_path / case, broken, config)
        got, want = _error(lambda d=d: hf.load_hf_sharded(d)), _error(lambda d=d: hf.load_hf(d))
        assert got == want, case
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / hf.CONFIG_FILE).write_text(json.dumps(config))
        hf.load_hf_sharded(tmp_path / "empty")


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensors that ops create (outputs aliasing no input; meta tensors aside).

    Views of a memory-mapped file (safetensors on the CPU) are not allocations: they alias the file's
    storage (``set_``). A tensor counts until its Python object is collected.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t, ret in zip(outs, func._schema.returns, strict=False):
            if isinstance(t, torch.Tensor) and ret.alias_info is None and t.device.type != "meta":
                n = t.numel() * t.element_size()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, n)
        return out


@pytest.mark.parametrize(("stored", "dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_the_expert_join_never_holds_two_copies(tmp_path, stored, dtype):
    """Peak live bytes of a load (experts 64 x 64 x 48: the largest leaves) are those of the params it
    returns, plus at most one expert's tensor. ``load_hf`` stacks the experts, then casts: the stacked
    copy and the cast one are alive together, and the same count catches it."""
    directory = save(tmp_path, "qwen3_moe", stored, n_experts=64, expert_dim=48, dim=64, n_layers=2)
    one_expert = 48 * 64 * max(stored.itemsize, dtype.itemsize)
    peaks = {}
    for name, load in {"streamed": hf.load_hf_sharded, "load_hf": hf.load_hf}.items():
        with LiveBytes() as mem:
            _, params = load(directory, dtype=dtype)
        peaks[name] = mem.peak - ft.tree.nbytes(params)
        del params
    assert peaks["streamed"] <= one_expert, peaks
    assert peaks["load_hf"] >= 64 * one_expert // 2, peaks  # the old path: a second copy of the experts
