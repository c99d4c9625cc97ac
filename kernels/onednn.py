"""The linear layers' GEMMs on the CPU in the faster of oneDNN and MKL (``ftitan.kernels.onednn``).

A model whose ``kernels`` is not "torch" runs its projections (attention,
MLP, the output head) through :func:`linear` on the CPU. Torch's ``aten::mm``
calls MKL's fp32 ``sgemm``; oneDNN's matmul (the primitive behind
``torch.ops.mkldnn._linear_pointwise``, which inductor uses for frozen
inference weights) is faster on some CPUs and slower on others
(docs/kernels.md). Both are float32 GEMMs accumulating in float32; they
differ only in summation order, so the values agree to float32 rounding, not
bit for bit.

- **Which library.** Each of a linear layer's three GEMMs, the forward
  ``x @ w.T`` (kind "nt"), the input gradient ``g @ w`` ("nn": ``w.T`` passed
  to oneDNN as its weight, read as a view) and the weight gradient
  ``g.T @ x`` (:func:`gemm_tn`, "tn"; also the fused cross-entropy's
  head gradient), runs in whichever library is faster for its kind and shape
  on this machine: the first call of each times both (a few calls each) and
  keeps oneDNN only where it is at least :data:`MARGIN` faster than
  ``aten::mm``. The pick is remembered per machine (CPU model, threads,
  torch) in :data:`CACHE` under ftitan's cache root, so later processes there
  take the same library without probing and reruns stay bit for bit; the
  first process to record a shape's pick decides for every process on the
  machine (the ranks of a run that probe at once run the same library).
  Measured (2 threads): on an AMD EPYC whose AVX512 runs at half width
  (oneDNN's 2048^3 peak 212 GFLOP/s) oneDNN ran the forward shapes 10-25%
  faster and ``aten::mm`` the weight gradients as fast or faster; on one
  with full-width AVX512 (Zen 5, peak 440) oneDNN ran all three ~2x faster
  (the weight gradients 335-426 against 190-209 GFLOP/s: MKL's ``sgemm``
  stays near its half-width speed there); on an Intel Xeon MKL's 2048^3
  peak was the higher (378 against 327). :func:`choices` reports the
  picks; :func:`pin` fixes the library in a process (e.g. to compare the
  two: they differ in summation order only).
- **The ops.** ``ftitan_kernels::onednn_linear`` and ``ftitan_kernels::gemm_tn``
  (``ftitan.kernels.op.define``), opaque nodes to ``torch.compile(
  fullgraph=True)``: inductor's own lowering of ``_linear_pointwise`` takes
  constant (frozen) weights only.
- **Derivative.** A ``torch.autograd.Function`` with ``setup_context``; under
  ``torch.func`` transforms or forward AD :func:`usable` is False and the
  plain ``F.linear`` runs (``ftitan.kernels.op``), so ``vmap``/``grad``/``jvp``
  see plain ops and a train step that wants oneDNN differentiates with
  ``grad_impl="autograd"`` (``ftitan train`` does for ``--kernels`` other than
  "torch"). A double backward (``create_graph=True``) runs plain ops.
- **Where.** float32 CPU tensors (plain, not DTensors) with a 2-D weight, and a
  GEMM big enough that oneDNN's ~20 us more per call does not dominate
  (:data:`MIN_WEIGHT` or :data:`MIN_FLOP`); elsewhere ``F.linear``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ftitan._cache import cache_root
from ftitan.kernels import op

__all__ = ["CACHE", "LIBRARIES", "MARGIN", "MIN_FLOP", "MIN_WEIGHT", "available", "choices", "gemm_in", "gemm_nt",
           "gemm_tn", "linear", "pin", "usable"]

MIN_WEIGHT = 1 << 18  # in * out elements: from here oneDNN won at every row count measured (1 to 1024 rows)
MIN_FLOP = 1 << 25  # or 2 * rows * in * out: a small weight with enough rows (e.g. 256 x 512 x 128) wins too


_AVAILABLE = torch.backends.mkldnn.is_available()  # read once: dynamo refuses to trace torch.backends


def available() -> bool:
    """Whether this torch has oneDNN (``torch.backends.mkldnn``) to run :func:`linear` with."""
    return _AVAILABLE


def _nt_aten(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()  # MKL reads w as it lies (transposed or not)


def _nt_onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # w may be a transposed view


def _tn_aten(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return g.t() @ x  # MKL reads both transposed as they lie


def _tn_onednn(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # a.T @ b as (a.T) @ (b.T).T: oneDNN reads b.T as a transposed weight view, and its input a.T is copied
    # dense; the operands are taken in the order that copies the fewer elements (g.T, or x.T and the result)
    rows, m, n = g.shape[0], g.shape[1], x.shape[1]
    if rows * m <= rows * n + m * n:
        return _nt_onednn(g.t(), x.t())
    return _nt_onednn(x.t(), g.t()).t().contiguous()


LIBRARIES = ("aten", "onednn")
MARGIN = 1.05  # oneDNN must be this much faster than aten::mm to run a shape (ties keep aten)
_PROBE_CALLS = 3  # timed calls per library (after one untimed), medians compared
_choice: dict[tuple[str, int, int, int], str] = {}  # (kind, rows, m, n) -> library, this process's picks
_pinned: str | None = None


def pin(library: str | None) -> None:
    """Run every GEMM of this module (:func:`linear`'s three, :func:`gemm_nt`, :func:`gemm_tn`) in
    ``library`` (one of :data:`LIBRARIES`); ``None``: back to the per-shape pick."""
    global _pinned
    if library is not None and library not in LIBRARIES:
        raise ValueError(f"pin({library!r}): expected one of {LIBRARIES} or None")
    _pinned = library


def choices() -> dict[str, str]:
    """The library each GEMM shape this process ran takes (probed, or read from the cache file), as
    ``{"kind rows x m x n": library}``: kind "nt" ``x @ w.T`` (``x`` rows x m, ``w`` n x m as stored: a
    forward), "nn" ``x @ w`` (``w`` m x n as stored: an input gradient), "tn" ``g.T @ x`` (``g`` rows x m,
    ``x`` rows x n: a weight gradient); the pinned library, if any, as ``{"pinned": library}``."""
    picks = {_label(k): v for k, v in sorted(_choice.items())}
    return picks | ({"pinned": _pinned} if _pinned else {})


def _label(key: tuple[str, int, int, int]) -> str:
    """``"kind rows x m x n"``: a pick's name in :func:`choices` and in the cache file."""
    return f"{key[0]} {key[1]}x{key[2]}x{key[3]}"


def _key(kind: str, a: torch.Tensor, b: torch.Tensor) -> tuple[str, int, int, int]:
    """``(kind, rows, m, n)`` of a product (see :func:`choices`); "nt" becomes "nn" where ``w`` is a transposed
    view of a stored ``(m, n)`` matrix: an input gradient ``g @ w`` passed as ``w.t()``."""
    if kind == "tn":
        return "tn", a.shape[0], a.shape[1], b.shape[1]
    m = a.shape[-1]
    rows = a.numel() // max(m, 1)
    return ("nt" if b.stride(-1) == 1 else "nn"), rows, m, b.shape[0]


def gemm_in(library: str, kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A product in ``library`` itself, not the one picked for its shape (for measurements: ``ftitan bench``'s
    GEMM peak of each library): kind "nt" ``a @ b.T`` (``b`` as stored, or a transposed view), "tn"
    ``a.T @ b``."""
    if library not in LIBRARIES or kind not in ("nt", "tn"):
        raise ValueError(f"gemm_in({library!r}, {kind!r}): expected a library of {LIBRARIES} and kind 'nt' or 'tn'")
    return _run(kind, library, a, b)


def _run(kind: str, library: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if kind == "tn":
        return _tn_onednn(a, b) if library == "onednn" else _tn_aten(a, b)
    return _nt_onednn(a, b) if library == "onednn" else _nt_aten(a, b)


def _probe(kind: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """The library for a product: each timed on these operands (one untimed call, then medians)."""
    times = {}
    for library in LIBRARIES:
        _run(kind, library, a, b)
        runs = []
        for _ in range(_PROBE_CALLS):
            start = time.perf_counter()
            _run(kind, library, a, b)
            runs.append(time.perf_counter() - start)
        times[library] = sorted(runs)[len(runs) // 2]
    return "onednn" if times["onednn"] * MARGIN <= times["aten"] else "aten"


CACHE = "gemm_libraries.json"  # under ftitan's cache root: {machine: {"kind rows x m x n": library}}


def _machine() -> str:
    """What the picks depend on: the CPU (its name, family and model: virtual machines may show only "AMD
    EPYC" as the name), the thread count, torch."""
    cpu = {"model name": platform.machine()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0].splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cpu family", "model"):
                cpu[key.strip()] = value.strip()
    name = cpu["model name"]
    if "cpu family" in cpu and "model" in cpu:
        name += f" (family {cpu['cpu family']}, model {cpu['model']})"
    return f"{name} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def _saved() -> dict[str, dict[str, str]]:
    try:
        saved = json.loads((cache_root() / CACHE).read_text())
    except (OSError, ValueError):
        saved = {}
    if not isinstance(saved, dict):
        return {}
    return {machine: picks for machine, picks in saved.items() if isinstance(picks, dict)}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s lock file (``fcntl.flock``; released if the process dies) while
    the cache file is read and written: one process at a time. Where no lock can be taken (an unwritable
    cache, no ``fcntl``) the body runs unlocked."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(f"{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _settle(shape: str, library: str) -> str:
    """A probe's pick for ``shape``, settled with the cache file under its lock: if another process on this
    machine (another rank of the same run) recorded a pick for the shape meanwhile, that one is returned and
    run here too, else ``library`` is recorded (read, merge, write a temporary file, rename: a reader never
    sees half a file). So the ranks of a machine run one library per shape, in this run and in a rerun that
    reads the file. An unwritable cache costs the next process a probe."""
    path = cache_root() / CACHE
    with _locked(path):
        saved = _saved()
        picks = saved.setdefault(_machine(), {})
        if picks.get(shape) in LIBRARIES:
            return picks[shape]
        picks[shape] = library
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(saved, indent=1, sort_keys=True))
            os.replace(tmp, path)
    return library


def _library(kind: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """The pinned library, else this product's pick: this process's, the cache file's for this machine (so
    reruns on a machine take the same libraries, bit for bit), or a new probe's, settled with the file
    (:func:`_settle`: the first process to record a pick decides for every process on the machine)."""
    if _pinned is not None:
        return _pinned
    key = _key(kind, a, b)
    library = _choice.get(key)
    if library is None:
        shape = _label(key)
        library = _saved().get(_machine(), {}).get(shape)
        if library not in LIBRARIES:
            library = _settle(shape, _probe(kind, a, b))
        _choice[key] = library
    return library


def _linear_impl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _run("nt", _library("nt", x, w), x, w)


def _linear_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


_linear_op = op.define("onednn_linear", "(Tensor x, Tensor w) -> Tensor", _linear_impl, _linear_fake,
                       keys=("CPU",))  # fmt: skip


def gemm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in the faster library for its shape (see the module docstring), without a derivative: for
    code that forms its gradients itself (the fused cross-entropy's forward). ``w`` may be a transposed view
    (``g @ m`` is ``gemm_nt(g, m.t())``)."""
    return _linear_op(x, w)


def _gemm_tn_impl(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _run("tn", _library("tn", g, x), g, x)


def _gemm_tn_fake(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return g.new_empty((g.shape[1], x.shape[1]))


_tn_op = op.define("gemm_tn", "(Tensor g, Tensor x) -> Tensor", _gemm_tn_impl, _gemm_tn_fake, keys=("CPU",))


def gemm_tn(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g.T @ x`` for 2-D float32 CPU tensors with the same rows (a weight gradient: ``g`` the output
    gradient, ``x`` the input), without a derivative, in the library the module docstring's "Which library"
    picks for the shape; ``aten::mm`` where oneDNN is missing. Both operands are taken as they lie: the
    probe then times oneDNN with the dense copy it needs (a ``g.T`` made in the caller's graph instead, which
    inductor fused into ``g``'s producer as a slow transposed store, was no faster: 0.502-0.517 against
    0.511-0.543 s a step, Zen 5, three processes each)."""
    if not available():
        return g.t() @ x
    return _tn_op(g, x)


def usable(x: torch.Tensor, w: torch.Tensor, *, dtype: torch.dtype | None = None) -> bool:
    """True where :func:`linear` runs its GEMMs through this module's ops (each in the library picked for its
    shape) rather than ``F.linear``: see the module docstring's "Where". ``dtype``:
    the one the GEMM runs in when the caller casts ``x`` and ``w`` to it first (default theirs)."""
    if not (available() and op.no_transform()):
        return False
    if not (op.plain(x, w) and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1]):
        return False
    if not all(t.device.type == "cpu" and (dtype or t.dtype) == torch.float32 for t in (x, w)):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return w.numel() >= MIN_WEIGHT or 2 * rows * w.numel() >= MIN_FLOP


class _Linear(torch.autograd.Function):
    """``x @ w.T`` and the input gradient by the ``onednn_linear`` op, the weight gradient by :func:`gemm_tn`
    (each in the library picked for its shape)."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _linear_op(x, w)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            # create_graph=True: plain ops, whose own derivatives autograd knows
            gx = g @ w if torch.is_grad_enabled() else _linear_op(g, w.t())
        if ctx.needs_input_grad[1]:
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            gw = g2.t() @ x2 if torch.is_grad_enabled() else gemm_tn(g2, x2)
        return gx, gw


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` (``F.linear``), the GEMMs in the faster library for each shape where :func:`usable`
    holds."""
    if not usable(x, w):
        return F.linear(x, w, b)
    y = _Linear.apply(x, w)
    return y if b is None else y + b
