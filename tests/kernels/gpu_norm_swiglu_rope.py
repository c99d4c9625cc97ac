"""The RMSNorm, SwiGLU and RoPE kernels on a real GPU: checks against the references, then timings.

A prepared script for a lent GPU (not collected by pytest): ``python tests/kernels/gpu_norm_swiglu_rope.py``
prints one JSON line per kernel, dtype and size. ``--smoke`` runs tiny sizes on the CPU in the Triton
interpreter (what can be checked without a GPU). Checks: output and input gradients vs the pure-torch
references (max error relative to the reference's max magnitude; fp32: 1e-5, bf16: 2 ** -5, see
tests/kernels/test_*.py). Timings, forward + backward (median of CUDA-event timed runs, ms): the kernel,
the reference eager, and the reference under ``torch.compile`` (inductor, which fuses these elementwise
and row ops itself: the bar a hand-written kernel has to clear).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from ftitan import nn  # noqa: E402
from ftitan.kernels import op  # noqa: E402
from ftitan.kernels import rms_norm as R  # noqa: E402
from ftitan.kernels import rope as P  # noqa: E402
from ftitan.kernels import swiglu as S  # noqa: E402


def _emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


def _time(fn, device: torch.device, reps: int) -> float:  # milliseconds, median
    fn()
    if device.type != "cuda":
        return float("nan")
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fwd_bwd(fn, inputs, cot):
    """``fn(*inputs)`` and the gradients of ``<out, cot>`` w.r.t. the inputs that are floating point."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    wrt = [x for x in leaves if x.requires_grad]
    return (out.detach(), *torch.autograd.grad(out, wrt, cot))


def _compare(name: str, kernel, reference, inputs, cot, device: torch.device, reps: int, **info: object) -> None:
    got, want = _fwd_bwd(kernel, inputs, cot), _fwd_bwd(reference, inputs, cot)
    rel = [float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))
           for a, b in zip(got, want, strict=True)]  # fmt: skip
    # bf16: a normalized value one ulp apart (rstd summed in another order) rounds again after the scale:
    # up to ~2 ulps of the largest output (measured 0.016 in the smoke run), so 2 ** -5
    tol = 1e-5 if inputs[0].dtype == torch.float32 else 2**-5
    row = dict(check=name, dtype=str(inputs[0].dtype), rel_err_out_grads=rel, ok=all(r <= tol for r in rel), **info)
    if device.type == "cuda":
        compiled = torch.compile(reference)
        row.update(kernel_fwd_bwd_ms=_time(lambda: _fwd_bwd(kernel, inputs, cot), device, reps),
                   reference_eager_ms=_time(lambda: _fwd_bwd(reference, inputs, cot), device, reps),
                   reference_compiled_ms=_time(lambda: _fwd_bwd(compiled, inputs, cot), device, reps))  # fmt: skip
    _emit(**row)


def check_rms_norm(device: torch.device, rows: int, d: int, dtype: torch.dtype, reps: int) -> None:
    x = torch.randn(rows, d, device=device).to(dtype)
    w = 1 + 0.1 * torch.randn(d, device=device)  # fp32 master scale
    _compare("rms_norm", lambda x, w: R.rms_norm(x, w, 1e-6), lambda x, w: R.rms_norm_reference(x, w, 1e-6),
             (x, w), torch.randn_like(x), device, reps, rows=rows, d=d)  # fmt: skip


def check_swiglu(device: torch.device, rows: int, f: int, dtype: torch.dtype, reps: int) -> None:
    gate, up = (torch.randn(rows, f, device=device).to(dtype) for _ in range(2))
    _compare("swiglu", S.swiglu, S.swiglu_reference, (gate, up), torch.randn_like(gate), device, reps, rows=rows, f=f)


def check_rope(device: torch.device, b: int, t: int, hq: int, hk: int, dh: int, dtype: torch.dtype, reps: int) -> None:
    q, k = torch.randn(b, t, hq, dh, device=device).to(dtype), torch.randn(b, t, hk, dh, device=device).to(dtype)
    cos, sin = nn.rope_cos_sin(torch.arange(t, device=device), nn.rope_inv_freq(dh, 500_000.0, device=device))

    def kernel(q, k):
        return torch.cat([y.flatten() for y in P.apply_rope_qk(q, k, cos, sin)])

    def reference(q, k):
        return torch.cat([P.apply_rope_reference(q, cos, sin).flatten(), P.apply_rope_reference(k, cos, sin).flatten()])

    cot = torch.randn(q.numel() + k.numel(), device=device).to(dtype)
    _compare("rope_qk", kernel, reference, (q, k), cot, device, reps, b=b, t=t, hq=hq, hk=hk, dh=dh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU in the Triton interpreter")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if args.smoke:
        cpu = torch.device("cpu")
        with op.interpret():
            for dtype in (torch.float32, torch.bfloat16):
                check_rms_norm(cpu, 7, 37, dtype, 1)
                check_swiglu(cpu, 3, 1100, dtype, 1)
                check_rope(cpu, 2, 5, 3, 1, 12, dtype, 1)
        return
    device = torch.device("cuda")
    _emit(device=torch.cuda.get_device_name(), torch=torch.__version__)
    for dtype in (torch.bfloat16, torch.float32):  # Llama-3-8B-like shapes, 16k tokens
        check_rms_norm(device, 16384, 4096, dtype, args.reps)
        check_swiglu(device, 16384, 14336, dtype, args.reps)
        check_rope(device, 8, 2048, 32, 8, 128, dtype, args.reps)


if __name__ == "__main__":
    main()
