"""Checkpoints: sharded, written asynchronously, verified, and restored under any parallel layout.

A checkpoint is a directory ``<directory>/step_{step:08d}/`` holding

- one safetensors file per rank that had something to write
  (``rankNNNNN.safetensors``; ``rankNNNNN/model-*.safetensors`` from the
  ``dcp`` writer): a DTensor leaf's local block, written by the first of the
  ranks holding it (coordinate 0 on the mesh dims where it is replicated),
  plain leaves (step, rng, counters, the loader position) by rank 0, each
  keyed by its dotted path (``ftitan.tree.paths``: ``state.params.layers.0.attn.wq``);
- ``manifest.json``: format version 2, step, every leaf's path/dtype/global
  shape and its chunks (file, key, offsets, shape), every file's size and
  sha256, and the caller's JSON ``extra`` (the run's config, say).

Every rank writes its file and a small index into a hidden
``.tmp-step_…-<nonce>`` directory; rank 0 merges the indexes into the
manifest and renames the directory into place, so a crash never leaves half
a checkpoint (:mod:`ftitan.checkpoint._commit`). :class:`Checkpointer`
blocks the training loop only while this rank's blocks are staged: the
default writer is ``torch-checkpointing`` (shared-memory staging, a writer
subprocess, started with a rank's first save of 64 MiB or more: smaller ones
are copied and written from a thread); ``dcp`` (torch.distributed.checkpoint's
safetensors writer) and ``sync`` are the others. :func:`load` reads, for each leaf of the tree
it restores into, only the block that leaf holds (a DTensor's local block
under any mesh and placements: resharding), from the chunks overlapping it,
through the JSON manifest and safetensors headers alone (nothing is
unpickled). :func:`latest` and :meth:`RunDir.resume` skip (with a warning)
checkpoints whose files were damaged later, falling back to the previous
one. A :class:`Part` leaf (a block at given offsets of a global tensor: FlexShard's parts) is written and
read like a DTensor's block. Version-1 checkpoints (one ``state.safetensors``) still load::

    import ftitan.checkpoint as ckpt

    ckpt.save("runs/a/ckpt", int(state.step), state, extra={"config": cfg_dict}, keep=3)  # collective
    with ckpt.Checkpointer("runs/a/ckpt", keep=3) as saver:                              # async
        saver.save(int(state.step), state)
    like = init_state(params, optimizer)  # same structure, dtypes, global shapes; any sharding
    if ckpt.latest("runs/a/ckpt") is not None:
        state, manifest = ckpt.load("runs/a/ckpt", like)
"""

from ftitan.checkpoint._backends import BACKENDS
from ftitan.checkpoint._checkpointer import Checkpointer
from ftitan.checkpoint._commit import remove_unfinished
from ftitan.checkpoint._layout import latest, list_checkpoints
from ftitan.checkpoint._load import Reader, load
from ftitan.checkpoint._manifest import (
    FORMAT_VERSION,
    CheckpointError,
    Chunk,
    CorruptCheckpointError,
    FileSpec,
    LeafSpec,
    Manifest,
    read_manifest,
    verify_files,
)
from ftitan.checkpoint._save import save
from ftitan.checkpoint._shards import Part
from ftitan.checkpoint.run import RunDir, RunDirError, load_run

__all__ = [
    "BACKENDS",
    "FORMAT_VERSION",
    "CheckpointError",
    "Checkpointer",
    "Chunk",
    "CorruptCheckpointError",
    "FileSpec",
    "LeafSpec",
    "Reader",
    "RunDir",
    "RunDirError",
    "Manifest",
    "Part",
    "latest",
    "list_checkpoints",
    "load",
    "load_run",
    "read_manifest",
    "remove_unfinished",
    "save",
    "verify_files",
]
