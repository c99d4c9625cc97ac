"""Muon: parity with torch.optim.Muon and a float64 reference; shape scalings; labels."""

from __future__ import annotations

import pytest
import torch

import ftitan.optim as fo
from ftitan import tree

from ._helpers import grad_stream, llama_params, matrices_only, max_abs_diff, run
from ._reference import muon_f64, newton_schulz_f64

# tall and wide matrices, two same-shape pairs (batched together), a square one
MATRICES = {"a": (32, 16), "b": (32, 16), "c": (16, 48), "d": (24, 24), "e": (24, 24)}
LR, WD, STEPS = 0.02, 0.1, 10


def matrix_params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for k, s in MATRICES.items()}


def torch_muon(params, grads, **kw):
    names = list(params)
    ps = [params[k].clone().requires_grad_(True) for k in names]
    opt = torch.optim.Muon(ps, **kw)
    for g in grads:
        for p, k in zip(ps, names, strict=True):
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in zip(names, ps, strict=True)}


SCALINGS = ["original", "match_rms_adamw"]
NESTEROV = [True, False]


@pytest.mark.parametrize("nesterov", NESTEROV)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_matches_torch_muon_exactly_with_float64_newton_schulz(monkeypatch, nesterov, scaling):
    # torch.optim.Muon hard-codes a bf16 iteration; swapping in the float64 reference
    # isolates everything else (momentum, Nesterov, decay order, shape scale, batching)
    # to float64 rounding: ~1e-16 relative per op over 10 steps, so 1e-12 holds easily
    monkeypatch.setattr(
        torch.optim._muon, "_zeropower_via_newtonschulz", lambda g, _coef, steps, eps: newton_schulz_f64(g, steps, eps)
    )
    params = matrix_params(torch.float64)
    grads = grad_stream(params, STEPS)
    ours, _ = run(
        fo.muon(LR, weight_decay=WD, nesterov=nesterov, ns_dtype=torch.float64, shape_scaling=scaling), params, grads
    )
    ref = torch_muon(params, grads, lr=LR, weight_decay=WD, nesterov=nesterov, adjust_lr_fn=scaling)
    assert max_abs_diff(ours, ref) <= 1e-12


@pytest.mark.parametrize("nesterov", NESTEROV)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_matches_torch_muon_bf16(nesterov, scaling):
    # Both run Newton-Schulz in bf16 on the same inputs (the grads are fixed, so the
    # momentum buffers agree to float32 rounding). Each bf16 result is within ~2^-6
    # (a few bf16 eps 2^-8; measured <= 1.5e-2) of the exact iteration, so per step the
    # params may differ by lr * scale * 2 * 2^-6, plus float32 rounding (~1e-7); over
    # STEPS steps: STEPS * lr * scale * 2^-5. (Bitwise equal on this CPU.)
    params = matrix_params(torch.float32)
    grads = grad_stream(params, STEPS)
    ours, _ = run(fo.muon(LR, weight_decay=WD, nesterov=nesterov, shape_scaling=scaling), params, grads)
    ref = torch_muon(params, grads, lr=LR, weight_decay=WD, nesterov=nesterov, adjust_lr_fn=scaling)
    for k, (m, n) in MATRICES.items():
        tol = STEPS * LR * fo.muon_shape_scale(m, n, scaling) * 2**-5
        diff = (ours[k] - ref[k]).abs().max().item()
        assert diff <= tol, (k, diff, tol)
        assert (ours[k] - params[k]).abs().max().item() > 10 * tol  # the tolerance is not vacuous


def test_float32_newton_schulz_matches_float64_reference_on_model_tree():
    # Every matrix of a llama-like tree, incl. a (E, F, D) expert stack that shares a
    # batch with the same-shape dense w1, against a per-matrix float64 reference.
    # float64 params and momentum, float32 iteration: per step the params differ by
    # lr * scale (<= 1.6 here) * the float32 iteration error (<= 1e-6 observed, see
    # test_newton_schulz), so 10 steps stay within 2e-7 < 1e-6.
    params = matrices_only(llama_params(torch.float64))
    assert params["layers.1.moe.w1"].ndim == 3
    grads = grad_stream(params, STEPS)
    ours, _ = run(fo.muon(LR, weight_decay=WD, ns_dtype=torch.float32), params, grads)
    ref = muon_f64(params, grads, lr=LR, weight_decay=WD, momentum=0.95, nesterov=True)
    assert max_abs_diff(ours, ref) <= 1e-6
    assert max_abs_diff(ours, params) > 0.05


def test_shape_scalings():
    assert fo.muon_shape_scale(64, 16, "original") == 2.0
    assert fo.muon_shape_scale(16, 64, "original") == 1.0
    assert fo.muon_shape_scale(16, 64, "match_rms_adamw") == pytest.approx(0.2 * 8)
    with pytest.raises(ValueError, match="shape_scaling"):
        fo.muon_shape_scale(2, 2, "rms")
    with pytest.raises(ValueError, match="shape_scaling"):
        fo.scale_by_muon(shape_scaling="rms")
    # the transform applies the scale of the last two dims: (E, 64, 16) experts get 2x
    g = {"experts": torch.randn(3, 64, 16), "wide": torch.randn(16, 64)}
    t = fo.scale_by_muon(momentum=0.0, nesterov=False, ns_dtype=torch.float32)
    updates, _ = t.update(g, t.init(g))
    torch.testing.assert_close(updates["experts"], 2.0 * fo.newton_schulz(g["experts"], dtype=torch.float32))
    torch.testing.assert_close(updates["wide"], fo.newton_schulz(g["wide"], dtype=torch.float32))
    # match_rms_adamw: an update of RMS ~0.2 whatever the shape (Liu et al. 2025)
    t = fo.scale_by_muon(momentum=0.0, nesterov=False, ns_dtype=torch.float32, shape_scaling="match_rms_adamw")
    updates, _ = t.update(g, t.init(g))
    for u in updates.values():
        assert 0.12 < u.pow(2).mean().sqrt().item() < 0.25


def test_bf16_params_keep_dtype_and_float32_momentum():
    params = matrix_params(torch.bfloat16)
    opt = fo.muon(LR)
    out, state = run(opt, params, grad_stream(params, 2))
    assert {x.dtype for x in out.values()} == {torch.bfloat16}
    assert {x.dtype for x in tree.leaves(state[0].momentum)} == {torch.float32}


def test_vectors_are_rejected_with_path():
    with pytest.raises(ValueError, match=r"layers.0.attn_norm: Muon needs matrices"):
        fo.muon(LR).init(llama_params())


def test_muon_labels():
    labels = dict(zip(*tree.flatten_with_paths(fo.muon_labels(llama_params()))[:2], strict=True))
    adamw = {k for k, v in labels.items() if v == "adamw"}
    assert adamw == {
        "embed", "head", "norm", "layers.0.attn_norm", "layers.0.mlp_norm", "layers.1.attn_norm",
        "layers.1.mlp_norm", "layers.1.moe.bias",
    }  # fmt: skip
    assert labels["layers.1.moe.w1"] == labels["layers.0.attn.wq"] == labels["layers.1.moe.router"] == "muon"
    # HF / torchtitan naming
    x = torch.ones(4, 4)
    assert fo.muon_label("model.embed_tokens.weight", x) == "adamw"
    assert fo.muon_label("lm_head.weight", x) == "adamw"
    assert fo.muon_label("tok_embeddings.weight", x) == "adamw"
    assert fo.muon_label("output.weight", x) == "adamw"
    assert fo.muon_label("model.layers.0.self_attn.o_proj.weight", x) == "muon"
    assert fo.muon_label("layers.0.attention.wo.bias", torch.ones(4)) == "adamw"


def test_muon_with_adamw_equals_its_parts():
    params = llama_params()
    grads = grad_stream(params, 3)
    kw = dict(lr=0.02, adamw_lr=1e-3, weight_decay=0.1, adamw_weight_decay=0.01)
    combined, _ = run(fo.muon_with_adamw(params, **kw), params, grads)
    ps, ls, _ = tree.flatten_with_paths(params)
    labels = tree.leaves(fo.muon_labels(params))
    split = {lab: {p: x for p, x, la in zip(ps, ls, labels, strict=True) if la == lab} for lab in ("muon", "adamw")}
    flat_grads = [dict(zip(ps, tree.leaves(g), strict=True)) for g in grads]
    only = lambda lab: [{p: g[p] for p in split[lab]} for g in flat_grads]  # noqa: E731
    muon_out, _ = run(fo.muon(0.02, weight_decay=0.1), split["muon"], only("muon"))
    adamw_out, _ = run(fo.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.01), split["adamw"], only("adamw"))
    flat = dict(zip(ps, tree.leaves(combined), strict=True))
    for p, x in {**muon_out, **adamw_out}.items():
        assert torch.equal(flat[p], x), p


def test_muon_with_adamw_checks_labels_eagerly():
    with pytest.raises(ValueError, match="embed: label 'sgd'"):
        fo.muon_with_adamw(llama_params(), lr=0.02, labels=lambda path, x: "sgd" if path == "embed" else "muon")


@pytest.mark.parametrize("nesterov", NESTEROV)
def test_optax_nesterov_style_matches_float64_reference(nesterov):
    # float64 Newton-Schulz on both sides: float64 rounding only over 3 steps (see the torch parity above);
    # a tall and a wide matrix
    params = {k: v for k, v in matrix_params(torch.float64).items() if k in ("a", "c")}
    grads = grad_stream(params, 3)
    kw = dict(weight_decay=WD, nesterov=nesterov, ns_dtype=torch.float64)
    ours, state = run(fo.muon(LR, nesterov_style="optax", **kw), params, grads)
    ref = muon_f64(params, grads, lr=LR, weight_decay=WD, momentum=0.95, nesterov=nesterov, style="optax")
    assert max_abs_diff(ours, ref) <= 1e-12
    assert int(state[0].count) == 3 and fo.muon(LR).init(params)[0].count is None  # torch style: no count
    torch_style, _ = run(fo.muon(LR, **kw), params, grads)
    if nesterov:  # the bias-corrected mix weights g and B differently: the conventions differ measurably
        assert max_abs_diff(torch_style, ours) > 1e-3
    else:  # a scalar per matrix, which Newton-Schulz's normalization removes
        assert max_abs_diff(torch_style, ours) <= 1e-12


def test_muon_with_adamw_passes_ns_eps_and_nesterov_style():
    # a gradient of norm ~1e-4: with ns_eps=1 the norm clamp bites, Newton-Schulz starts from singular
    # values ~1e-5 and 5 steps (each at most x3.4445) leave the update far smaller (57x measured)
    params = {"layers.0.w": torch.ones(8, 8, dtype=torch.float64), "norm": torch.ones(8, dtype=torch.float64)}
    gen = torch.Generator().manual_seed(0)
    grads = tree.map(lambda p: 1e-5 * torch.randn(p.shape, generator=gen, dtype=p.dtype), params)
    outs = {}
    for ns_eps in (1e-7, 1.0):
        opt = fo.muon_with_adamw(
            params, lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, ns_dtype=torch.float64, ns_eps=ns_eps
        )
        updates, state = opt.update(grads, opt.init(params), params)
        outs[ns_eps] = updates["layers.0.w"].norm().item()
    assert outs[1.0] < outs[1e-7] / 20
    opt = fo.muon_with_adamw(params, lr=0.1, nesterov_style="optax")
    assert int(opt.update(grads, opt.init(params), params)[1].inner_states["muon"][0].count) == 1


@pytest.mark.parametrize("dim", [0, 1])
def test_blocks_orthogonalize_each_block_as_its_own_matrix(dim):
    """``blocks``: per-head Muon. Each 16-row (dim 0) or 16-column (dim 1) block of ``w`` updated as if it
    were its own leaf under plain Muon; other leaves and 3-D stacks (per matrix already) unchanged."""
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(48, 64, generator=g, dtype=torch.float64),
              "x": torch.randn(2, 32, 16, generator=g, dtype=torch.float64)}  # fmt: skip
    grads = [tree.map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params) for _ in range(3)]
    kw = dict(weight_decay=0.1, ns_dtype=torch.float64)
    blocked, _ = run(fo.muon(0.02, blocks={"w": (dim, 16)}, **kw), params, grads)

    def cut(t):  # w as separate block leaves
        return {f"w{i}": b for i, b in enumerate(t["w"].split(16, dim=dim))} | {"x": t["x"]}

    alone, _ = run(fo.muon(0.02, **kw), cut(params), [cut(gr) for gr in grads])
    torch.testing.assert_close(blocked["w"], torch.cat([alone[f"w{i}"] for i in range(len(alone) - 1)], dim=dim),
                               rtol=0, atol=1e-12)  # fmt: skip
    torch.testing.assert_close(blocked["x"], alone["x"], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="into whole blocks"):
        run(fo.muon(0.02, blocks={"w": (dim, 7)}, **kw), params, grads)
