"""The linear cross-entropy and quantize kernels on a real GPU: checks against the references, then timings.

A prepared script for a lent GPU (not collected by pytest): ``python tests/kernels/gpu_lce_quantize.py``
prints one JSON line per check and timing. ``--smoke`` runs tiny sizes on the CPU in the Triton
interpreter (what can be checked without a GPU). Checks: quantize / dequantize bit-identical to
``ftitan.flexshard.quant``'s references (int8, fp8; row blocks and tiles); the cross-entropy's loss and
gradients vs ``F.cross_entropy`` of float32 logits (fp32 inputs: 1e-4 relative; bf16: 2 ** -6). Timings
(median of CUDA-event timed runs): the kernels vs the torch paths they replace (``chunked_cross_entropy``'s
fused chunked Function, ``quant.quantize_reference``), forward + backward for the loss, and the peak
memory of each loss path.
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

from ftitan.flexshard import quant  # noqa: E402
from ftitan.kernels import linear_cross_entropy as L  # noqa: E402
from ftitan.kernels import op  # noqa: E402
from ftitan.kernels import quantize as Q  # noqa: E402
from ftitan.train import losses  # noqa: E402


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


def check_quantize(device: torch.device, shape: tuple[int, int], reps: int) -> None:
    x = torch.randn(shape, device=device) * torch.logspace(-3, 1, shape[-1], device=device)
    for fmt in ("int8", "fp8"):
        for block in (128, (128, 128)):
            rq, rs = quant.quantize_reference(x, fmt, block)
            q, s = Q.quantize(x, fmt, block)
            y, ry = Q.dequantize(rq, rs, block), quant.dequantize_reference(rq, rs, block)
            same = all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                       for a, b in ((q, rq), (s, rs), (y, ry)))  # fmt: skip
            _emit(check="quantize", fmt=fmt, block=str(block), shape=shape, bit_identical=same,
                  kernel_ms=_time(lambda: Q.quantize(x, fmt, block), device, reps),
                  reference_ms=_time(lambda: quant.quantize_reference(x, fmt, block), device, reps),
                  dequantize_kernel_ms=_time(lambda: Q.dequantize(rq, rs, block), device, reps),
                  dequantize_reference_ms=_time(lambda: quant.dequantize_reference(rq, rs, block), device, reps))


def check_lce(device: torch.device, n: int, v: int, d: int, dtype: torch.dtype, cap: float | None, reps: int,
              tiles: tuple[int, int, int] | None) -> None:  # fmt: skip
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, d, device=device, generator=g).to(dtype)
    w = (torch.randn(v, d, device=device, generator=g) / d**0.5).to(dtype)
    t = torch.randint(0, v, (n,), device=device, generator=g)
    t[::7] = -100

    def kernel():
        hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = L.linear_cross_entropy(hk, wk, t, softcap=cap, tiles=tiles)
        return (loss, *torch.autograd.grad(loss, (hk, wk)))

    def chunked():  # the torch path the kernel replaces (fused chunked Function, 1024-row chunks)
        hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = losses.chunked_cross_entropy(hk, wk, t, reduction="sum", logit_softcap=cap)
        return (loss, *torch.autograd.grad(loss, (hk, wk)))

    hr, wr = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()  # (.float() of fp32 is itself)
    ref_loss = L.linear_cross_entropy_reference(hr, wr, t, softcap=cap)
    ref = (ref_loss.detach(), *torch.autograd.grad(ref_loss, (hr, wr)))
    del hr, wr, ref_loss
    got = kernel()
    rel = [float((a.detach().float() - b).abs().max() / b.abs().max().clamp(min=1e-30))
           for a, b in zip(got, ref, strict=True)]  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else 2**-6
    peaks = {}
    for name, fn in (("kernel", kernel), ("chunked", chunked)):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        fn()
        peaks[name] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    _emit(check="linear_cross_entropy", n=n, v=v, d=d, dtype=str(dtype), cap=cap, rel_err_loss_dh_dw=rel,
          ok=all(r <= tol for r in rel), kernel_fwd_bwd_ms=_time(kernel, device, reps),
          chunked_fwd_bwd_ms=_time(chunked, device, reps), peak_gib=peaks)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU in the Triton interpreter")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if args.smoke:
        with op.interpret():
            check_quantize(torch.device("cpu"), (40, 300), 1)
            check_lce(torch.device("cpu"), 53, 101, 40, torch.bfloat16, 3.0, 1, (16, 32, 16))
        return
    device = torch.device("cuda")
    _emit(device=torch.cuda.get_device_name(), torch=torch.__version__)
    check_quantize(device, (8192, 8192), args.reps)
    for dtype in (torch.bfloat16, torch.float32):
        check_lce(device, 8192, 128256, 4096, dtype, None, args.reps, None)
    check_lce(device, 8192, 128256, 4096, torch.bfloat16, 30.0, args.reps, None)


if __name__ == "__main__":
    main()
