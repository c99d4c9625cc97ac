"""Memory: what a run's training state needs, checked before anything is allocated, and out-of-memory
errors as one line that names the run and the fix.

``check_fits(cfg, device)`` estimates the bytes of the params, their gradients and the optimizer state
from the model's meta-device init (nothing is allocated) and refuses a single-process run whose state
cannot fit in the memory available on ``device``, before the data is prepared. Activations come on
top, so the estimate is a lower bound: a run that passes may still run out of memory, which
:func:`out_of_memory_message` then reports.

Example::

    check_fits(get_recipe("llama3-8b"), torch.device("cpu"))
    # ValueError: --device cpu: training this llama model (8.03B params) needs at least 144.5 GB ...
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import torch

from ftitan import tree as T

if TYPE_CHECKING:
    from ftitan.config.schema import TrainConfig

__all__ = [
    "available_bytes",
    "check_fits",
    "is_out_of_memory",
    "out_of_memory_message",
    "retain_freed_memory",
    "state_bytes",
]

# how allocators word running out: torch.OutOfMemoryError (CUDA), the CPU allocator's RuntimeError
_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "not enough memory")
# "Tried to allocate 2.00 GiB" (CUDA), "you tried to allocate 123456789 bytes" (CPU)
_ASKED = re.compile(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]?i?B|\d+ bytes)")


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _param_count(cfg: TrainConfig) -> int:
    from ftitan import random
    from ftitan.models import registry

    return T.size(registry.model_for(cfg.model).init(random.key(0), device="meta"))


def state_bytes(cfg: TrainConfig) -> tuple[int, int]:
    """``(params, bytes)``: the model's parameter count, and the bytes its training state holds at once:
    fp32 params, their gradients, the optimizer state, and a compute-dtype copy of the params when
    ``--mixed-precision.compute`` is not fp32. From meta tensors: allocates nothing."""
    from ftitan import random
    from ftitan.optim.masking import subset
    from ftitan.train import post
    from ftitan.train.precision import dtype_of
    from ftitan.train.state import init_state

    model = post.model_of(cfg)
    shapes = model.init(random.key(cfg.seed), device="meta")
    opt, trainable = post.optimizer_of(cfg, model, shapes), post.trainable_of(cfg)
    opt_state = init_state(shapes, opt, rng=random.key(cfg.seed), trainable=trainable).opt_state
    grads = T.nbytes(shapes if trainable is None else subset(trainable, shapes))  # LoRA: the adapters' only
    n, params = T.size(shapes), T.nbytes(shapes)
    compute = dtype_of(cfg.mixed_precision.compute)
    copy = 0 if compute == torch.float32 else n * compute.itemsize
    return n, params + grads + T.nbytes(opt_state) + copy


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MALLOC_RETAIN = {
    "mmap_threshold": 32 << 20,  # the largest glibc takes: blocks up to 32 MiB come from (and go back to) the heap
    "trim_threshold": 1 << 30,  # free memory at the heap's top goes back to the OS only past 1 GiB
    "top_pad": 64 << 20,  # and the heap grows 64 MiB at a time
}
_RETAINED: dict[str, int] | None = None


def retain_freed_memory() -> dict[str, int]:
    """Keep the host memory a training step frees for the next step, instead of handing it back to the OS
    and faulting it in again: glibc's ``mallopt`` with :data:`MALLOC_RETAIN`. Process-wide; idempotent.
    Returns the settings applied, ``{}`` where the C library is not glibc (nothing changed).

    Why: glibc hands a freed block back to the OS when it was mapped on its own (blocks above the mmap
    threshold, 128 KiB at first and raised as such blocks are freed) or when it lies in free memory at the
    heap's top past the trim threshold (twice the mmap threshold); the next allocation of it maps fresh,
    zeroed pages, a page fault per 4 KiB. A training step frees its activations and gradients and allocates
    them again in the next step, so every step touched them as new pages: the CPU benchmark's compiled step
    (``ftitan bench step``'s ftitan-compiled, trained alone in a process) took ~70,000 minor page faults and
    0.14 s of system time per 1.1 s step, and ran ~7% faster with these settings (~30 faults a step;
    docs/compile-and-memory.md: whether a process faults under glibc's defaults depends on what else it
    allocated). The cost: the process
    keeps its peak heap (up to 1 GiB of free memory at its top) instead of shrinking between steps; blocks
    over 32 MiB are still mapped on their own. ``ftitan train`` and ``ftitan rl`` call it for CPU runs
    (``--malloc-retain``; ``ftitan.train.runtime.setup``)."""
    global _RETAINED
    if _RETAINED is not None:
        return dict(_RETAINED)
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        _RETAINED = {}
        return {}
    libc = ctypes.CDLL(None)
    for name, param in (("mmap_threshold", _M_MMAP_THRESHOLD), ("trim_threshold", _M_TRIM_THRESHOLD),
                        ("top_pad", _M_TOP_PAD)):  # fmt: skip
        if libc.mallopt(param, MALLOC_RETAIN[name]) != 1:
            raise RuntimeError(f"retain_freed_memory: glibc refused mallopt({name}={MALLOC_RETAIN[name]})")
    _RETAINED = dict(MALLOC_RETAIN)
    return dict(_RETAINED)


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can take on ``device``: free GPU memory, or the host's ``MemAvailable``."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(cfg: TrainConfig, device: torch.device) -> None:
    """Raise ``ValueError`` naming the model, what it needs and the fixes when a single process's training
    state (:func:`state_bytes`) exceeds :func:`available_bytes` on ``device``. Under torchrun
    (``WORLD_SIZE`` > 1) each rank holds a share that depends on the layout; nothing is checked."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    n, need = state_bytes(cfg)
    have = available_bytes(device)
    if need <= have:
        return
    from ftitan.models import registry

    compute = cfg.mixed_precision.compute
    copy = "" if compute == "fp32" else f", and a {compute} copy of the params"
    raise ValueError(
        f"--device {device.type}: training this {registry.family_name(cfg.model)} model ({_count(n)} params) "
        f"needs at least {_gb(need)} for its fp32 params, gradients and {cfg.optim.name} state{copy} (before "
        f"activations), but {_gb(have)} is available on {device}; use a smaller model (--model.n-layers, "
        f"--model.dim, --recipe), a device with more memory, or shard it over more ranks (torchrun with "
        f"--parallel.dp-shard N)"
    )


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocator running out: ``torch.OutOfMemoryError``, ``MemoryError``, or the CPU
    allocator's ``RuntimeError``."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in _CPU_OOM)


def out_of_memory_message(err: BaseException, cfg: TrainConfig | None = None) -> str:
    """One line for an out-of-memory ``err``: what was asked, the run (model size, batch, sequence length,
    precision, device) and what to change."""
    m = _ASKED.search(str(err))
    amount = (_gb(int(m.group(1).split()[0])) if m.group(1).endswith(" bytes") else m.group(1)) if m else ""
    asked = f"asked for {amount} more" if m else type(err).__name__
    if cfg is None:
        return f"out of memory ({asked}); use a smaller model, batch or sequence length"
    d, mp = cfg.data, cfg.mixed_precision.compute
    device = cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = "" if mp != "fp32" else "use --mixed-precision.compute bf16, "
    return (
        f"out of memory on --device {device} ({asked}) training {_count(_param_count(cfg))} params on "
        f"--data.batch-size {d.batch_size} x --data.seq-len {d.seq_len} (--accum-steps {cfg.accum_steps}, "
        f"--mixed-precision.compute {mp}, --parallel.dp-shard {cfg.parallel.dp_shard}); lower --data.batch-size "
        f"(raise --accum-steps to keep the batch) or --data.seq-len, {bf16}or shard over more ranks "
        f"(--parallel.dp-shard)"
    )
