"""torch.func transforms over every registered model family, against independent references.

Driven by ``ftitan.models.hf.families()``: a new family is covered by adding it
to the registry (and, if it has new size fields, to ``SHRINK``). Each family
runs at a tiny size (2 layers, dim 32, vocab 64) so the default-tier matrix
stays within seconds.

Tolerances, and why:
- float32 (per-example gradients vs a loop, ensemble vs separate applies):
  the transformed path uses the plain-ops forms (math attention, plain
  cross-entropy, dense grouped matmul) where the loop uses the fused kernels
  (SDPA, the fused cross-entropy, ``torch._grouped_mm``); they sum in a
  different order, so they agree to float32 rounding accumulated over two
  layers: rtol 1e-4, atol 1e-6 (gradients here are 1e-4..1; rounding ~1e-7).
- float64 (jvp and Hessian-vector products vs central finite differences):
  step h = 1e-6 along a direction v at the params' scale (0.02 * N(0, 1))
  leaves a truncation error ~h^2 |f'''(v, v, v)| and a rounding error
  ~1e-16 |f| / h ~ 1e-10, so rtol 1e-6, atol 1e-8 holds with margin and
  would catch a wrong or zero tangent (order-1 differences). MoE routing is
  piecewise constant: the test asserts every top-k choice is identical at
  p, p + h v and p - h v, so the difference quotient differentiates one
  smooth piece.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.func import grad, grad_and_value, jvp, vmap

import ftitan as ft
from ftitan.kernels import op
from ftitan.models import hf
from ftitan.nn import hash_moe as hash_moe_module
from ftitan.nn import moe as moe_module
from ftitan.nn import sparse_attention as sparse_attention_module
from tests.tiny_families import SHRINK, family, tiny_config

MAX_PARAMS = 60_000  # a family whose tiny config is bigger needs its size fields in SHRINK
FAMILIES = sorted(f.name for f in hf.families())
B, T = 3, 8
F32 = {"rtol": 1e-4, "atol": 1e-6}
F64_FD = {"rtol": 1e-6, "atol": 1e-8}
STEP = 1e-6


def tiny_model(name: str, **overrides: Any) -> ft.models.Model:
    model = family(name).model(tiny_config(name, **overrides))
    n = ft.tree.size(model.init(ft.random.key(0), device="meta"))
    assert n <= MAX_PARAMS, f"{name}: tiny config has {n} params; add its size fields to SHRINK"
    return model


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SHRINK["vocab_size"], (B, T + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[0, :2] = ft.train.IGNORE_INDEX  # a masked prompt: per-example token counts differ
    return {"inputs": tokens[:, :-1], "targets": targets}


def _tangent(params: Any, seed: int = 1) -> Any:
    g = torch.Generator().manual_seed(seed)
    # at the params' scale (init std 0.02): a unit-normal direction makes the h^2 f''' term dominate
    return ft.tree.map(lambda x: 0.02 * torch.randn(x.shape, generator=g, dtype=x.dtype), params)


def _axpy(a: float, x: Any, y: Any) -> Any:
    return ft.tree.map(lambda xi, yi: yi + a * xi, x, y)


class _RecordRouting:
    """Records every discrete choice a forward makes, to assert FD steps keep them: each MoE layer's experts
    (``nn.moe.route``; DeepSeek-V4's ``nn.hash_moe.route``, hash tables included) and each sparse-attention
    indexer's top-k mask (``nn.sparse_attention._select``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[torch.Tensor] = []
        for module, name, field in ((moe_module, "route", "experts"), (hash_moe_module, "route", "experts"),
                                    (sparse_attention_module, "_select", None)):  # fmt: skip
            monkeypatch.setattr(module, name, self._recording(getattr(module, name), field))

    def _recording(self, fn: Any, field: str | None) -> Any:
        def recording(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self.calls.append((out if field is None else getattr(out, field)).clone())
            return out

        return recording

    def take(self) -> list[torch.Tensor]:
        out, self.calls = self.calls, []
        return out


def _assert_same_routing(*runs: list[torch.Tensor]) -> None:
    for run in runs[1:]:
        assert len(run) == len(runs[0])
        for a, b in zip(runs[0], run, strict=True):
            assert torch.equal(a, b), "a finite-difference step changed a top-k / routing choice; use a smaller step"


def _per_example_vs_loop(model: ft.models.Model, per_example: Any) -> None:
    params, batch = model.init(ft.random.key(0)), _batch()
    loss_fn = ft.train.next_token_loss(model)
    grads, (losses, aux) = per_example(params, batch)
    assert losses.shape == (B,)
    for i in range(B):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        g_i, (l_i, aux_i) = grad_and_value(loss_fn, has_aux=True)(params, one)
        torch.testing.assert_close(losses[i], l_i, **F32)
        torch.testing.assert_close(ft.tree.map(lambda x: x[i], grads), g_i, **F32)
        torch.testing.assert_close({k: v[i] for k, v in aux.items()}, aux_i, **F32)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_example_grads_equal_a_loop_over_examples(family):
    model = tiny_model(family)
    _per_example_vs_loop(model, ft.train.per_example_grads(ft.train.next_token_loss(model)))


@pytest.mark.parametrize("family", FAMILIES)
def test_vmapped_ensemble_of_four_equals_four_applies(family):
    model = tiny_model(family)
    members = [model.init(ft.random.key(i)) for i in range(4)]
    tokens = _batch()["inputs"]
    out = vmap(lambda p: model.apply(p, tokens)[0])(ft.tree.stack(members))  # (4, B, T, V)
    assert out.shape[0] == 4
    for i, p in enumerate(members):
        torch.testing.assert_close(out[i], model.apply(p, tokens)[0], **F32)
    assert not torch.allclose(out[0], out[1])  # the members differ: the vmap did not broadcast one


@pytest.mark.parametrize("family", FAMILIES)
def test_jvp_equals_central_differences_float64(family, monkeypatch):
    model = tiny_model(family)
    params = model.init(ft.random.key(0), dtype=torch.float64)
    v = _tangent(params)
    tokens = _batch()["inputs"]

    def logits(p: Any) -> torch.Tensor:
        return model.apply(p, tokens)[0]

    routing = _RecordRouting(monkeypatch)
    at = logits(params)
    base = routing.take()
    plus = logits(_axpy(STEP, v, params))
    at_plus = routing.take()
    minus = logits(_axpy(-STEP, v, params))
    _assert_same_routing(base, at_plus, routing.take())
    out, tangent = jvp(logits, (params,), (v,))
    torch.testing.assert_close(out, at, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tangent, (plus - minus) / (2 * STEP), **F64_FD)
    assert tangent.abs().max() > 1e-3  # not a zero tangent


@pytest.mark.parametrize("family", FAMILIES)
def test_hessian_vector_product_equals_central_differences_of_grad_float64(family, monkeypatch):
    model = tiny_model(family)
    params = model.init(ft.random.key(0), dtype=torch.float64)
    v, batch = _tangent(params), _batch()
    loss_fn = ft.train.next_token_loss(model)

    def grad_of(p: Any) -> Any:
        return grad(lambda q: loss_fn(q, batch)[0])(p)

    routing = _RecordRouting(monkeypatch)
    plus = grad_of(_axpy(STEP, v, params))
    first = routing.take()
    minus = grad_of(_axpy(-STEP, v, params))
    _assert_same_routing(first, routing.take())
    _, hvp = jvp(grad_of, (params,), (v,))  # forward-over-reverse
    fd = ft.tree.map(lambda a, b: (a - b) / (2 * STEP), plus, minus)
    torch.testing.assert_close(hvp, fd, **F64_FD)
    assert max(x.abs().max() for x in ft.tree.leaves(hvp)) > 1e-4  # not a zero product


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_transforms_with_triton_kernels_run_the_references(family):
    """``--kernels triton``: inside ``op.interpret()`` (where a plain call would run the Triton kernels) the
    transforms still see the kernels' references, so per-example gradients equal the loop, and vmap / jvp
    equal the torch model's bit for bit (the references are nn's functions)."""
    model, torch_model = tiny_model(family, kernels="triton"), tiny_model(family)
    params, tokens = model.init(ft.random.key(0)), _batch()["inputs"]
    v = _tangent(params)
    with op.interpret():
        _per_example_vs_loop(model, ft.train.per_example_grads(ft.train.next_token_loss(model)))
        got = (vmap(lambda t: model.apply(params, t[None])[0])(tokens),
               jvp(lambda p: model.apply(p, tokens)[0], (params,), (v,)))  # fmt: skip
    want = (vmap(lambda t: torch_model.apply(params, t[None])[0])(tokens),
            jvp(lambda p: torch_model.apply(p, tokens)[0], (params,), (v,)))  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _compiled_per_example(model: ft.models.Model) -> Any:
    torch._dynamo.reset()
    return torch.compile(
        ft.train.per_example_grads(ft.train.next_token_loss(model)), backend="aot_eager", fullgraph=True
    )


def test_compiled_per_example_grads_llama():
    model = tiny_model("llama")
    _per_example_vs_loop(model, _compiled_per_example(model))


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_compiled_per_example_grads(family):
    model = tiny_model(family)
    _per_example_vs_loop(model, _compiled_per_example(model))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_jvp_equals_eager_jvp(family):
    model = tiny_model(family)
    params = model.init(ft.random.key(0), dtype=torch.float64)
    v, tokens = _tangent(params), _batch()["inputs"]

    def tangent_of(p: Any, t: Any) -> torch.Tensor:
        return jvp(lambda q: model.apply(q, tokens)[0], (p,), (t,))[1]

    torch._dynamo.reset()
    compiled = torch.compile(tangent_of, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(params, v), tangent_of(params, v), rtol=1e-10, atol=1e-10)
