"""Per-rank init and streaming HF loads, every rank of a layout simulated in ONE process (fake process group).

Run by ``test_init.py`` in a subprocess (the fake group must not leak into other tests); prints one
``RESULT {...}`` line per check. Each rank is a fresh ``init_process_group("fake", rank=r, ...)``:
meshes and DTensors are built exactly as on real ranks, and nothing here communicates.

- ``init_<layout>``: ``parallel.init_params`` equals ``shard_params(stage_params(model.init(key)))`` on every
  rank (placements, global shape and stride, dtype, bit-equal local values) for every registered family.
- ``hf_<layout>``: ``hf.load_hf_sharded(dir, layout)`` equals ``shard_params(stage_params(load_hf(dir)))``,
  for hub (per-expert, bf16) and transformers-5 fused (fp32, index-sharded) checkpoints.
- ``llama3_8b_memory``: rank 3 of 8 under ``dp_shard=8`` on the meta device; a dispatch mode records the
  size of every tensor an op creates.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
import safetensors.torch
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

import ftitan as ft
from ftitan import parallel
from ftitan.models import hf, hf_stream, llama, pretrained
from tests.tiny_families import tiny_config

LAYOUTS = {"dp_shard2_tp2": {"dp_shard": 2, "tp": 2}, "ep2_dp_shard2": {"ep": 2, "dp_shard": 2},
           "pp2_tp2": {"pp": 2, "tp": 2}}  # fmt: skip


def tiny(family: hf.Family) -> Any:
    return tiny_config(family, n_layers=3, tie_embeddings=False, n_dense_layers=1)


def ranks(degrees: dict[str, int]):
    """Yield a ``Layout`` for each rank of ``degrees``, each in its own fake process group."""
    world = parallel.ParallelDims(**degrees).world_size
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            yield parallel.Layout(parallel.mesh(**degrees))
        finally:
            dist.destroy_process_group()


def expected(model, params, layout):
    axes = model.param_axes
    if layout.sizes["pp"] > 1:
        params, axes = parallel.stage_params(params, model, layout), parallel.stage_params(axes, model, layout)
    return parallel.shard_params(params, axes, layout.rules, layout)


def mismatches(got, want, tag: str) -> list[str]:
    """Every leaf whose DTensor differs (placements, shape, stride, dtype, device or local values)."""
    gp, gl, _ = ft.tree.flatten_with_paths(got)
    wp, wl, _ = ft.tree.flatten_with_paths(want)
    if gp != wp:
        return [f"{tag}: leaves {gp} vs {wp}"]
    bad = []
    for p, a, b in zip(gp, gl, wl, strict=True):
        same = (a.placements == b.placements and a.shape == b.shape and a.stride() == b.stride()
                and a.dtype == b.dtype and a.device_mesh == b.device_mesh
                and a.to_local().is_contiguous() and torch.equal(a.to_local(), b.to_local()))  # fmt: skip
        if not same:
            bad.append(f"{tag} {p}: {a.placements} {tuple(a.shape)} {a.dtype} "
                       f"vs {b.placements} {tuple(b.shape)} {b.dtype}")
    return bad


def no_stage(layout_name: str) -> set[str]:
    """Families this layout cannot hold: those without pipeline stages when pp > 1 (they refuse it by name)."""
    if LAYOUTS[layout_name].get("pp", 1) == 1:
        return set()
    return {f.name for f in hf.families() if f.model(tiny(f)).stage is None}


def init_check(layout_name: str) -> dict:
    bad, n, skip = [], 0, no_stage(layout_name)
    for layout in ranks(LAYOUTS[layout_name]):
        r = dist.get_rank()
        for i, family in enumerate(sorted(hf.families(), key=lambda f: f.name)):
            if family.name in skip:
                continue
            model = family.model(tiny(family))
            dtype = (torch.float32, torch.bfloat16)[i % 2]  # deepseek_v3 in bf16: its routing bias stays fp32
            got = parallel.init_params(model, ft.random.key(3), layout, dtype=dtype)
            want = expected(model, model.init(ft.random.key(3), dtype=dtype), layout)
            bad += mismatches(got, want, f"rank {r} {family.name} {dtype}")
            n += len(ft.tree.leaves(got))
        # a transformed init (not the family's own): the fallback, still equal
        shifted = model._replace(init=lambda key, **kw: ft.tree.map(lambda x: x + 1, model.init(key, **kw)))
        got = parallel.init_params(shifted, ft.random.key(3), layout)
        bad += mismatches(got, expected(model, shifted.init(ft.random.key(3)), layout), f"rank {r} shifted")
        # full params placed by from_pretrained(run_dir, layout=) (a run's checkpoint is read whole)
        full = model.init(ft.random.key(3))
        placed = pretrained._place(model, full, layout, None)
        bad += mismatches(placed, expected(model, full, layout), f"rank {r} run placed")
    return {"check": f"init_{layout_name}", "bad": bad[:8], "n_bad": len(bad), "leaves": n, "no_stage": sorted(skip)}


def write_index_sharded(state: dict[str, torch.Tensor], directory: Path, n: int = 2) -> None:
    """``state`` (HF names) as ``n`` safetensors shards listed by ``model.safetensors.index.json``."""
    names = sorted(state)
    shards = {f"model-{i + 1:05d}-of-{n:05d}.safetensors": names[i::n] for i in range(n)}
    for file, keys in shards.items():
        safetensors.torch.save_file({k: state[k].contiguous() for k in keys}, directory / file)
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (directory / hf.WEIGHTS_INDEX_FILE).write_text(json.dumps(index))


def write_checkpoints(root: Path) -> list[tuple[str, Path, Any]]:
    """Per family: a hub checkpoint in bf16; MoE families also a transformers-5 fused fp32 one, index-sharded."""
    out = []
    for family in hf.families():
        cfg = tiny(family)
        params = family.model(cfg).init(ft.random.key(5), dtype=torch.bfloat16)
        hub = hf.save_hf(params, cfg, root / f"{family.name}_hub")
        out.append((f"{family.name}_hub", hub, torch.float32 if family.name < "q" else None))
        state = hf.to_hf(ft.tree.map(lambda x: x.float(), params), cfg, layout="module")
        if any(k.endswith("gate_up_proj") for k in state):
            fused = root / f"{family.name}_fused"
            fused.mkdir()
            (fused / hf.CONFIG_FILE).write_text((hub / hf.CONFIG_FILE).read_text())
            write_index_sharded(state, fused)
            out.append((f"{family.name}_fused", fused, torch.bfloat16))
    return out


class Reads:
    """Counts the elements ``hf_stream.Checkpoint.read`` returns (each rank must read only its blocks)."""

    def __enter__(self) -> Reads:
        self.numel, self._read = 0, hf_stream.Checkpoint.read

        def read(ckpt, view, block):
            x = self._read(ckpt, view, block)
            self.numel += x.numel()
            return x

        hf_stream.Checkpoint.read = read
        return self

    def __exit__(self, *exc) -> None:
        hf_stream.Checkpoint.read = self._read


def hf_check(layout_name: str, checkpoints) -> dict:
    bad, n, skip = [], 0, no_stage(layout_name)
    for layout in ranks(LAYOUTS[layout_name]):
        r = dist.get_rank()
        for name, directory, dtype in checkpoints:
            if name.rsplit("_", 1)[0] in skip:  # "{family}_hub" / "{family}_fused"
                continue
            with Reads() as reads:
                cfg, got = hf.load_hf_sharded(directory, layout, dtype=dtype)
            _, full = hf.load_hf(directory, dtype=dtype)
            bad += mismatches(got, expected(hf.family_of(cfg).model(cfg), full, layout), f"rank {r} {name} {dtype}")
            local = sum(x.to_local().numel() for x in ft.tree.leaves(got))
            if reads.numel != local:
                bad.append(f"rank {r} {name}: read {reads.numel} elements for {local} local ones")
            n += len(ft.tree.leaves(got))
        model, got = ft.models.from_pretrained(checkpoints[0][1], layout=layout)  # the Python API
        bad += mismatches(got, expected(model, hf.load_hf(checkpoints[0][1])[1], layout), f"rank {r} from_pretrained")
    return {"check": f"hf_{layout_name}", "bad": bad[:8], "n_bad": len(bad), "leaves": n, "no_stage": sorted(skip)}


class Creations(TorchDispatchMode):
    """Records ``(device, numel, bytes)`` of every tensor an op creates (outputs aliasing no input)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t, ret in zip(outs, func._schema.returns, strict=False):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                self.created.append((t.device.type, t.numel(), t.numel() * t.element_size()))
        return out


def memory_check() -> dict:
    """llama3-8b under dp_shard=8, rank 3, bf16 on meta: what init_params creates, vs the model's size."""
    model = llama.model(llama.Config.llama3_1_8b())
    specs = llama.param_specs(model.config)
    total = sum(2 * math.prod(p.shape) for p in ft.tree.leaves(specs))
    dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
    try:
        layout = parallel.Layout(parallel.mesh(dp_shard=8))
        shardings = parallel.resolve(specs, model.param_axes, layout.rules, layout.mesh)
        pairs = zip(ft.tree.leaves(specs), ft.tree.leaves(shardings), strict=True)
        replicated = sum(2 * math.prod(p.shape) for p, s in pairs if not s.mesh_axes())
        with Creations() as rec:
            params = parallel.init_params(model, ft.random.key(0), layout, dtype=torch.bfloat16, device="meta")
        local = [x.to_local() for x in ft.tree.leaves(params)]
        # the same count for the full-init fallback (a transformed init): the check sees its full-size draws
        with Creations() as fallback:
            parallel.init_params(model._replace(init=lambda key, **kw: model.init(key, **kw)), ft.random.key(0),
                                 layout, dtype=torch.bfloat16, device="meta")  # fmt: skip
    finally:
        dist.destroy_process_group()
    meta = [c for c in rec.created if c[0] == "meta"]
    return {"check": "llama3_8b_memory", "model_bytes": total, "replicated_bytes": replicated,
            "local_bytes": sum(x.numel() * x.element_size() for x in local),
            "created_bytes": sum(c[2] for c in meta), "max_created_numel": max(c[1] for c in meta),
            "max_local_numel": max(x.numel() for x in local),
            "other_devices_max_numel": max((c[1] for c in rec.created if c[0] != "meta"), default=0),
            "fallback_max_created_numel": max(c[1] for c in fallback.created if c[0] == "meta"),
            "full_max_numel": max(math.prod(p.shape) for p in ft.tree.leaves(specs))}  # fmt: skip


def main() -> None:
    torch.set_num_threads(1)
    names = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = []
        checks = {"llama3_8b_memory": memory_check}
        for layout_name in LAYOUTS:
            checks[f"init_{layout_name}"] = lambda ln=layout_name: init_check(ln)
            checks[f"hf_{layout_name}"] = lambda ln=layout_name: hf_check(ln, checkpoints)
        if any(name.startswith("hf_") for name in names or checks):  # written once, only when needed
            checkpoints += write_checkpoints(Path(tmp))
        for name in names or list(checks):
            try:
                result = checks[name]()
            except Exception as e:  # report, keep going
                result = {"check": name, "error": f"{type(e).__name__}: {e}"}
            print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
