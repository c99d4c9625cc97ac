"""Checkpoints: a tree of tensors saved atomically, verified, and restored bit-exactly.

A checkpoint is a directory ``<directory>/step_{step:08d}/`` holding

- ``state.safetensors``: every leaf of the tree, keyed by its dotted path
  (``ftitan.tree.paths``; a ``TrainState``'s fields are numbered, e.g.
  ``1.layers.0.attn.wq`` for ``params["layers"]["0"]["attn"]["wq"]``);
- ``manifest.json``: format version, step, each leaf's path/dtype/shape, the
  size and sha256 of the tensor file, and the caller's JSON ``extra``
  metadata (the run's config, say).

It is written into a hidden temp directory, fsynced and renamed into place,
so a crash never leaves half a checkpoint; :func:`latest` also skips (with a
warning) checkpoints whose files were damaged later, falling back to the
previous one::

    import ftitan.checkpoint as ckpt

    ckpt.save("runs/a/ckpt", int(state.step), state, extra={"config": cfg_dict}, keep=3)
    ...
    like = init_state(params, optimizer)  # same structure, dtypes, shapes
    if ckpt.latest("runs/a/ckpt") is not None:
        state, manifest = ckpt.load("runs/a/ckpt", like)
"""

from ftitan.checkpoint._layout import latest, list_checkpoints
from ftitan.checkpoint._load import load
from ftitan.checkpoint._manifest import (
    FORMAT_VERSION,
    CheckpointError,
    CorruptCheckpointError,
    LeafSpec,
    Manifest,
    read_manifest,
)
from ftitan.checkpoint._save import save
from ftitan.checkpoint.run import RunDir, load_run

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CorruptCheckpointError",
    "LeafSpec",
    "RunDir",
    "Manifest",
    "latest",
    "list_checkpoints",
    "load",
    "load_run",
    "read_manifest",
    "save",
]
