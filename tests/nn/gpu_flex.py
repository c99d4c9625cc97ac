"""FlexAttention on a real GPU: ftitan's masks, compiled, forward + backward vs SDPA with the same mask.

A prepared script for a lent GPU (not collected by pytest): ``python tests/nn/gpu_flex.py`` prints one
JSON line per mask kind, dtype and length, then exits non-zero if a check failed. It loads
``ftitan/nn/flex.py`` by path (it needs torch only), so it runs on the GPU image (torch 2.11) without
ftitan's other dependencies. ``--smoke`` runs tiny sizes on the CPU, forward only under ``no_grad``
(FlexAttention has no CPU backward).

Checks: output and q/k/v gradients of ``torch.compile(flex.attention)`` vs
``F.scaled_dot_product_attention`` with the mask materialized from the same mask function
(``flex.dense``), max error relative to the reference's max magnitude: fp32 2e-3 (TF32 may be on in
either kernel), bf16 2 ** -5. Timings (CUDA events, median ms, forward + backward): flex (block mask
from the cache, or built per call for the per-batch kinds) and SDPA (``is_causal`` for the plain causal
mask, the dense mask otherwise). Decides whether ``attn_impl="auto"`` (flex on CUDA under compile) is a
safe family default (docs/kernels.md, attention section).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_spec = importlib.util.spec_from_file_location("ftitan_nn_flex", Path(__file__).parents[2] / "ftitan/nn/flex.py")
flex = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = flex  # dynamo looks traced functions up by module name
_spec.loader.exec_module(flex)

TOL = {torch.float32: 2e-3, torch.bfloat16: 2**-5}


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


def _masks(b: int, t: int, device: torch.device) -> dict[str, dict]:
    g = torch.Generator().manual_seed(0)
    cuts = torch.randperm(t - 1, generator=g)[:3].sort().values + 1
    seg = torch.bucketize(torch.arange(t), cuts, right=True).expand(b, t).to(device)
    explicit = (torch.rand(b, t, t, generator=g) < 0.3).to(device) | torch.eye(t, dtype=torch.bool, device=device)
    return {
        "causal": {"causal": True},
        "window": {"causal": True, "window": 128},
        "document": {"causal": True, "segments": seg},
        "prefix_rows": {"causal": True, "prefix": torch.randint(0, t, (b,), generator=g).to(device)},
        "mask": {"causal": False, "mask": explicit},
    }


def _run(fn, q, k, v, cot, grad: bool):
    if not grad:
        with torch.no_grad():
            return (fn(q, k, v),)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, cot))


def check(kind: str, kw: dict, dtype: torch.dtype, b: int, t: int, h: int, kv: int, dh: int,
          device: torch.device, reps: int, grad: bool) -> bool:  # fmt: skip
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(b, t, h, dh, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(b, t, kv, dh, device=device, dtype=dtype, generator=g) for _ in range(2))
    cot = torch.randn(b, t, h, dh, device=device, dtype=dtype, generator=g)
    scale = dh**-0.5
    m = flex.mask_of(b, t, t, **kw)
    dense = flex.dense(m, device=device)
    causal_only = kw == {"causal": True}

    def flex_fn(q, k, v):
        return flex.attention(q, k, v, m, scale=scale)

    def sdpa_fn(q, k, v):
        mask = None if causal_only or dense is None else (dense[:, None] if dense.dim() == 3 else dense)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           is_causal=causal_only, scale=scale, enable_gqa=h != kv)  # fmt: skip
        return o.transpose(1, 2)

    compiled = torch.compile(flex_fn, fullgraph=True, dynamic=False)  # one shape per case
    got, want = _run(compiled, q, k, v, cot, grad), _run(sdpa_fn, q, k, v, cot, grad)
    errs = [float((a.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6))
            for a, w in zip(got, want, strict=True)]  # fmt: skip
    ok = max(errs) <= TOL[dtype]
    row = {"kind": kind, "dtype": str(dtype).removeprefix("torch."), "B": b, "T": t, "H": h, "KV": kv, "Dh": dh,
           "rel_err": dict(zip(["out", "dq", "dk", "dv"][: len(errs)], errs, strict=True)), "ok": ok,
           "flex_ms": _time(lambda: _run(compiled, q, k, v, cot, grad), device, reps),
           "sdpa_ms": _time(lambda: _run(sdpa_fn, q, k, v, cot, grad), device, reps),
           "block_mask_build_ms": _time(lambda: flex.create_block_mask(m.mod, m.batch, None, t, t, device=device),
                                        device, reps) if m.mod is not None else None}  # fmt: skip
    print(json.dumps(row), flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, forward only")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    grad = not args.smoke
    sizes = [(1, 150, 4, 2, 16)] if args.smoke else [(4, 2048, 16, 4, 128), (2, 8192, 16, 4, 128), (2, 1000, 8, 8, 64)]
    dtypes = [torch.float32] if args.smoke else [torch.bfloat16, torch.float32]
    ok = True
    for b, t, h, kv, dh in sizes:
        for dtype in dtypes:
            for kind, kw in _masks(b, t, device).items():
                try:
                    ok &= check(kind, kw, dtype, b, t, h, kv, dh, device, args.reps, grad)
                except Exception as e:  # one line per failure, then the next case
                    print(json.dumps({"kind": kind, "dtype": str(dtype), "T": t, "error": repr(e)[:500]}), flush=True)
                    ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
