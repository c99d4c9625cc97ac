"""Per-rank init and streaming HF loads on real gloo ranks (merged into the ``_parity.py`` launch, 4 ranks).

Each check compares this rank's DTensors from ``parallel.init_params`` / ``hf.load_hf_sharded`` /
``from_pretrained(layout=)`` with ``shard_params`` of the single-process tensors (the stage only under
pp): placements, global shape and stride, dtype, device and bit-equal local values. Mismatches are
counted over every rank (all-reduced). Run alone:
``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py init_dp_shard2_tp2_llama``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import ftitan as ft
from ftitan import parallel
from ftitan.models import deepseek_v3, hf, llama, qwen3_moe

# the launch script's directory is on sys.path (torchrun runs tests/parallel/_parity.py)
from _checks_ep import tiny_deepseek_v3, tiny_qwen3_moe
from _fake_ranks import expected as _expected
from _fake_ranks import mismatches, write_index_sharded
from _parity import tiny_llama

torch.set_num_threads(1)

MODELS = {"llama": (llama, tiny_llama), "qwen3_moe": (qwen3_moe, tiny_qwen3_moe),
          "deepseek_v3": (deepseek_v3, tiny_deepseek_v3)}  # fmt: skip


def _result(name: str, bad: list[str], got) -> dict:
    n = torch.tensor([len(bad)])
    dist.all_reduce(n)
    local = sum(x.to_local().numel() for x in ft.tree.leaves(got))
    return {"check": name, "n_bad": int(n), "bad": bad[:6], "leaves": len(ft.tree.leaves(got)), "local_numel": local}


def init_check(name: str, family: str, degrees: dict[str, int], dtype: torch.dtype = torch.float32) -> dict:
    module, make_cfg = MODELS[family]
    model = module.model(make_cfg())
    layout = parallel.Layout(parallel.mesh(**degrees))
    got = parallel.init_params(model, ft.random.key(11), layout, dtype=dtype)
    want = _expected(model, model.init(ft.random.key(11), dtype=dtype), layout)
    return _result(name, mismatches(got, want, f"rank {dist.get_rank()}"), got)


def _shared_dir() -> Path:
    """A fresh directory every rank sees (made by rank 0)."""
    box = [tempfile.mkdtemp(prefix="ftitan-hf-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _write(directory: Path, family: str, *, fused: bool) -> None:
    """Rank 0 writes a tiny checkpoint: hub files in bf16, or transformers-5 fused experts in fp32 over
    two index-listed shards."""
    module, make_cfg = MODELS[family]
    cfg = make_cfg()
    params = module.model(cfg).init(ft.random.key(5), dtype=torch.bfloat16)
    if not fused:
        hf.save_hf(params, cfg, directory)
        return
    write_index_sharded(hf.to_hf(ft.tree.map(lambda x: x.float(), params), cfg, layout="module"), directory)
    (directory / hf.CONFIG_FILE).write_text(json.dumps(hf.config_to_hf(cfg)))


def hf_check(name: str, family: str, degrees: dict[str, int], *, fused: bool, dtype: torch.dtype) -> dict:
    directory = _shared_dir()
    try:
        if dist.get_rank() == 0:
            _write(directory, family, fused=fused)
        dist.barrier()
        layout = parallel.Layout(parallel.mesh(**degrees))
        cfg, got = hf.load_hf_sharded(directory, layout, dtype=dtype)
        model = hf.family_of(cfg).model(cfg)
        want = _expected(model, hf.load_hf(directory, dtype=dtype)[1], layout)
        bad = mismatches(got, want, f"rank {dist.get_rank()}")
        _, api = ft.models.from_pretrained(directory, layout=layout, dtype=dtype)
        bad += mismatches(api, want, f"rank {dist.get_rank()}")
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    return _result(name, bad, got)


CHECKS = {
    "init_dp_shard2_tp2_llama": lambda: init_check("init_dp_shard2_tp2_llama", "llama", {"dp_shard": 2, "tp": 2}),
    "init_pp2_dp_shard2_qwen3_moe": lambda: init_check(
        "init_pp2_dp_shard2_qwen3_moe", "qwen3_moe", {"pp": 2, "dp_shard": 2}, torch.bfloat16
    ),
    "init_ep2_tp2_deepseek_v3": lambda: init_check(
        "init_ep2_tp2_deepseek_v3", "deepseek_v3", {"ep": 2, "tp": 2}, torch.bfloat16
    ),
    "hf_dp_shard2_tp2_qwen3_moe": lambda: hf_check(
        "hf_dp_shard2_tp2_qwen3_moe", "qwen3_moe", {"dp_shard": 2, "tp": 2}, fused=False, dtype=torch.float32
    ),
    "hf_pp2_ep2_deepseek_v3_fused": lambda: hf_check(
        "hf_pp2_ep2_deepseek_v3_fused", "deepseek_v3", {"pp": 2, "ep": 2}, fused=True, dtype=torch.bfloat16
    ),
}
