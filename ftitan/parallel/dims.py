"""``ParallelDims``: the six parallel degrees, checked against the world size, and the mesh they name.

Mesh axes, outermost first: ``pp, dp_replicate, dp_shard, ep, cp, tp``. Every
axis is always present (size 1 when unused), so placements have one entry per
axis and code never asks whether an axis exists.

- ``dp_replicate``: data parallel, params replicated (DDP-like).
- ``dp_shard``: data parallel, params stored sharded, gathered for compute
  (FSDP-like).
- ``ep``: expert parallel. Routed experts are sharded over it; everything
  else treats it as one more data-parallel axis (its ranks read different
  batches), so ``ep`` multiplies the world size like the other degrees.
- ``cp``: context parallel (the sequence is split across its ranks).
- ``tp``: tensor parallel (heads, MLP width and vocab split across its ranks).
- ``pp``: pipeline parallel (the layers split into stages).
"""

from __future__ import annotations

import math
import os
import sys
from typing import NoReturn

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["AXES", "DATA_AXES", "ParallelDims", "end_rank", "mesh", "shutdown"]

AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
# axes whose ranks see different tokens: a replicated param's gradient is summed over them
DATA_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "ep", "cp")


def _positive(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"parallel.{attribute.name}={value!r}: must be an int >= 1")


@attrs.frozen(kw_only=True)
class ParallelDims:
    """Degree of each parallel dimension; their product is the world size."""

    dp_replicate: int = attrs.field(default=1, validator=_positive)  # replicated data parallel (DDP)
    dp_shard: int = attrs.field(default=1, validator=_positive)  # sharded data parallel (FSDP)
    ep: int = attrs.field(default=1, validator=_positive)  # expert parallel (routed experts split)
    cp: int = attrs.field(default=1, validator=_positive)  # context parallel (sequence split)
    tp: int = attrs.field(default=1, validator=_positive)  # tensor parallel (heads / MLP / vocab split)
    pp: int = attrs.field(default=1, validator=_positive)  # pipeline parallel (layers split into stages)

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in ``AXES`` order."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def data_parallel(self) -> int:
        """How many different batches one step reads: ``dp_replicate * dp_shard * ep``."""
        return self.dp_replicate * self.dp_shard * self.ep

    def check(self, world_size: int) -> None:
        """Raise naming the product when the degrees do not multiply to ``world_size`` (the processes launched)."""
        if self.world_size != world_size:
            product = " * ".join(f"{a} {getattr(self, a)}" for a in AXES if getattr(self, a) > 1) or "all 1"
            raise ValueError(
                f"--parallel.*: degrees {product} = {self.world_size}, but {world_size} processes were launched "
                f"(the world size); make the product equal {world_size} (e.g. --parallel.dp-shard {world_size}) "
                f"or launch torchrun --nproc-per-node {self.world_size}"
            )


def mesh(dims: ParallelDims | None = None, /, *, device_type: str | None = None, **degrees: int) -> DeviceMesh:
    """The ``DeviceMesh`` for ``dims`` (or keyword degrees, e.g. ``mesh(dp_shard=2, tp=2)``).

    Needs an initialized process group whose size is the product of the
    degrees. Axes are named as in ``AXES``; size-1 axes are kept. Made once per
    degrees and process group: a second call hands back the same mesh (its
    groups), a call after the process group was made again a new one.
    """
    if dims is None:
        dims = ParallelDims(**degrees)
    elif degrees:
        raise TypeError("mesh: pass a ParallelDims or keyword degrees, not both")
    if not dist.is_initialized():
        raise RuntimeError(
            "parallel.mesh: no process group; launch with torchrun and call "
            "torch.distributed.init_process_group('gloo') (CPU) or 'nccl' (CUDA) first"
        )
    dims.check(dist.get_world_size())
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    # one mesh per shape and process group: each init_device_mesh makes new groups (collectively), and
    # every gloo group keeps its own polling threads for the life of the process (a launch that built a
    # mesh per check held ~380 gloo_tcp_loop threads a rank, which spent more CPU than the checks did)
    key = (device_type, dims.shape)
    made_in, made = _MESHES.get(key, (None, None))
    if made is None or made_in is not dist.group.WORLD:  # none yet, or the process group was made again
        made = init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
        _MESHES[key] = (dist.group.WORLD, made)
    return made


_MESHES: dict[tuple[str, tuple[int, ...]], tuple[object, DeviceMesh]] = {}  # (device, shape) -> (WORLD, mesh)


def shutdown() -> None:
    """Leave the process group: a barrier first, so no rank tears down gloo while another still talks
    to it (a rank exiting early aborted with "terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _MESHES.clear()


def end_rank(code: int = 0) -> NoReturn:
    """End a launched rank's process once its work is done: :func:`shutdown` (the barrier, then the
    process group destroyed), then flush stdout and stderr and ``os._exit(code)``, skipping the
    interpreter's finalization. The last line of a script run by ``torchrun`` (it never returns).

    Why: a rank that finished every collective and destroyed its process group could still abort at exit
    with "terminate called without an active exception" (SIGABRT; torchrun then fails the whole run). In a
    test run of ``examples/flexshard_train.py`` the faulthandler's dump showed the main thread with no
    Python frame left: the abort came during finalization, as pytorch/pytorch#179291 describes for gloo (a
    C++ thread that takes the GIL while the interpreter finalizes is ended with ``pthread_exit``, whose
    unwinding through a ``noexcept`` frame calls ``std::terminate``). Whatever the rank wrote must be
    closed or flushed by then (files, checkpoints); Python's ``atexit`` handlers do not run."""
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
