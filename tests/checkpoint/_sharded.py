"""Run under torchrun (gloo): sharded saves and resharding loads, as ``RESULT {...}`` JSON lines (rank 0).

Launched on 4 ranks (``test_sharded.py``, default tier): a train state saved under dp_shard 2 x tp 2
by each writer; each rank's file holds exactly its first-held blocks; loaded back under other layouts
-- 2-rank ones (dp_shard 2, tp 2: a dp_replicate 2 mesh holds two copies of such a world), pp 2 x
dp_shard 2, and one process -- equal to the saved full values, each rank reading only its blocks; a
corrupt chunk on one rank makes every rank fall back; none valid is one error; ranks that disagree on
plain leaves fail the save. On 8 ranks (slow) the save is dp_shard 4 x tp 2 and the loads 8-rank ones.
``CHECKS_DEFAULT`` run by default; the torch-checkpointing writer (a subprocess per rank) is the slow
tier's. Run some checks by name: ``torchrun --standalone --nproc-per-node 4 tests/checkpoint/_sharded.py save_sync``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import tempfile
import traceback
import warnings

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import ftitan as ft
import ftitan.checkpoint as ckpt
from ftitan import parallel
from ftitan.checkpoint import _load
from ftitan.config.schema import ParallelConfig
from ftitan.data.loader import init_loader_state
from ftitan.models import llama
from ftitan.train.runtime import Runtime

torch.set_num_threads(1)
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
SAVE = {"dp_shard": 2, "tp": 2} if WORLD == 4 else {"dp_shard": 4, "tp": 2}
LOADS = (  # name -> degrees of the layout that loads (its product is WORLD)
    {"two_ranks_dp_shard2": {"dp_replicate": 2, "dp_shard": 2}, "two_ranks_tp2": {"dp_replicate": 2, "tp": 2},
     "pp2_dp_shard2": {"pp": 2, "dp_shard": 2}}
    if WORLD == 4
    else {"dp_shard8": {"dp_shard": 8}, "pp2_dp_shard2_tp2": {"pp": 2, "dp_shard": 2, "tp": 2}}
)  # fmt: skip


def tiny():
    cfg = attrs.evolve(llama.Config.debug(), vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_dim=128, tie_embeddings=False)  # fmt: skip
    return llama.model(cfg)


MODEL = tiny()
PARAMS = MODEL.init(ft.random.key(0))
OPT = ft.optim.adamw(lr=1e-3)
WHOLE = {"state": ft.train.init_state(PARAMS, OPT), "loader": init_loader_state(3)}


def runtime(degrees):
    return Runtime(parallel.Layout(parallel.mesh(**degrees)), ParallelConfig(**degrees))


def like_on(degrees):
    rt = runtime(degrees)
    return rt, {"state": ft.train.init_state(rt.place(PARAMS, MODEL), OPT), "loader": init_loader_state(3)}


def trained(rt, tree, seed):
    """``tree`` after one step on a seeded batch: nonzero moments, a step counter of 1."""
    loss_fn = ft.train.next_token_loss(MODEL, chunk_size=24)
    tok = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(seed))
    step = rt.make_step(MODEL, loss_fn, OPT, accum_steps=1, compile=False, update_buffers=None)
    state, _ = step(tree["state"], rt.local_batch({"inputs": tok[:, :-1], "targets": tok[:, 1:]}))
    return {"state": state, "loader": tree["loader"]._replace(position=torch.tensor(seed, dtype=torch.int64))}


def full_by_path(tree):
    """Every leaf whole (collective: DTensors are gathered), by dotted path."""
    paths, leaves, _ = ft.tree.flatten_with_paths(parallel.unshard(tree))
    return dict(zip(paths, leaves, strict=True))


def exact(loaded, full):
    """Whether each loaded leaf (a stage's part under pp) equals the saved full value bit for bit."""
    paths, leaves, _ = ft.tree.flatten_with_paths(loaded)
    ok = True
    for p, x in zip(paths, leaves, strict=True):
        mine = x.to_local() if isinstance(x, DTensor) else x
        if isinstance(x, DTensor):  # this rank's block of the saved full tensor
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offs = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
            want = full[p][tuple(slice(o, o + n) for o, n in zip(offs, shape, strict=True))]
        else:
            want = full[p]
        ok = ok and mine.dtype == want.dtype and torch.equal(mine, want)
    return ok


def shared_dir():
    where = [tempfile.mkdtemp(prefix="ftitan-sharded-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    return where[0]


def everyone(x):
    out = [None] * WORLD
    dist.all_gather_object(out, x)
    return out


def data_bytes(file):
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return os.path.getsize(file) - 8 - n


def first_holders(tree):
    """Bytes each rank should write: each distinct block once, by the lowest rank holding it; plain leaves
    by rank 0 (computed from every rank's blocks, independently of the writer's rule)."""
    from ftitan.checkpoint._shards import block_of

    paths, leaves, _ = ft.tree.flatten_with_paths(tree)
    mine = [(p, block_of(p, x), x.element_size(), isinstance(x, DTensor)) for p, x in zip(paths, leaves, strict=True)]
    owner: dict = {}
    for r, blocks in enumerate(everyone(mine)):
        for p, (offs, shape), size, sharded in blocks:
            key = (p, offs) if sharded else (p, None)
            owner.setdefault(key, (r, math.prod(shape) * size))
    expected = [0] * WORLD
    for r, n in owner.values():
        expected[r] += n
    return expected


def counting_reads():
    """Bytes this rank reads from tensor files during a load (a patch of ``Reader._piece``)."""
    box = {"bytes": 0}
    real = _load.Reader._piece

    def piece(self, *args, **kw):
        out = real(self, *args, **kw)
        box["bytes"] += out.numel() * out.element_size()
        return out

    _load.Reader._piece = piece
    return box, lambda: setattr(_load.Reader, "_piece", real)


def local_bytes(tree):
    return sum((x.to_local() if isinstance(x, DTensor) else x).numel() * x.element_size() for x in ft.tree.leaves(tree))


def save_check(name: str, backend: str, *, loads: bool = True) -> dict:
    rt, like = like_on(SAVE)
    saved = trained(rt, like, seed=1)
    full = full_by_path(saved)
    where = shared_dir()
    with ckpt.Checkpointer(where, backend=backend, keep=2, subprocess_min_bytes=0) as saver:
        saver.save(1, saved)
    path = os.path.join(where, "step_00000001")
    manifest = ckpt.read_manifest(path)
    expected = first_holders(saved)
    by_rank = [0] * WORLD  # tensor bytes in each rank's file (files are named by rank)
    for f in manifest.files:
        by_rank[int(f.removeprefix("rank")[:5])] += data_bytes(os.path.join(path, f))
    total = sum(x.numel() * x.element_size() for x in full.values())
    out = {"check": name, "files": sorted(manifest.files), "written": by_rank, "expected": expected,
           "total": total, "world_size": manifest.world_size, "backend": manifest.backend}  # fmt: skip

    # read back: the same layout, each 2-rank layout, pp 2, one process; each rank reads only its blocks
    for load_name, degrees in ({"same": SAVE, **LOADS} if loads else {"same": SAVE}).items():
        _, into = like_on(degrees)
        box, undo = counting_reads()
        got, m = ckpt.load(where, into, whole=WHOLE)
        undo()
        reads = everyone((box["bytes"], local_bytes(got)))
        out[f"load_{load_name}"] = all(everyone(exact(got, full))) and m.step == 1
        out[f"reads_{load_name}"] = all(read == held for read, held in reads)
    if dist.get_rank() == 0:
        like = ft.tree.map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"), WHOLE)
        got, _ = ckpt.load(where, like)  # one process: full tensors on the CPU
        out["load_one_process"] = exact(got, full) and all(x.device.type == "cpu" for x in ft.tree.leaves(got))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where)
    return out


def _flip_a_byte(file):
    data = bytearray(open(file, "rb").read())
    data[-3] ^= 0xFF
    open(file, "wb").write(bytes(data))


def fallback_check(name: str) -> dict:
    """Rank 3's file of the newest checkpoint is damaged: rank 3 finds it, and every rank resumes the
    previous one; with both damaged, every rank raises one error naming both."""
    rt, like = like_on(SAVE)
    first, second = trained(rt, like, seed=1), trained(rt, like, seed=2)
    full = full_by_path(first)
    where = shared_dir()
    run = ckpt.RunDir(where)
    with ckpt.Checkpointer(run.checkpoints, backend="sync") as saver:
        saver.save(1, first)
        saver.save(2, second)
    if dist.get_rank() == 0:
        _flip_a_byte(os.path.join(run.checkpoints, "step_00000002", f"rank{WORLD - 1:05d}.safetensors"))
    dist.barrier()
    _, into = like_on(SAVE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, step = run.resume(into, whole=WHOLE)
    said = [str(w.message) for w in caught if "skipping checkpoint step_00000002" in str(w.message)]
    out = {"check": name, "steps": everyone(step), "exact": all(everyone(exact(got, full))),
           "warned": all(everyone(bool(said) and f"(rank {WORLD - 1})" in said[0] and "sha256" in said[0]))}
    if dist.get_rank() == 0:
        _flip_a_byte(os.path.join(run.checkpoints, "step_00000001", "rank00000.safetensors"))
    dist.barrier()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.resume(into, whole=WHOLE)
        message = None
    except ckpt.CorruptCheckpointError as e:
        message = str(e)
    out["all_corrupt"] = everyone(message is not None and "2 checkpoint(s), none of which loads" in message
                                  and "step_00000002" in message and "step_00000001" in message)  # fmt: skip
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where)
    return out


def plain_mismatch_check(name: str) -> dict:
    """Rank 0 writes the plain leaves for all: a rank holding others fails the save on every rank."""
    where = shared_dir()
    tree = {"step": torch.tensor(1)} | ({"extra": torch.ones(2)} if dist.get_rank() == 1 else {})
    try:
        ckpt.save(where, 1, tree)
        message = None
    except ckpt.CheckpointError as e:
        message = str(e)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where)
    return {"check": name, "raised": everyone(message is not None and "only on rank 1: extra" in message)}


def uneven_check(name: str) -> dict:
    """DTensors split unevenly (DTensor's chunking; a rank may hold an empty block) save and reshard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    full = {"rows": torch.arange(30.0).reshape(10, 3), "cols": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    tree = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
            "cols": distribute_tensor(full["cols"], mesh, [Shard(1)])}
    where = shared_dir()
    ckpt.save(where, 1, tree)
    out = {"check": name}
    for label, placement in (("shard0", Shard(0)), ("shard1", Shard(1)), ("replicate", Replicate())):
        like = {k: distribute_tensor(torch.zeros_like(v), mesh, [placement]) for k, v in full.items()}
        got, _ = ckpt.load(where, like)
        out[label] = all(everyone(exact(got, full)))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where)
    return out


CHECKS = {
    "uneven": lambda: uneven_check("uneven"),
    "save_sync": lambda: save_check("save_sync", "sync"),
    # the other writers: the same files and manifest, so the same reads (one layout suffices)
    "save_dcp": lambda: save_check("save_dcp", "dcp", loads=False),
    "save_torch_checkpointing": lambda: save_check("save_torch_checkpointing", "torch-checkpointing", loads=False),
    "fallback": lambda: fallback_check("fallback"),
    "plain_mismatch": lambda: plain_mismatch_check("plain_mismatch"),
}


CHECKS_DEFAULT = ("save_sync", "save_dcp", "fallback", "plain_mismatch", "uneven")


def main() -> None:
    dist.init_process_group("gloo")
    names = sys.argv[1:] or list(CHECKS_DEFAULT)
    for name in names:
        try:
            result = CHECKS[name]()
        except Exception as e:  # noqa: BLE001 - reported as a result
            result = {"check": name, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
