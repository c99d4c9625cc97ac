"""The CPU's GEMMs in the fastest of MKL and oneDNN per shape (``ftitan.kernels.onednn``).

A model whose ``kernels`` is not "torch" runs its projections (attention,
MLP, the output head) through :func:`linear` on the CPU, and its ``gemm``
attention's batched GEMMs through :func:`matmul`. Three libraries
(:data:`LIBRARIES`) run a float32 GEMM there:

- "aten": torch's ``aten::mm``/``bmm``, which call MKL's ``sgemm``; it reads
  transposed operands in place.
- "onednn": oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``,
  which inductor uses for frozen inference weights); its input must be dense,
  so a weight gradient ``g.T @ x`` pays a transposed copy; no batch.
- "onednn-matmul": oneDNN's matmul primitive reached through ``aten::mm``/``bmm``
  themselves, which torch routes there for float32 operands only under
  ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` (set around the
  call and restored). That setting lets oneDNN round the operands to bfloat16
  where it has such a kernel (AMX CPUs); elsewhere it runs its float32 kernel.
  So it runs only where :func:`float32_exact` holds: never on an AMX CPU, and
  each shape and layout is checked against float64 first. Strided operands
  are read in place (no copies) and batches run in one call.

All three accumulate float32 in float32 and differ only in summation order,
so the values agree to float32 rounding, not bit for bit. MKL's ``sgemm``
runs at half its Intel speed on AMD CPUs (its AVX512 path is Intel's): on a
Zen 5 EPYC oneDNN ran ~2x faster.

- **Which library.** Each of a linear layer's three GEMMs, the forward
  ``x @ w.T`` (kind "nt"), the input gradient ``g @ w`` ("nn": ``w.T`` passed
  to oneDNN as its weight, read as a view) and the weight gradient
  ``g.T @ x`` (:func:`gemm_tn`, "tn"; also the fused cross-entropy's
  head gradient), and each batched product of :func:`matmul` (kinds "bmm-nn",
  "bmm-nt", ...: which operand is read transposed) runs in whichever library
  is fastest for its kind and shape on this machine: the first call of each
  times every library that can run it (a few calls each) and keeps a oneDNN
  one only where it is at least :data:`MARGIN` faster than ``aten::mm``. The
  pick is remembered per machine (CPU model, threads, torch) in
  :data:`CACHE` under ftitan's cache root, so later processes there take
  the same library without probing and reruns stay bit for bit; the
  first process to record a shape's pick decides for every process on the
  machine (the ranks of a run that probe at once run the same library).
  Measured (2 threads): on an AMD EPYC whose AVX512 runs at half width
  (oneDNN's 2048^3 peak 212 GFLOP/s) oneDNN ran the forward shapes 10-25%
  faster and ``aten::mm`` the weight gradients as fast or faster; on one
  with full-width AVX512 (Zen 5, peak 440) oneDNN ran all three ~2x faster
  (the weight gradients 335-426 against 190-209 GFLOP/s: MKL's ``sgemm``
  stays near its half-width speed there), and "onednn-matmul" the weight
  gradients at 467-505 (no transposed copies) and the attention's ~2x
  ``aten::bmm``; on an Intel Xeon MKL's 2048^3 peak was the higher (378
  against 327). :func:`choices` reports the picks; :func:`pin` fixes the
  library in a process (e.g. to compare them: they differ in summation
  order only).
- **The ops.** ``ftitan_kernels::onednn_linear``, ``ftitan_kernels::gemm_tn``
  and ``ftitan_kernels::onednn_bmm`` (``ftitan.kernels.op.define``), opaque
  nodes to ``torch.compile(fullgraph=True)``: inductor's own lowering of
  ``_linear_pointwise`` takes constant (frozen) weights only, and the
  precision setting is read when a GEMM runs.
- **Derivative.** A ``torch.autograd.Function`` with ``setup_context``; under
  ``torch.func`` transforms or forward AD :func:`usable` is False and the
  plain ``F.linear`` (``torch.matmul``) runs (``ftitan.kernels.op``), so ``vmap``/``grad``/``jvp``
  see plain ops and a train step that wants oneDNN differentiates with
  ``grad_impl="autograd"`` (``ftitan train`` does for ``--kernels`` other than
  "torch"). A double backward (``create_graph=True``) runs plain ops.
- **Where.** float32 CPU tensors (plain, not DTensors) with a 2-D weight, and a
  GEMM big enough that oneDNN's ~20 us more per call does not dominate
  (:data:`MIN_WEIGHT` or :data:`MIN_FLOP`); elsewhere ``F.linear``. :func:`matmul`:
  float32 CPU tensors with the same batch dimensions, any size.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ftitan._cache import cache_root
from ftitan.kernels import op

__all__ = ["CACHE", "FP32_TOL", "LIBRARIES", "MARGIN", "MIN_FLOP", "MIN_WEIGHT", "available", "choices", "cpuinfo",
           "float32_exact", "gemm_in", "gemm_nt", "gemm_tn", "linear", "matmul", "pin", "usable"]

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


LIBRARIES = ("aten", "onednn", "onednn-matmul")
MARGIN = 1.05  # a oneDNN library must be this much faster than aten::mm to run a shape (ties keep aten)
FP32_TOL = 1e-4  # "onednn-matmul" runs a shape only where its error is float32's (~1e-6; bf16's is ~2e-3)
_PROBE_CALLS = 3  # timed calls per library (after one untimed), medians compared
_choice: dict[tuple[Any, ...], str] = {}  # _key (kind and sizes) -> library: this process's picks
_pinned: str | None = None


def pin(library: str | None) -> None:
    """Run every GEMM of this module (:func:`linear`'s three, :func:`gemm_nt`, :func:`gemm_tn`, :func:`matmul`'s)
    in ``library`` (one of :data:`LIBRARIES`; an "onednn" pin runs the batched ones in aten: the inner product
    has no batch); ``None``: back to the per-shape pick. "onednn-matmul" is refused on an AMX CPU, and raises
    on a shape it does not compute in float32 (:func:`float32_exact`)."""
    global _pinned
    if library is not None and library not in LIBRARIES:
        raise ValueError(f"pin({library!r}): expected one of {LIBRARIES} or None")
    if library == "onednn-matmul" and _amx():
        raise ValueError("pin('onednn-matmul') (--gemm-library onednn-matmul): this CPU has AMX, where oneDNN's "
                         "matmul rounds float32 operands to bfloat16 under the setting that reaches it; use auto, aten "
                         "or onednn")
    _pinned = library


def choices() -> dict[str, str]:
    """The library each GEMM shape this process ran takes (probed, or read from the cache file), as
    ``{"kind rows x m x n": library}``: kind "nt" ``x @ w.T`` (``x`` rows x m, ``w`` n x m as stored: a
    forward), "nn" ``x @ w`` (``w`` m x n as stored: an input gradient), "tn" ``g.T @ x`` (``g`` rows x m,
    ``x`` rows x n: a weight gradient), and :func:`matmul`'s "bmm-ab batch x m x k x n" (``a`` and ``b`` read
    as stored, "n", or transposed, "t"); the pinned library, if any, as ``{"pinned": library}``."""
    picks = {_label(k): v for k, v in sorted(_choice.items())}
    return picks | ({"pinned": _pinned} if _pinned else {})


def _label(key: tuple[Any, ...]) -> str:
    """``"kind rows x m x n"`` (``"bmm-ab batch x m x k x n"``): a pick's name in :func:`choices` and in the cache
    file."""
    return f"{key[0]} {'x'.join(map(str, key[1:]))}"


def _key(kind: str, a: torch.Tensor, b: torch.Tensor) -> tuple[Any, ...]:
    """``(kind, rows, m, n)`` of a product (see :func:`choices`); "nt" becomes "nn" where ``w`` is a transposed
    view of a stored ``(m, n)`` matrix: an input gradient ``g @ w`` passed as ``w.t()``. A batched product
    ``a @ b`` ("bmm") is ``("bmm-" + layout, batch, m, k, n)``, the layout "n" or "t" per operand (its last
    dimension contiguous or not: attention's keys are read transposed)."""
    if kind == "tn":
        return "tn", a.shape[0], a.shape[1], b.shape[1]
    if kind == "bmm":
        layout = "".join("n" if t.stride(-1) == 1 else "t" for t in (a, b))
        return f"bmm-{layout}", a.shape[0], a.shape[1], a.shape[2], b.shape[2]
    m = a.shape[-1]
    rows = a.numel() // max(m, 1)
    return ("nt" if b.stride(-1) == 1 else "nn"), rows, m, b.shape[0]


def gemm_in(library: str, kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A product in ``library`` itself, not the one picked for its shape (for measurements: ``ftitan bench``'s
    GEMM peak of each library): kind "nt" ``a @ b.T`` (``b`` as stored, or a transposed view), "tn"
    ``a.T @ b``."""
    if library not in LIBRARIES or kind not in ("nt", "tn"):
        raise ValueError(f"gemm_in({library!r}, {kind!r}): expected a library of {LIBRARIES} and kind 'nt' or 'tn'")
    if library == "onednn-matmul" and not float32_exact(kind, a, b):
        raise ValueError(f"gemm_in('onednn-matmul', {kind!r}): not float32 on this machine (see float32_exact)")
    return _run(kind, library, a, b)


def _run(kind: str, library: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if library == "onednn-matmul":  # aten's own call, which torch routes to oneDNN's matmul under this setting
        setting = torch.backends.mkldnn.matmul
        before, setting.fp32_precision = setting.fp32_precision, "bf16"
        try:
            return _aten(kind, a, b)
        finally:
            setting.fp32_precision = before
    if library == "onednn" and not kind.startswith("bmm"):  # oneDNN's inner product has no batch
        return _tn_onednn(a, b) if kind == "tn" else _nt_onednn(a, b)
    return _aten(kind, a, b)


def _aten(kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if kind.startswith("bmm"):
        return torch.bmm(a, b)
    return _tn_aten(a, b) if kind == "tn" else _nt_aten(a, b)


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "flags", ...), read once; empty where there is
    none. Also ``ftitan.bench.timing``'s (its ``cpu_flags`` and machine info)."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0].splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return fields


def _amx() -> bool:
    """Whether this CPU has AMX, where oneDNN's matmul rounds float32 operands to bfloat16 (:func:`float32_exact`)."""
    return "amx_bf16" in cpuinfo().get("flags", "").split()


_float32: dict[tuple[Any, ...], bool] = {}  # key -> whether "onednn-matmul" computes it in float32 here


def float32_exact(kind: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the "onednn-matmul" library computes this product (its kind, shape and layout) in float32 on this
    machine. Torch reaches oneDNN's matmul for float32 operands only under its ``fp32_precision="bf16"`` setting,
    which lets oneDNN round them to bfloat16 where it has such a kernel (AMX); on other CPUs it runs its float32
    kernel. So: never on a CPU with AMX, elsewhere checked once per process and shape on random operands of
    this layout against float64 (max error over max value within :data:`FP32_TOL`: float32's is ~1e-6, a
    bfloat16 rounding's ~2e-3)."""
    key = _key(kind, a, b)
    if key not in _float32:
        _float32[key] = not _amx() and _check_float32(kind, a, b)
    return _float32[key]


def _check_float32(kind: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    g = torch.Generator().manual_seed(0)
    # random operands with a's and b's sizes and strides, over just the span of memory each one reads
    ra, rb = (torch.randn(1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0,
                          generator=g).as_strided(t.shape, t.stride()) for t in (a, b))  # fmt: skip
    want = _aten(kind, ra.double(), rb.double())
    if not want.numel():
        return True
    err = (_run(kind, "onednn-matmul", ra, rb).double() - want).abs().max()
    return bool(err <= FP32_TOL * want.abs().max())


def _probe(kind: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """The library for a product: each timed on these operands (one untimed call, then medians)."""
    times = {}
    for library in _candidates(kind, a, b):
        _run(kind, library, a, b)
        runs = []
        for _ in range(_PROBE_CALLS):
            start = time.perf_counter()
            _run(kind, library, a, b)
            runs.append(time.perf_counter() - start)
        times[library] = sorted(runs)[len(runs) // 2]
    best = min(times, key=times.__getitem__)
    return best if times[best] * MARGIN <= times["aten"] else "aten"


def _candidates(kind: str, a: torch.Tensor, b: torch.Tensor) -> list[str]:
    return [library for library in LIBRARIES if _usable(kind, library, a, b)]


def _usable(kind: str, library: Any, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``library`` can run a product here: oneDNN's inner product has no batch ("bmm" kinds), and
    "onednn-matmul" runs only where it computes float32 (:func:`float32_exact`)."""
    if library == "onednn":
        return not kind.startswith("bmm")
    return library == "aten" or (library == "onednn-matmul" and float32_exact(kind, a, b))


CACHE = "gemm_picks.json"  # under ftitan's cache root: {machine: {"kind rows x m x n": library}}


def _machine() -> str:
    """What the picks depend on: the CPU (its name, family and model: virtual machines may show only "AMD
    EPYC" as the name), the thread count, torch."""
    cpu = {"model name": platform.machine(), **cpuinfo()}
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


def _settle(shape: str, library: str, usable: Callable[[Any], bool]) -> str:
    """A probe's pick for ``shape``, settled with the cache file under its lock: if another process on this
    machine (another rank of the same run) recorded a pick for the shape meanwhile, that one is returned and
    run here too, else ``library`` is recorded (read, merge, write a temporary file, rename: a reader never
    sees half a file). So the ranks of a machine run one library per shape, in this run and in a rerun that
    reads the file. An unwritable cache costs the next process a probe. A recorded pick that is not ``usable``
    here is replaced."""
    path = cache_root() / CACHE
    with _locked(path):
        saved = _saved()
        picks = saved.setdefault(_machine(), {})
        if usable(picks.get(shape)):
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
    (:func:`_settle`: the first process to record a pick decides for every process on the machine). A
    recorded "onednn-matmul" is checked here too (:func:`float32_exact`)."""
    if _pinned is not None:
        return _pinned_library(kind, a, b)
    key = _key(kind, a, b)
    library = _choice.get(key)
    if library is None:
        shape = _label(key)
        library = _saved().get(_machine(), {}).get(shape)
        if not _usable(kind, library, a, b):  # none recorded, or one that cannot run this product here
            library = _settle(shape, _probe(kind, a, b), lambda lib: _usable(kind, lib, a, b))
        _choice[key] = library
    return library


def _pinned_library(kind: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """The pin (an "onednn" pin runs a batched product in aten: :func:`_run`)."""
    if _pinned == "onednn-matmul" and not float32_exact(kind, a, b):
        raise RuntimeError(f"--gemm-library onednn-matmul: oneDNN's matmul does not compute {_label(_key(kind, a, b))} "
                           "in float32 on this machine (ftitan.kernels.onednn.float32_exact); use auto, aten or onednn")
    return _pinned


def _linear_impl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _run("nt", _library("nt", x, w), x, w)


def _linear_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


_linear_op = op.define("onednn_linear", "(Tensor x, Tensor w) -> Tensor", _linear_impl, _linear_fake,
                       keys=("CPU",))  # fmt: skip


def gemm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in the fastest library for its shape (see the module docstring), without a derivative: for
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
    picks for the shape; ``aten::mm`` where oneDNN is missing. Both operands are taken as they lie: aten and
    oneDNN's matmul read them so, and the probe times the inner product with the dense copy it needs (a
    ``g.T`` made in the caller's graph instead, which inductor fused into ``g``'s producer as a slow transposed
    store, was no faster: 0.502-0.517 against 0.511-0.543 s a step, Zen 5, three processes each)."""
    if not available():
        return g.t() @ x
    return _tn_op(g, x)


def _bmm_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _run("bmm", _library("bmm", a, b), a, b)


def _bmm_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


_bmm_op = op.define("onednn_bmm", "(Tensor a, Tensor b) -> Tensor", _bmm_impl, _bmm_fake, keys=("CPU",))


class _BMM(torch.autograd.Function):
    """``a @ b`` (3-D) and both gradients by the ``onednn_bmm`` op (each in the library picked for its shape and
    layout); a double backward runs ``torch.bmm``."""

    @staticmethod
    def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _bmm_op(a, b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        bmm = torch.bmm if torch.is_grad_enabled() else _bmm_op  # create_graph=True: plain ops
        return (bmm(g, b.mT) if ctx.needs_input_grad[0] else None, bmm(a.mT, g) if ctx.needs_input_grad[1] else None)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``(..., M, K)`` and ``(..., K, N)`` with the same batch dimensions (``torch.matmul``), each
    batched GEMM (the product and both gradients) in the faster of ``aten::bmm`` and oneDNN's matmul for its
    shape and layout (kinds "bmm-nn" ...: :func:`choices`) where the operands are plain float32 CPU tensors and
    no ``torch.func`` transform runs; ``torch.matmul`` elsewhere. The CPU attention's GEMMs
    (``nn.attention(impl="gemm")`` with ``kernels`` other than "torch") run here."""
    if not (_eligible(a, b) and a.dim() == b.dim() >= 3 and a.shape[:-2] == b.shape[:-2]
            and a.shape[-1] == b.shape[-2]):  # fmt: skip
        return torch.matmul(a, b)
    out = _BMM.apply(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.view(*a.shape[:-2], *out.shape[-2:])


def _eligible(*tensors: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """What :func:`linear` and :func:`matmul` need to run this module's ops: oneDNN in this torch, no ``torch.func``
    transform or forward-AD level, plain float32 CPU tensors (``dtype``: the one they are cast to first)."""
    return (available() and op.no_transform() and op.plain(*tensors)
            and all(t.device.type == "cpu" and (dtype or t.dtype) == torch.float32 for t in tensors))  # fmt: skip


def usable(x: torch.Tensor, w: torch.Tensor, *, dtype: torch.dtype | None = None) -> bool:
    """True where :func:`linear` runs its GEMMs through this module's ops (each in the library picked for its
    shape) rather than ``F.linear``: see the module docstring's "Where". ``dtype``:
    the one the GEMM runs in when the caller casts ``x`` and ``w`` to it first (default theirs)."""
    if not (_eligible(x, w, dtype=dtype) and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1]):
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
    """``x @ w.T + b`` (``F.linear``), the GEMMs in the fastest library for each shape where :func:`usable`
    holds."""
    if not usable(x, w):
        return F.linear(x, w, b)
    y = _Linear.apply(x, w)
    return y if b is None else y + b
