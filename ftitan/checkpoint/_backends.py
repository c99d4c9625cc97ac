"""Writers of one rank's tensor file: ``torch-checkpointing`` (default), ``dcp`` and ``sync``.

Each takes this rank's ``{key: tensor}`` and the save's temp dir, returns
once the tensors are *staged* (copied where training can no longer change
them), and hands back a function that blocks until the file is written and
returns the written files' names (relative to the temp dir). The commit
protocol (:mod:`ftitan.checkpoint._commit`) does the rest: fsync, sha256,
index, rename. Every writer writes safetensors; none writes pickle, so a
checkpoint loads through its JSON manifest and safetensors headers alone.

- ``torch-checkpointing``: ``CheckpointManager`` stages into shared memory
  (pinned on CUDA) and writes from its own subprocess, so the write costs the
  trainer's process nothing; ``SafetensorsSerialization`` with a fixed file
  name, no barrier and no temp dir of its own (ftitan commits). The subprocess
  starts with the first save of at least ``subprocess_min_bytes`` on a rank;
  smaller ones are staged by a copy and written from the checkpointer's thread.
- ``dcp``: ``torch.distributed.checkpoint``'s ``DefaultStager`` copies to the
  CPU, then ``dcp.save(..., HuggingFaceStorageWriter, no_dist=True)`` writes
  this rank's safetensors file from the checkpointer's thread (no collectives
  off the main thread: DCP's own planning across ranks is not used).
- ``sync``: ``safetensors.torch.save_file`` in the caller; the reference.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ftitan.checkpoint._commit import rank_file

__all__ = ["BACKENDS", "Writer", "make_writer"]

BACKENDS: tuple[str, ...] = ("torch-checkpointing", "dcp", "sync")

Done = Callable[[], list[str]]


class Writer:
    """A writer: ``write(tmp, rank, tensors) -> done`` (see the module docstring), ``close()``."""

    name = "sync"

    def write(self, tmp: Path, rank: int, tensors: dict[str, torch.Tensor]) -> Done:
        if not tensors:
            return list
        name = rank_file(rank)
        save_file({k: v.detach().cpu() for k, v in tensors.items()}, str(tmp / name))
        return lambda: [name]

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[bool]:
    """While a ``spawn`` child starts: keep it from re-running a ``__main__`` script that has no
    ``if __name__ == "__main__"`` guard (as multiprocessing does for a module named ``__main__``)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None or not getattr(main, "__file__", None):
        yield False
        return
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    try:
        yield True
    finally:
        main.__spec__ = None


def _wait_until_spawned(manager: object, timeout: float = 120.0) -> None:
    process = getattr(getattr(manager, "_saver", None), "_checkpoint_process", None)
    creation = getattr(process, "_creation_future", None)
    if process is None or creation is None:
        return
    deadline = time.monotonic() + timeout
    while getattr(process, "process", None) is None and not creation.done() and time.monotonic() < deadline:
        time.sleep(0.005)


class StagedWriter(Writer):
    """Copies the tensors to the CPU in ``write`` (the staging), writes them from the checkpointer's thread."""

    name = "staged"

    def write(self, tmp: Path, rank: int, tensors: dict[str, torch.Tensor]) -> Done:
        if not tensors:
            return list
        staged = {k: torch.empty_like(v, device="cpu").copy_(v.detach()) for k, v in tensors.items()}
        name = rank_file(rank)

        def done() -> list[str]:
            save_file(staged, str(tmp / name))
            return [name]

        return done


class TorchCheckpointingWriter(Writer):
    """``torch_checkpointing.CheckpointManager``, started at the first save of ``subprocess_min_bytes`` or
    more on this rank; smaller saves before that go through :class:`StagedWriter` (a writer process,
    ~2 s of CPU and a torch import to start, is not worth it for a few MiB: tests, debug runs)."""

    name = "torch-checkpointing"

    def __init__(self, rank: int, *, subprocess_min_bytes: int = 0) -> None:
        try:
            import torch_checkpointing  # noqa: F401 - fail at construction when it is not installed
        except ImportError as e:
            raise ImportError(f"checkpoint backend 'torch-checkpointing' needs the torch-checkpointing package ({e}); "
                              "pip install torch-checkpointing==0.1.1, or use backend 'dcp' or 'sync' "
                              "(--checkpoint.backend)") from e  # fmt: skip

        self._file = rank_file(rank)
        self._min_bytes = subprocess_min_bytes
        self._manager: Any = None if subprocess_min_bytes > 0 else self._start()
        self._small = StagedWriter()

    def _start(self) -> Any:
        from torch_checkpointing import CheckpointManager, ItemSpec
        from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
        from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        config = CheckpointManager.Config(
            items={"tensors": ItemSpec(layout=LayoutInfo(self._file, SafetensorsSerialization()))},
            default=None,
            save=AsyncCheckpointSaverConfig(
                # ftitan's commit protocol: each rank's manager writes its own file into ftitan's temp dir
                writer_config=CheckpointWriterConfig(barrier_config=None, write_to_temp_dir=False),
                # save() returns once the tensors are copied: the train step updates them in place next
                staging_config=CheckpointStagerConfig(use_async_staging=False),
            ),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
        with _main_not_reimported() as patched:
            manager = CheckpointManager(config)  # spawns its writer subprocess, from a thread
            if patched:  # the spawn reads __main__'s spec as it starts the child: wait for that
                _wait_until_spawned(manager)
        return manager

    def write(self, tmp: Path, rank: int, tensors: dict[str, torch.Tensor]) -> Done:
        if not tensors:
            return list
        if self._manager is None:
            if sum(t.numel() * t.element_size() for t in tensors.values()) < self._min_bytes:
                return self._small.write(tmp, rank, tensors)
            self._manager = self._start()
        future = self._manager.save(str(tmp), {"tensors": tensors})

        def done() -> list[str]:
            if future is not None:
                future.result()
            return [self._file]

        return done

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()


class DCPWriter(Writer):
    name = "dcp"

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        pin = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))  # fmt: skip
        self._storages: list[torch.UntypedStorage] = []

    def write(self, tmp: Path, rank: int, tensors: dict[str, torch.Tensor]) -> Done:
        if not tensors:
            return list
        # DCP's stager reuses its CPU copy of a storage while that storage's Python object lives: keep them
        self._storages = [t.untyped_storage() for t in tensors.values()]
        staged = self._stager.stage(tensors)  # a CPU copy: training may change the originals from here on
        sub = tmp / f"rank{rank:05d}"

        def done() -> list[str]:
            import torch.distributed.checkpoint as dcp

            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(staged, storage_writer=dcp.HuggingFaceStorageWriter(str(sub)), no_dist=True)
            (sub / "model.safetensors.index.json").unlink(missing_ok=True)  # ftitan's manifest maps the keys
            return sorted(f"{sub.name}/{p.name}" for p in sub.glob("*.safetensors"))

        return done

    def close(self) -> None:
        self._stager.close()


def make_writer(backend: str, *, rank: int, subprocess_min_bytes: int = 0) -> Writer:
    """The writer named ``backend`` (one of :data:`BACKENDS`); ``subprocess_min_bytes``: see
    :class:`TorchCheckpointingWriter`."""
    if backend == "torch-checkpointing":
        return TorchCheckpointingWriter(rank, subprocess_min_bytes=subprocess_min_bytes)
    if backend == "dcp":
        return DCPWriter()
    if backend == "sync":
        return Writer()
    raise ValueError(f"checkpoint backend {backend!r}: expected one of {BACKENDS} (--checkpoint.backend)")
