"""``ftitan bench kernels``: each ``ftitan.kernels`` kernel against its reference, side by side.

For every kernel, in the same process, alternating after warm-up: the
kernel, its pure-torch reference eager, and the reference under
``torch.compile`` (inductor: what a compiled train step would run without
the kernel), forward alone and forward + backward (where the kernel has
one). Ratios are ``reference time / kernel time`` (above 1: the kernel is
faster). The shapes are Llama-3-8B-like (bf16) on CUDA: the GPU
measurement, one prepared command for a lent machine::

    ftitan bench kernels --out kernels.json

On the CPU the kernels run only in the Triton interpreter: ``--quick``
with ``TRITON_INTERPRET=1`` runs tiny shapes as a smoke test (its times
mean nothing), which is what the test does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import attrs
import torch

from ftitan.bench import timing

__all__ = ["CASES", "Options", "main", "run"]


@attrs.frozen(kw_only=True)
class Options:
    """Options of ``ftitan bench kernels``."""

    kernels: tuple[str, ...] = ()
    """Which kernels (empty: all of CASES)."""
    warmup: int = 3
    """Untimed calls per peer (the first compiles)."""
    rounds: int = 10
    """Timed round-robin rounds; medians are reported."""
    quick: bool = False
    """Tiny shapes (a smoke run on the CPU under TRITON_INTERPRET=1, not a measurement)."""
    compiled_reference: bool = True
    """Also time the reference under torch.compile (inductor)."""
    device: str = "auto"
    """"auto" (CUDA when available), "cpu" or "cuda"."""
    out: Path | None = None
    """Also write the JSON to this file."""


class Case(NamedTuple):
    kernel: Callable[..., Any]  # the public ftitan.kernels function
    reference: Callable[..., Any]  # its pure-torch reference, same arguments
    inputs: Callable[[bool, torch.device], tuple[tuple[Any, ...], tuple[int, ...]]]  # (quick, device) -> (args,
    # indices of the args to differentiate: empty = forward only)
    rows: Callable[[tuple[Any, ...]], int]  # work items reported per call (tokens)


def _randn(*shape: int, device: torch.device, dtype: torch.dtype = torch.bfloat16, grad: bool = False) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(sum(shape))
    return torch.randn(*shape, generator=g, device=device, dtype=dtype).requires_grad_(grad)


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _rms_norm_inputs(quick: bool, device: torch.device) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    n, d = (40, 96) if quick else (16384, 4096)
    dt = _dtype(device)
    return (_randn(n, d, device=device, dtype=dt, grad=True), _randn(d, device=device, dtype=dt, grad=True), 1e-5), (0, 1)


def _swiglu_inputs(quick: bool, device: torch.device) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    n, f = (40, 96) if quick else (8192, 14336)
    dt = _dtype(device)
    return (_randn(n, f, device=device, dtype=dt, grad=True), _randn(n, f, device=device, dtype=dt, grad=True)), (0, 1)


def _rope_inputs(quick: bool, device: torch.device) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    from ftitan import nn

    b, t, h, dh = (2, 12, 2, 16) if quick else (4, 4096, 32, 128)
    inv = nn.rope_inv_freq(dh, 500_000.0, None, device=device)
    cos, sin = nn.rope_cos_sin(torch.arange(t, device=device), inv)
    dt = _dtype(device)
    return (_randn(b, t, h, dh, device=device, dtype=dt, grad=True), cos.to(dt), sin.to(dt)), (0,)


def _ce_inputs(quick: bool, device: torch.device) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    n, d, v = (40, 32, 300) if quick else (8192, 4096, 128256)
    dt = _dtype(device)
    targets = torch.randint(0, v, (n,), generator=torch.Generator(device=device).manual_seed(0), device=device)
    return (_randn(n, d, device=device, dtype=dt, grad=True), _randn(v, d, device=device, dtype=dt, grad=True) * 0.02,
            targets), (0, 1)  # fmt: skip


def _gdn_inputs(quick: bool, device: torch.device) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    b, t, hk, hv, dk, dv = (1, 20, 1, 2, 16, 16) if quick else (4, 4096, 16, 32, 128, 128)
    dt = _dtype(device)
    q, k = (torch.nn.functional.normalize(_randn(b, t, hk, dk, device=device, dtype=torch.float32), dim=-1).to(dt)
            .requires_grad_() for _ in range(2))  # fmt: skip
    v = _randn(b, t, hv, dv, device=device, dtype=dt, grad=True)
    g = (-torch.rand(b, t, hv, device=device) * 0.1).requires_grad_()
    beta = torch.rand(b, t, hv, device=device).requires_grad_()
    return (q, k, v, g, beta), (0, 1, 2, 3, 4)


def _permute_inputs(quick: bool, device: torch.device) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    from ftitan.kernels import permute

    n, k, e, d = (24, 2, 4, 32) if quick else (16384, 8, 128, 4096)
    experts = torch.randint(0, e, (n, k), generator=torch.Generator(device=device).manual_seed(1), device=device)
    perm = permute.sort_by_expert(experts, e)
    return (_randn(n, d, device=device, dtype=_dtype(device), grad=True), perm.pos, n * k), (0,)


def _quantize_inputs(quick: bool, device: torch.device) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    n, d = (24, 300) if quick else (8192, 8192)
    return (_randn(n, d, device=device, dtype=torch.float32), "fp8"), ()


def _cases() -> dict[str, Case]:
    from ftitan.kernels import gdn, helion_rms_norm, linear_cross_entropy, permute, quantize, rms_norm, rope, swiglu

    def first(fn: Callable[..., Any]) -> Callable[..., Any]:  # a (out, state) op timed on its output
        return lambda *a: fn(*a)[0]

    rows0: Callable[[tuple[Any, ...]], int] = lambda a: a[0].shape[0]  # noqa: E731
    bt: Callable[[tuple[Any, ...]], int] = lambda a: a[0].shape[0] * a[0].shape[1]  # noqa: E731
    return {
        "rms_norm": Case(rms_norm.rms_norm, rms_norm.rms_norm_reference, _rms_norm_inputs, rows0),
        "rms_norm_helion": Case(helion_rms_norm.rms_norm, helion_rms_norm.rms_norm_reference, _rms_norm_inputs, rows0),
        "swiglu": Case(swiglu.swiglu, swiglu.swiglu_reference, _swiglu_inputs, rows0),
        "rope": Case(rope.apply_rope, rope.apply_rope_reference, _rope_inputs, bt),
        "linear_cross_entropy": Case(linear_cross_entropy.linear_cross_entropy,
                                     linear_cross_entropy.linear_cross_entropy_reference, _ce_inputs, rows0),
        "gdn_chunk": Case(first(gdn.chunk_delta_rule), first(gdn.chunk_delta_rule_reference), _gdn_inputs, bt),
        "moe_dispatch": Case(permute.dispatch, permute.dispatch_reference, _permute_inputs, rows0),
        "quantize_fp8": Case(first(quantize.quantize), first(quantize.quantize_reference), _quantize_inputs, rows0),
    }  # fmt: skip


CASES = ("rms_norm", "rms_norm_helion", "swiglu", "rope", "linear_cross_entropy", "gdn_chunk", "moe_dispatch",
         "quantize_fp8")  # fmt: skip


def _fwd_bwd(fn: Callable[..., Any], args: tuple[Any, ...], wrt: tuple[int, ...]) -> Callable[[], Any]:
    """One forward + backward of ``fn(*args)`` against a fixed random cotangent."""
    out = fn(*args)
    dy = torch.randn_like(out.float()).to(out.dtype)
    leaves = [args[i] for i in wrt]

    def call() -> Any:
        y = fn(*args)
        return torch.autograd.grad(y, leaves, dy)

    return call


def _peers(case: Case, args: tuple[Any, ...], wrt: tuple[int, ...], compiled: bool) -> dict[str, Callable[[], Any]]:
    fns = {"kernel": case.kernel, "reference": case.reference}
    if compiled:
        fns["reference-compiled"] = torch.compile(case.reference, dynamic=False)
    peers: dict[str, Callable[[], Any]] = {}
    for name, fn in fns.items():
        peers[f"{name}/fwd"] = lambda fn=fn: fn(*args)
        if wrt:
            peers[f"{name}/fwd+bwd"] = _fwd_bwd(fn, args, wrt)
    return peers


def _errors(case: Case, args: tuple[Any, ...], wrt: tuple[int, ...]) -> dict[str, float]:
    """Largest absolute difference, kernel vs reference, of the output and of each input's gradient (same
    inputs, same cotangent): the check that the kernel is right on this device at these shapes."""
    def run(fn: Callable[..., Any]) -> list[torch.Tensor]:
        out = fn(*args)
        if not wrt:
            return [out]
        dy = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(2), device=out.device)
        return [out, *torch.autograd.grad(out, [args[i] for i in wrt], dy.to(out.dtype))]

    got, want = run(case.kernel), run(case.reference)
    names = ["out", *(f"grad[{i}]" for i in wrt)]
    return {n: (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            for n, a, b in zip(names, got, want, strict=True)}  # fmt: skip


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, r in results.items():
        peer, mode = key.split("/", 1)
        if peer != "kernel" and f"kernel/{mode}" in results:
            out[f"{peer}/kernel ({mode})"] = r["median_s"] / results[f"kernel/{mode}"]["median_s"]
    return out


def run(opts: Options) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result."""
    from ftitan.kernels import op
    from ftitan.train.runtime import resolve_device

    device = resolve_device(opts.device)
    names = opts.kernels or CASES
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"--kernels {unknown}: expected names from {CASES}")
    if device.type != "cuda" and not opts.quick:
        raise ValueError("ftitan bench kernels: the kernels run on CUDA; on the CPU pass --quick (with "
                         "TRITON_INTERPRET=1: a smoke run of the interpreter, not a measurement)")  # fmt: skip
    cases = _cases()
    out: dict[str, Any] = {}
    with op.interpret(device.type != "cuda"):
        for name in names:
            case = cases[name]
            args, wrt = case.inputs(opts.quick, device)
            peers = _peers(case, args, wrt, opts.compiled_reference and device.type == "cuda")
            measured = timing.time_steps(peers, tokens_per_step=case.rows(args), warmup=opts.warmup,
                                         rounds=opts.rounds)  # fmt: skip
            out[name] = {"results": measured["results"], "ratios": _ratios(measured["results"]),
                         "errors": _errors(case, args, wrt)}
    return {
        "bench": "kernels",
        "config": {"device": str(device), "quick": opts.quick, "kernels": list(names)},
        "machine": timing.machine_info(),
        "results": {n: r["results"] for n, r in out.items()},
        "errors": {n: r["errors"] for n, r in out.items()},  # kernel vs reference, max |diff|
        "ratios": {f"{n}: {k}": v for n, r in out.items() for k, v in r["ratios"].items()},
        "goals": {},
        "met": None,
    }


def main(argv: list[str] | None = None) -> int:
    return timing.cli(Options, run, argv, prog="ftitan bench kernels", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
