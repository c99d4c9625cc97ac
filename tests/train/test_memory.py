"""Memory: the up-front check of a run's training state, and out-of-memory errors as one line."""

import pytest
import torch

from ftitan.config import get_recipe
from ftitan.train import memory

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB of which 1.2 GiB "
            "is free.")  # fmt: skip
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 137438953472 bytes. Error code 12 (Cannot allocate memory)")  # fmt: skip


@pytest.mark.parametrize(("err", "asked"), [(torch.OutOfMemoryError(CUDA_OOM), "2.00 GiB"),
                                            (RuntimeError(CPU_OOM), "137.4 GB")])  # fmt: skip
def test_an_out_of_memory_error_names_the_run_what_was_asked_and_the_fixes(err, asked):
    assert memory.is_out_of_memory(err)
    msg = memory.out_of_memory_message(err, get_recipe("llama3-debug"))
    assert "\n" not in msg and f"asked for {asked} more" in msg and "training 4.1M params" in msg
    for part in ("--data.batch-size 8", "--data.seq-len 256", "--mixed-precision.compute", "--parallel.dp-shard"):
        assert part in msg
    assert not memory.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_a_state_too_large_for_the_device_is_refused_from_meta_shapes(monkeypatch):
    cfg = get_recipe("llama3-8b")
    n, need = memory.state_bytes(cfg)  # fp32 params + grads + AdamW's two moments (+ a bf16 copy)
    assert n > 8e9 and need >= 16 * n
    monkeypatch.setattr(memory, "available_bytes", lambda device: 64 << 30)
    with pytest.raises(ValueError, match=r"--device cpu: training this llama model \(8\.03B params\) needs at least "
                       r"\d+\.\d GB .* but 68\.7 GB is available"):  # fmt: skip
        memory.check_fits(cfg, torch.device("cpu"))
    memory.check_fits(get_recipe("llama3-debug"), torch.device("cpu"))  # a small one fits


_FAULTS = """
import json, resource, torch
from ftitan.train import memory


def faults():  # what steps do: the same blocks (8 of 12 MiB) allocated, written, freed
    out = []
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(3 << 20) for _ in range(8)]
        del blocks
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return out


default = faults()
applied, again = memory.retain_freed_memory(), memory.retain_freed_memory()
print(json.dumps({"default": default, "retain": faults(), "applied": applied, "again": again}))
"""


def test_retained_memory_is_not_faulted_in_again_step_after_step():
    """Under glibc's defaults the blocks a step frees go back to the OS (munmap, or trimmed off the heap's
    top) and the next step faults them in again, a fault per 4 KiB page; after retain_freed_memory they come
    back from the heap. In a process of its own: the setting is process-wide, and the defaults are measured
    first. (Under the defaults a stray allocation can pin the freed blocks in the heap after a few steps, so
    the defaults are asked for one step's worth of faults after the first, not for faults in every step.)"""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])
    pages = 8 * (12 << 20) // 4096  # the pages one iteration writes
    assert sum(run["default"][1:]) >= pages, run  # glibc's defaults: faulted in again
    assert sum(run["retain"][1:]) <= pages // 50, run  # retained: (almost) none once the heap holds them
    assert run["applied"] == run["again"] == memory.MALLOC_RETAIN  # idempotent


@pytest.mark.parametrize("retain", [True, False])
def test_a_cpu_run_retains_freed_memory_unless_told_not_to(tiny_run_cfg, monkeypatch, retain):
    import attrs

    from ftitan.train.trainer import train

    calls = []
    monkeypatch.setattr(memory, "retain_freed_memory", lambda: calls.append(1) or {})
    train(attrs.evolve(tiny_run_cfg, steps=2, eval_every=0, malloc_retain=retain), progress=False)
    assert len(calls) == (1 if retain else 0)
