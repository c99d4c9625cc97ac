"""The Gated DeltaNet chunk kernel (Triton): the forward of the gated delta rule, one program per
(batch, value head, block of <= 64 value dims) walking the sequence a chunk at a time with its columns
of the (Dk, Dv) state in fp32 registers (the state's columns evolve independently: ``A``, ``W`` and the
decays depend on ``k`` and the gates only, so each program recomputes them for its block).

Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule"; the chunk
form (WY representation, UT transform) of Yang et al. 2024, "Parallelizing Linear Transformers with
the Delta Rule over Sequence Length". The reference is :func:`ftitan.nn.gdn.chunked_delta_rule` (its
docstring has the algebra); the kernel computes the same terms per chunk of ``C`` tokens:

- ``q``, ``k`` L2-normalized in the kernel (``q`` scaled by ``Dk ** -0.5``), the ``k`` head of a value
  head read in place (grouped heads), ``c`` the cumulative log decay inside the chunk;
- ``(I + A)^{-1}`` of the unit lower-triangular ``A[i, j] = beta_i exp(c_i - c_j) k_i . k_j`` by forward
  substitution on a register tile (``C`` row updates), then ``U = (I + A)^{-1} beta v`` and
  ``W = (I + A)^{-1} beta exp(c) k``;
- ``u = U - W S``, ``o = exp(c) q S + (exp(c_i - c_j) q_i . k_j)_{j <= i} u``,
  ``S <- exp(c_last) S + (exp(c_last - c) k)^T u``;
- packed documents (``segments``): the same masks as the reference (no pair across documents, the
  entering state read and carried only by its own document's tokens).

``C`` is ``chunk`` rounded up to a power of two >= 16 (``tl.dot``'s smallest tile); the result does
not depend on it beyond float32 rounding. Matmuls run in full fp32 (``input_precision="ieee"``: TF32
would cost the triangular solve its accuracy). bf16/fp16/fp32 inputs; float64 runs the reference.

The backward is Triton too: the backward op reruns the forward kernel keeping each chunk's entering
state (``(B*Hv, chunks, Dk, Dv)`` fp32 in memory), then one program per (batch, value head) walks the
chunks in reverse with ``dS`` in registers, recomputes the chunk's terms and takes the chain rule back
through them: the outputs and the carried state, the triangular solve (``d(I + A)^{-1}`` gives
``dA = -(I + A)^{-T} d(I + A)^{-1} (I + A)^{-T}``), the decays (their exponents' gradients, then the
reverse cumulative sum to ``dg``) and the L2 normalizations. Grouped heads sum ``dq``/``dk`` over the
value heads of a key head in torch. Value blocks split the backward as they split the forward; each
block's parts of ``dq``, ``dk``, ``dg`` and ``dbeta`` are summed in torch.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ftitan.kernels import op
from ftitan.nn import gdn as _gdn

__all__ = ["chunk_delta_rule", "chunk_delta_rule_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel takes; float64 runs the reference
_BLOCK_V = 64  # state columns per program: the columns of S (and of v, u, o) evolve independently


@triton.jit
def _row(x, rows, i):
    """Row ``i`` of the 2-D tile ``x`` as a vector over its columns."""
    return tl.sum(tl.where(rows[:, None] == i, x, 0.0), 0)


@triton.jit
def _unit_lower_inverse(a, BC: tl.constexpr):
    """``(I + a)^{-1}`` for ``a`` (BC, BC) strictly lower triangular, by forward substitution: row ``i`` of
    the inverse is ``e_i - sum_{j < i} a[i, j] inv[j, :]`` (rows above ``i`` already final)."""
    rows = tl.arange(0, BC)
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, BC):
        ai = _row(a, rows, i)  # (BC,) zero from column i on
        new = tl.where(rows == i, 1.0, 0.0) - tl.sum(ai[:, None] * inv, 0)
        inv = tl.where(rows[:, None] == i, new[None, :], inv)
    return inv


@triton.jit
def _gates(g, t, t0, T, seg_ptr, BC: tl.constexpr, HAS_SEG: tl.constexpr):
    """A chunk's decay terms from its log decays ``g`` (BC,): ``exp(c_i - c_j)`` for ``j <= i`` (BC, BC),
    ``exp(c)`` (reads of the entering state), ``exp(c_last - c)`` (writes carried to the chunk's end) and
    ``exp(c_last)`` (the entering state carried through), with ``c = cumsum(g)``; with packed documents
    (``seg_ptr``: this row's ids) the reference's masks: no term across a document boundary."""
    rows = tl.arange(0, BC)
    c = tl.cumsum(g, 0)  # (BC,) log decay from the chunk's start through each token
    c_last = tl.sum(tl.where(rows == BC - 1, c, 0.0), 0)  # padded tokens have g = 0
    diff = tl.where(rows[:, None] >= rows[None, :], c[:, None] - c[None, :], float("-inf"))  # no overflow
    decay = tl.exp(diff)
    enter = tl.exp(c)
    leave = tl.exp(c_last - c)
    carry = tl.exp(c_last)
    if HAS_SEG:  # padded tokens belong to the last document (index clamped), as in the reference
        seg = tl.load(seg_ptr + tl.minimum(t, T - 1))
        before = tl.load(seg_ptr + tl.maximum(t0 - 1, 0))
        seg_last = tl.sum(tl.where(rows == BC - 1, seg, 0), 0)
        decay = tl.where(seg[:, None] == seg[None, :], decay, 0.0)
        enter = tl.where(seg == before, enter, 0.0)
        leave = tl.where(seg == seg_last, leave, 0.0)
        carry = tl.where(seg_last == before, carry, 0.0)
    return decay, enter, leave, carry


@triton.jit
def _gdn_chunk_fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, seg_ptr, o_ptr, sn_ptr, states_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h, sseg_b,
    T, HV, REP, DK, DV, scale, NC,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr, HAS_SEG: tl.constexpr,
    STORE_STATES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # one (batch, value head)
    b, h = pid // HV, pid % HV
    hk = h // REP  # its key head
    rows, ck, cv = tl.arange(0, BC), tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)  # a block of Dv
    mk, mv = ck < DK, cv < DV
    state_off = pid * DK * DV + ck[:, None] * DV + cv[None, :]
    s = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_S0:
        s = tl.load(s0_ptr + state_off, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
    strict = rows[:, None] > rows[None, :]
    for t0 in range(0, T, BC):
        t = t0 + rows
        mt = t < T
        q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + hk * sq_h + ck[None, :],
                    mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)  # fmt: skip
        k = tl.load(k_ptr + b * sk_b + t[:, None] * sk_t + hk * sk_h + ck[None, :],
                    mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)  # fmt: skip
        v = tl.load(v_ptr + b * sv_b + t[:, None] * sv_t + h * sv_h + cv[None, :],
                    mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)  # fmt: skip
        g = tl.load(g_ptr + b * sg_b + t * sg_t + h * sg_h, mask=mt, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + b * sb_b + t * sb_t + h * sb_h, mask=mt, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None] * scale  # nn.gdn.l2_normalize, then Dk ** -0.5
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        decay, enter, leave, carry = _gates(g, t, t0, T, seg_ptr + b * sseg_b, BC, HAS_SEG)
        if STORE_STATES:  # the state entering each chunk (the backward's recomputation)
            tl.store(states_ptr + (pid * NC + t0 // BC) * DK * DV + ck[:, None] * DV + cv[None, :], s,
                     mask=mk[:, None] & mv[None, :])  # fmt: skip
        kb = k * beta[:, None]
        a = tl.where(strict, tl.dot(kb, tl.trans(k), input_precision="ieee") * decay, 0.0)
        inv = _unit_lower_inverse(a, BC)
        big_u = tl.dot(inv, v * beta[:, None], input_precision="ieee")  # (BC, BV)
        big_w = tl.dot(inv, kb * enter[:, None], input_precision="ieee")  # (BC, BK)
        u = big_u - tl.dot(big_w, s, input_precision="ieee")
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * decay  # zero above the diagonal
        o = tl.dot(q * enter[:, None], s, input_precision="ieee") + tl.dot(scores, u, input_precision="ieee")
        tl.store(o_ptr + ((b * T + t[:, None]) * HV + h) * DV + cv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])  # fmt: skip
        s = s * carry + tl.dot(tl.trans(k * leave[:, None]), u, input_precision="ieee")
    tl.store(sn_ptr + state_off, s, mask=mk[:, None] & mv[None, :])


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _gdn_chunk_bwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, seg_ptr, states_ptr, do_ptr, dsn_ptr,
    dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr, ds0_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h, sseg_b,
    T, HV, REP, DK, DV, scale, NC,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_SEG: tl.constexpr,
):  # fmt: skip
    """One (batch, value head, block of value dims), chunks in reverse: recompute the chunk's forward terms
    from its entering state, then the chain rule back through them (module docstring's names; ``d`` =
    gradient). ``dq``, ``dk``, ``dg``, ``dbeta`` are this block's parts (summed over blocks in torch)."""
    pid, vb = tl.program_id(0), tl.program_id(1)
    b, h = pid // HV, pid % HV
    hk = h // REP
    rows, ck, cv = tl.arange(0, BC), tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    mk, mv = ck < DK, cv < DV
    mkv = mk[:, None] & mv[None, :]
    state_off = ck[:, None] * DV + cv[None, :]
    strict = rows[:, None] > rows[None, :]
    ds = tl.load(dsn_ptr + pid * DK * DV + state_off, mask=mkv, other=0.0)  # d(state leaving the chunk)
    for j in range(0, NC):
        t0 = (NC - 1 - j) * BC
        t = t0 + rows
        mt = t < T
        mtk, mtv = mt[:, None] & mk[None, :], mt[:, None] & mv[None, :]
        q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + hk * sq_h + ck[None, :], mask=mtk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * sk_b + t[:, None] * sk_t + hk * sk_h + ck[None, :], mask=mtk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * sv_b + t[:, None] * sv_t + h * sv_h + cv[None, :], mask=mtv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * sg_b + t * sg_t + h * sg_h, mask=mt, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + b * sb_b + t * sb_t + h * sb_h, mask=mt, other=0.0).to(tl.float32)
        rq, rk = tl.rsqrt(tl.sum(q * q, 1) + 1e-6), tl.rsqrt(tl.sum(k * k, 1) + 1e-6)
        qn, kh = q * rq[:, None], k * rk[:, None]
        qh = qn * scale
        decay, enter, leave, carry = _gates(g, t, t0, T, seg_ptr + b * sseg_b, BC, HAS_SEG)
        s = tl.load(states_ptr + (pid * NC + t0 // BC) * DK * DV + state_off, mask=mkv, other=0.0)
        do = tl.load(do_ptr + ((b * T + t[:, None]) * HV + h) * DV + cv[None, :], mask=mtv, other=0.0).to(tl.float32)
        # forward terms
        kb = kh * beta[:, None]
        kk = _dot(kb, tl.trans(kh))
        inv = _unit_lower_inverse(tl.where(strict, kk * decay, 0.0), BC)
        bv, bk = v * beta[:, None], kb * enter[:, None]
        w = _dot(inv, bk)
        u = _dot(inv, bv) - _dot(w, s)
        qk = _dot(qh, tl.trans(kh))
        p = qk * decay
        qe, kl = qh * enter[:, None], kh * leave[:, None]
        # o = qe s + p u ; s' = carry s + kl^T u ; u = inv bv - inv bk s
        du = _dot(tl.trans(p), do) + _dot(kl, ds)
        ds_prev = carry * ds + _dot(tl.trans(qe), do) - _dot(tl.trans(w), du)
        dqe = _dot(do, tl.trans(s))
        dp = _dot(do, tl.trans(u))
        dkl = _dot(u, tl.trans(ds))
        dcarry = tl.sum(tl.sum(ds * s, 1), 0)
        dw = -_dot(du, tl.trans(s))
        dinv = _dot(du, tl.trans(bv)) + _dot(dw, tl.trans(bk))
        dbv, dbk = _dot(tl.trans(inv), du), _dot(tl.trans(inv), dw)
        da = tl.where(strict, -_dot(_dot(tl.trans(inv), dinv), tl.trans(inv)), 0.0)  # d(I + A)^-1 -> dA
        m = da * decay
        dkb = _dot(m, kh)
        dkh = _dot(tl.trans(m), kb)
        nn = dp * decay
        dqh = _dot(nn, kh) + dqe * enter[:, None]
        dkh += _dot(tl.trans(nn), qh) + dbk * (beta * enter)[:, None] + dkb * beta[:, None] + dkl * leave[:, None]
        dd = (da * kk + dp * qk) * decay  # d decay, times decay: the exponent's gradient
        tbk = tl.sum(dbk * kh, 1)
        de = tl.sum(dqe * qh, 1) + tbk * beta
        dbeta = tbk * enter + tl.sum(dbv * v, 1) + tl.sum(dkb * kh, 1)
        dl = tl.sum(dkl * kh, 1)
        dc = tl.sum(dd, 1) - tl.sum(dd, 0) + de * enter - dl * leave
        dc += tl.where(rows == BC - 1, tl.sum(dl * leave, 0) + dcarry * carry, 0.0)  # through c_last
        dg = tl.sum(tl.where(rows[None, :] >= rows[:, None], dc[None, :], 0.0), 1)  # c = cumsum(g)
        dqn = dqh * scale
        dq = rq[:, None] * (dqn - qn * tl.sum(qn * dqn, 1)[:, None])  # through the L2 normalizations
        dk = rk[:, None] * (dkh - kh * tl.sum(kh * dkh, 1)[:, None])
        part = vb * (T * HV)  # this value block's slice of the partial sums
        out_k = ((part + b * T + t[:, None]) * HV + h) * DK + ck[None, :]
        tl.store(dq_ptr + out_k, dq, mask=mtk)
        tl.store(dk_ptr + out_k, dk, mask=mtk)
        tl.store(dv_ptr + ((b * T + t[:, None]) * HV + h) * DV + cv[None, :], (dbv * beta[:, None]).to(
            dv_ptr.dtype.element_ty), mask=mtv)  # fmt: skip
        tl.store(dg_ptr + (part + b * T + t) * HV + h, dg, mask=mt)
        tl.store(dbeta_ptr + (part + b * T + t) * HV + h, dbeta, mask=mt)
        ds = ds_prev
    tl.store(ds0_ptr + pid * DK * DV + state_off, ds, mask=mkv)


def _tile(n: int) -> int:
    """A register tile's side for ``n``: a power of two >= 16 (``tl.dot``'s smallest)."""
    return max(16, triton.next_power_of_2(n))


def _last_unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None, segments: torch.Tensor | None, chunk: int,
              states: torch.Tensor | None = None,  # (B * Hv, chunks, Dk, Dv) fp32: filled with the entering states
              ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    q, k, v, g, beta = (_last_unit(x) for x in (q, k, v, g, beta))
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    o = v.new_empty(bsz, t, hv, dv)
    final = torch.empty(bsz, hv, dk, dv, dtype=torch.float32, device=v.device)
    s0 = None if state is None else state.to(torch.float32).contiguous()
    seg = None if segments is None else segments.to(torch.int32).contiguous()
    bc, bv = _tile(chunk), min(_tile(dv), _BLOCK_V)
    _gdn_chunk_fwd_kernel[(bsz * hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, final if s0 is None else s0, o if seg is None else seg, o, final,
        final if states is None else states,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
        0 if seg is None else seg.stride(0), t, hv, hv // hk, dk, dv, dk**-0.5, triton.cdiv(t, bc),
        BC=bc, BK=_tile(dk), BV=bv, HAS_S0=s0 is not None, HAS_SEG=seg is not None,
        STORE_STATES=states is not None,
    )  # fmt: skip
    return o, final


def _fwd_fake(q, k, v, g, beta, state, segments, chunk):  # type: ignore[no-untyped-def]
    return v.new_empty(v.shape), v.new_empty(v.shape[0], v.shape[2], k.shape[3], v.shape[3], dtype=torch.float32)


def _bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None, segments: torch.Tensor | None, do: torch.Tensor, ds: torch.Tensor,
              chunk: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The forward kernel again, keeping each chunk's entering state, then the backward kernel."""
    q, k, v, g, beta = (_last_unit(x) for x in (q, k, v, g, beta))
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    bc = _tile(chunk)
    nc = triton.cdiv(t, bc)
    states = torch.empty(bsz * hv, nc, dk, dv, dtype=torch.float32, device=v.device)
    _fwd_impl(q, k, v, g, beta, state, segments, chunk, states)
    seg = None if segments is None else segments.to(torch.int32).contiguous()
    bv = min(_tile(dv), _BLOCK_V)
    nv = triton.cdiv(dv, bv)  # value blocks: each gives a part of dq, dk, dg, dbeta
    dq, dk_ = (torch.empty(nv, bsz, t, hv, dk, dtype=torch.float32, device=q.device) for _ in range(2))
    dv_ = torch.empty(bsz, t, hv, dv, dtype=v.dtype, device=v.device)
    dg, dbeta = (torch.empty(nv, bsz, t, hv, dtype=torch.float32, device=q.device) for _ in range(2))
    ds0 = torch.empty(bsz, hv, dk, dv, dtype=torch.float32, device=q.device)
    _gdn_chunk_bwd_kernel[(bsz * hv, nv)](
        q, k, v, g, beta, dq if seg is None else seg, states, do.contiguous(), ds.to(torch.float32).contiguous(),
        dq, dk_, dv_, dg, dbeta, ds0,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
        0 if seg is None else seg.stride(0), t, hv, hv // hk, dk, dv, dk**-0.5, nc,
        BC=bc, BK=_tile(dk), BV=bv, HAS_SEG=seg is not None,
    )  # fmt: skip
    rep = hv // hk  # a key head's gradient sums over the value heads it serves
    dq, dk_ = (x.sum(0).view(bsz, t, hk, rep, dk).sum(3).to(q.dtype) for x in (dq, dk_))
    dg, dbeta = dg.sum(0), dbeta.sum(0)
    ds0 = torch.zeros(0, device=q.device) if state is None else ds0.to(state.dtype)  # empty: no initial state
    return dq, dk_, dv_, dg.to(g.dtype), dbeta.to(beta.dtype), ds0


def _bwd_fake(q, k, v, g, beta, state, segments, do, ds, chunk):  # type: ignore[no-untyped-def]
    ds0 = q.new_empty(0, dtype=torch.float32) if state is None else state.new_empty(state.shape)
    return (*(x.new_empty(x.shape) for x in (q, k, v, g, beta)), ds0)


_FWD = op.define(
    "gdn_chunk_fwd",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? state, Tensor? segments, int chunk)"
    " -> (Tensor, Tensor)",
    _fwd_impl,
    _fwd_fake,
)
_BWD = op.define(
    "gdn_chunk_bwd",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? state, Tensor? segments, Tensor do,"
    " Tensor ds, int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _bwd_impl,
    _bwd_fake,
)


class _ChunkDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, g, beta, state, segments, chunk):  # type: ignore[no-untyped-def,override]
        return _FWD(q, k, v, g, beta, state, segments, chunk)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, g, beta, state, segments, chunk = inputs
        ctx.save_for_backward(q, k, v, g, beta, state, segments)
        ctx.chunk = chunk
        ctx.has_state = state is not None

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, ds: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, g, beta, state, segments = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, ds0 = _BWD(q, k, v, g, beta, state, segments, do, ds, ctx.chunk)
        return dq, dk, dv, dg, dbeta, ds0 if ctx.has_state else None, None, None


def chunk_delta_rule_reference(
    q: torch.Tensor,  # (B, T, Hk, Dk)
    k: torch.Tensor,  # (B, T, Hk, Dk)
    v: torch.Tensor,  # (B, T, Hv, Dv)
    g: torch.Tensor,  # (B, T, Hv) log decay, <= 0
    beta: torch.Tensor,  # (B, T, Hv)
    state: torch.Tensor | None = None,  # (B, Hv, Dk, Dv) float32; None: zeros
    *,
    chunk: int = 64,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows
) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T, Hv, Dv) in v's dtype, final state (B, Hv, Dk, Dv) float32
    """The definition: :func:`ftitan.nn.gdn.chunked_delta_rule` in plain torch ops."""
    return _gdn.chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk, segments=segments)


def chunk_delta_rule(
    q: torch.Tensor,  # (B, T, Hk, Dk)
    k: torch.Tensor,  # (B, T, Hk, Dk)
    v: torch.Tensor,  # (B, T, Hv, Dv)
    g: torch.Tensor,  # (B, T, Hv) log decay, <= 0
    beta: torch.Tensor,  # (B, T, Hv)
    state: torch.Tensor | None = None,  # (B, Hv, Dk, Dv) float32; None: zeros
    *,
    chunk: int = 64,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows: the state restarts at each
) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T, Hv, Dv) in v's dtype, final state (B, Hv, Dk, Dv) float32
    """The gated delta rule by the Triton chunk kernel where :func:`ftitan.kernels.op.use_kernel` (CUDA, or
    the interpreter) and the inputs are bf16/fp16/fp32 with at least one token; else the reference."""
    tensors = [x for x in (q, k, v, g, beta, state, segments) if x is not None]
    if q.shape[1] == 0 or any(x.dtype not in _DTYPES for x in (q, k, v, g, beta)) or not op.use_kernel(*tensors):
        return chunk_delta_rule_reference(q, k, v, g, beta, state, chunk=chunk, segments=segments)
    return _ChunkDeltaRule.apply(q, k, v, g, beta, state, segments, chunk)
