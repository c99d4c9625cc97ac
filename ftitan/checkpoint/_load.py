"""Loading a checkpoint into the structure, and the sharding, of a given tree.

Each leaf of the tree to restore into asks for its own block: a ``DTensor``
for its local block under its mesh and placements (whatever layout the
checkpoint was saved under: resharding), a plain tensor for all of it. The
block is assembled from the chunks that overlap it, each read as a slice of
its safetensors file (``safe_open(...).get_slice``), so a rank never reads
more than it holds. Only the JSON manifest and safetensors headers are
parsed: nothing is unpickled, whichever writer wrote the files.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from ftitan import tree as ftree
from ftitan.checkpoint._layout import latest, step_of
from ftitan.checkpoint._manifest import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointError,
    CorruptCheckpointError,
    LeafSpec,
    Manifest,
    read_manifest,
    spec_of,
    verify_files,
)
from ftitan.checkpoint._shards import Part, block_of

__all__ = ["Reader", "load"]

_SHOWN = 5  # paths listed in a mismatch error


class Reader:
    """Reads leaves, or blocks of them, from the checkpoint a manifest describes (CPU tensors).

    With ``verify=True`` each file is checked against the manifest's size and sha256 the first time
    it is read. Use as a context manager (open files are closed on exit).

    >>> with Reader(read_manifest("ckpt/step_00000100")) as r:  # doctest: +SKIP
    ...     wq = r.read("state.params.layers.0.attn.wq")                   # the whole leaf
    ...     rows = r.read("state.params.layers.0.attn.wq", (0, 0), (8, 64))  # a block of it
    """

    def __init__(self, manifest: Manifest, *, verify: bool = True) -> None:
        self.manifest = manifest
        self._verify = verify
        self._leaves = {s.path: s for s in manifest.leaves}
        self._files: dict[str, Any] = {}

    def spec(self, path: str) -> LeafSpec:
        return self._leaves[path]

    def _open(self, name: str) -> Any:
        if name not in self._files:
            if self._verify:
                verify_files(self.manifest, [name])
            file = self.manifest.path / name
            try:
                self._files[name] = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise CorruptCheckpointError(f"{file}: unreadable tensor file ({e}); restore from another checkpoint") from e
        return self._files[name]

    def read(self, path: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Leaf ``path``'s block at ``offsets`` of ``shape`` (default: all of it)."""
        leaf = self._leaves[path]
        offsets = (0,) * len(leaf.shape) if offsets is None else tuple(offsets)
        shape = leaf.shape if shape is None else tuple(shape)
        dtype = getattr(torch, leaf.dtype)
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype)
        out: torch.Tensor | None = None
        copied = 0
        for c in leaf.chunks:
            lo = [max(o, co) for o, co in zip(offsets, c.offsets, strict=True)]
            hi = [min(o + n, co + cn) for o, n, co, cn in zip(offsets, shape, c.offsets, c.shape, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            piece = self._piece(leaf, c, lo, hi, dtype)
            if tuple(c.offsets) == offsets and tuple(c.shape) == shape:
                return piece  # the block is this chunk: no copy
            if out is None:
                out = torch.empty(shape, dtype=dtype)
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))] = piece
            copied += piece.numel()
        if copied != math.prod(shape) or out is None:
            raise CorruptCheckpointError(
                f"{self.manifest.path}: {path}'s chunks cover {copied} of the {math.prod(shape)} elements of the "
                f"block at {list(offsets)} {list(shape)}; restore from another checkpoint"
            )
        return out

    def _piece(self, leaf: LeafSpec, c: Any, lo: list[int], hi: list[int], dtype: torch.dtype) -> torch.Tensor:
        f = self._open(c.file)
        where = f"{self.manifest.path / c.file}: {c.key}"
        try:
            view = f.get_slice(c.key)
            stored = tuple(view.get_shape())
            if stored != tuple(c.shape):
                raise CorruptCheckpointError(f"{where} is stored as {list(stored)}, the manifest says {list(c.shape)}")
            whole = all(a == o and b == o + n for a, b, o, n in zip(lo, hi, c.offsets, c.shape, strict=True))
            if whole or not c.shape:
                piece = f.get_tensor(c.key)
            else:
                piece = view[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, c.offsets, strict=True))]
        except SafetensorError as e:
            raise CorruptCheckpointError(f"{where}: unreadable ({e}); restore from another checkpoint") from e
        if piece.dtype != dtype:
            raise CorruptCheckpointError(f"{where}: stored as {piece.dtype}, but the manifest says {leaf.describe()}")
        return piece

    def close(self) -> None:
        self._files.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load(
    path_or_directory: str | Path, like_tree: Any, *, verify: bool = True, whole: Any = None, into: bool = False
) -> tuple[Any, Manifest]:
    """``(tree, manifest)``: the checkpoint restored into the structure and sharding of ``like_tree``.

    ``path_or_directory`` is a checkpoint (``.../step_00000100``) or a directory of them, in which
    case the newest valid one is loaded (see :func:`~ftitan.checkpoint.latest`). ``like_tree`` must
    have the saved dotted paths, dtypes and global shapes. A ``DTensor`` leaf comes back as a DTensor
    with the same mesh and placements, holding only its local block (read from the overlapping
    chunks: any save layout loads under any load layout); a plain leaf comes back whole, on its
    device (a ``meta`` leaf: on the CPU), with its ``requires_grad``. With ``verify=True`` each file
    read is checked against its sha256 first.

    ``whole``: when ``like_tree`` is part of what was saved (a pipeline stage's leaves, or just the
    params), a tree of the whole structure (meta tensors do): the checkpoint must match it exactly and
    ``like_tree``'s paths must be among its paths; only ``like_tree``'s leaves are read.

    ``into=True``: write into ``like_tree``'s own tensors (their local blocks) and return them, so a
    resume never holds two copies of the state (a leaf at a time is read on the CPU first). The values
    ``like_tree`` held are overwritten, also when the load fails part way (meta leaves load as usual).

    Raises :class:`CheckpointError` naming the mismatched paths, or :class:`CorruptCheckpointError`
    for a missing manifest, a truncated or corrupted file. Not collective.

    >>> state, manifest = load("ckpt", init_state(params, opt))   # any layout: DTensors reshard
    >>> manifest.step, manifest.extra["config"]
    """
    checkpoint, verified = _resolve(Path(path_or_directory), verify=verify)
    manifest = read_manifest(checkpoint)
    paths, likes, treedef = ftree.flatten_with_paths(like_tree)
    if whole is None:
        _check_structure(manifest, paths, likes)
    else:
        whole_paths, whole_likes, _ = ftree.flatten_with_paths(whole)
        _check_structure(manifest, whole_paths, whole_likes)
        outside = [p for p in paths if p not in set(whole_paths)]
        if outside:
            raise CheckpointError(f"load: like_tree's {_some(outside)} are not in `whole`; pass a part of it")
        _check_structure(manifest, paths, likes, partial=True)
    with Reader(manifest, verify=verify and not verified) as reader:
        leaves = [_restore(reader, path, like, into=into) for path, like in zip(paths, likes, strict=True)]
    return ftree.unflatten(treedef, leaves), manifest


def _resolve(path: Path, *, verify: bool) -> tuple[Path, bool]:
    """The checkpoint to read, and whether its files were already verified."""
    if step_of(path) is not None or (path / MANIFEST_FILE).exists() or (path / STATE_FILE).exists():
        return path, False
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint or checkpoint directory")
    found = latest(path, verify=verify)
    if found is None:
        raise FileNotFoundError(
            f"{path}: no valid checkpoint (step_XXXXXXXX directory with a good manifest) in this directory"
        )
    return found, verify


def _check_structure(manifest: Manifest, paths: list[str], likes: list[Any], *, partial: bool = False) -> None:
    where = f"checkpoint {manifest.path}"
    saved = {s.path: s for s in manifest.leaves}
    missing = [p for p in paths if p not in saved]
    wanted = set(paths)
    unexpected = [] if partial else [p for p in saved if p not in wanted]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_some(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in like_tree: {_some(unexpected)}")
        raise CheckpointError(
            f"{where}: the tree structure differs; {'; '.join(parts)}. Build like_tree the way the saved run "
            "did (same model and optimizer config; manifest.extra may hold it)"
        )
    for path, like in zip(paths, likes, strict=True):
        if not isinstance(like, (torch.Tensor, Part)):
            raise TypeError(f"{path}: like_tree leaf is a {type(like).__name__}, expected a tensor")
        want, got = spec_of(path, like), saved[path]
        if want.shape != got.shape:
            raise CheckpointError(
                f"{where}: {path} has shape {list(got.shape)} but like_tree has {list(want.shape)}; "
                "build like_tree with the saved model config"
            )
        if want.dtype != got.dtype:
            raise CheckpointError(
                f"{where}: {path} is {got.describe()} but like_tree has {want.describe()}; build like_tree "
                f"in {got.dtype} and cast after loading (ftitan.tree.cast)"
            )


def _some(paths: list[str]) -> str:
    shown = ", ".join(paths[:_SHOWN])
    return shown + (f" (and {len(paths) - _SHOWN} more)" if len(paths) > _SHOWN else "")


def _restore(reader: Reader, path: str, like: Any, *, into: bool = False) -> Any:
    offsets, shape = block_of(path, like)
    x = reader.read(path, offsets, shape)
    if isinstance(like, Part):
        if into and like.local.device.type != "meta":
            with torch.no_grad():
                like.local.copy_(x)
            return like
        return Part(x.to(like.local.device) if like.local.device.type not in ("cpu", "meta") else x, like.shape,
                    like.offsets, like.write)  # fmt: skip
    local = like.to_local() if isinstance(like, DTensor) else like
    if into and local.device.type != "meta":
        with torch.no_grad():
            local.copy_(x)  # a DTensor's local block shares its storage: the DTensor holds the loaded values
        return like
    if local.device.type not in ("cpu", "meta"):
        x = x.to(local.device)
    if isinstance(like, DTensor):
        x = DTensor.from_local(x, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                               stride=like.stride())  # fmt: skip
    if like.requires_grad:
        x.requires_grad_(True)
    return x
