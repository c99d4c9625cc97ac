"""GPU check of the Gated DeltaNet chunk kernel and the Helion RMSNorm (not collected by pytest: run it on a
lent GPU, ``python tests/kernels/gpu_gdn_helion.py``): values and gradients against the references at
model sizes, then forward and forward+backward times, kernel vs reference (CUDA events, median of 20).
Prints one JSON line per check."""

from __future__ import annotations

import json
import statistics

import torch

from ftitan.kernels import gdn as kg


def _time(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _max_diff(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def check_gdn(b: int = 2, t: int = 4096, hk: int = 16, hv: int = 32, d: int = 128, dtype=torch.bfloat16) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(b, t, hk, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    v = torch.randn(b, t, hv, d, device="cuda", generator=g).to(dtype)
    decay = -torch.rand(b, t, hv, device="cuda", generator=g) * 0.5
    beta = torch.rand(b, t, hv, device="cuda", generator=g).to(dtype)
    xs = [x.requires_grad_() for x in (q, k, v, decay, beta)]
    dy = torch.randn(b, t, hv, d, device="cuda", generator=g).to(dtype)

    def fwd(fn):
        return fn(*xs, chunk=64)

    def fwd_bwd(fn):
        o, s = fn(*xs, chunk=64)
        return torch.autograd.grad((o * dy).sum() + s.sum(), xs)

    out = {"check": "gdn", "shape": [b, t, hk, hv, d], "dtype": str(dtype)}
    out["fwd_max_diff"] = _max_diff(fwd(kg.chunk_delta_rule), fwd(kg.chunk_delta_rule_reference))
    out["grad_max_diff"] = _max_diff(fwd_bwd(kg.chunk_delta_rule), fwd_bwd(kg.chunk_delta_rule_reference))
    for name, fn in (("kernel", kg.chunk_delta_rule), ("reference", kg.chunk_delta_rule_reference)):
        out[f"{name}_fwd_ms"] = _time(lambda fn=fn: fwd(fn))
        out[f"{name}_fwd_bwd_ms"] = _time(lambda fn=fn: fwd_bwd(fn))
    return out


def check_helion_rms_norm(rows: int = 16384, dim: int = 4096, dtype=torch.bfloat16) -> dict:
    try:
        from ftitan.kernels import helion_rms_norm as hr
    except ImportError as e:  # the GPU image may lack helion
        return {"check": "helion_rms_norm", "skipped": str(e)}
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, dim, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(dim, device="cuda", generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(rows, dim, device="cuda", generator=g).to(dtype)

    def fwd_bwd(fn):
        return torch.autograd.grad((fn(x, w, 1e-6) * dy).sum(), (x, w))

    out = {"check": "helion_rms_norm", "shape": [rows, dim], "dtype": str(dtype)}
    out["fwd_max_diff"] = _max_diff([hr.rms_norm(x, w, 1e-6)], [hr.rms_norm_reference(x, w, 1e-6)])
    out["grad_max_diff"] = _max_diff(fwd_bwd(hr.rms_norm), fwd_bwd(hr.rms_norm_reference))
    for name, fn in (("kernel", hr.rms_norm), ("reference", hr.rms_norm_reference)):
        out[f"{name}_fwd_ms"] = _time(lambda fn=fn: fn(x, w, 1e-6))
        out[f"{name}_fwd_bwd_ms"] = _time(lambda fn=fn: fwd_bwd(fn))
    return out


if __name__ == "__main__":
    for check in (lambda: check_gdn(dtype=torch.float32), check_gdn, check_helion_rms_norm):
        try:
            print(json.dumps(check()), flush=True)
        except Exception as e:  # report and go on: one failing check must not hide the others
            print(json.dumps({"error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)
