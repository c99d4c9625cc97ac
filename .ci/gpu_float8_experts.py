"""On a CUDA machine (compute capability 9.0+, torchao in .whl/): the MoE experts' float8 grouped GEMM
(``ftitan.nn.float8.grouped_mm``: torchao's ``_scaled_grouped_mm`` path on the groups padded to 16 rows)
against its CPU-tested emulation of the same recipe (``_GroupedRowwise``), and its speed against the bf16
grouped GEMM, forward + backward, at a DeepSeek-V3-like expert shape.

Prints one ``RESULT {...}`` JSON line. Off CUDA it runs the emulation alone (a smoke run). Run from the
repository root: ``python .ci/gpu_float8_experts.py``.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import torch

from ftitan.kernels.grouped_mm import grouped_mm
from ftitan.nn import float8


def timed(fn, *args, reps: int = 10) -> float:
    fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def main() -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    experts, dim, hidden, rows = (16, 2048, 1408, 16384) if cuda else (4, 64, 48, 256)
    g = torch.Generator(device="cpu").manual_seed(0)
    counts = torch.distributions.Dirichlet(torch.ones(experts)).sample() * rows  # uneven experts
    offs = counts.round().cumsum(0).clamp(max=rows).to(torch.int32)
    offs[-1] = rows
    x = torch.randn(rows, dim, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(experts, hidden, dim, generator=g) * 0.02).to(device, torch.bfloat16)
    w = w.transpose(-2, -1).requires_grad_()  # (E, K, N) column-major, as the experts pass it
    gy = torch.randn(rows, hidden, generator=g).to(device, torch.bfloat16)
    offs = offs.to(device)
    if cuda:  # what a config with float8_experts does before its first step
        float8.check_experts(SimpleNamespace(float8_experts=True, attn_impl="sdpa"), "check", {})

    def step(mm):
        y = mm(x, w, offs)
        return (y, *torch.autograd.grad(y, (x, w), gy))

    emulated = step(float8._GroupedRowwise.apply)
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": [experts, dim, hidden, rows]}
    if cuda:
        fast = step(float8.grouped_mm)
        out["rel_diff_vs_emulation"] = [float((a.float() - b.float()).norm() / b.float().norm())
                                        for a, b in zip(fast, emulated)]  # fmt: skip
        flops = 3 * 2 * rows * dim * hidden
        for name, mm in (("float8", float8.grouped_mm), ("bf16", grouped_mm)):
            seconds = timed(step, mm)
            out[f"{name}_ms"], out[f"{name}_tflops"] = seconds * 1e3, flops / seconds / 1e12
        out["float8_speedup"] = out["bf16_ms"] / out["float8_ms"]
    else:
        out["emulated_finite"] = all(bool(t.isfinite().all()) for t in emulated)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
