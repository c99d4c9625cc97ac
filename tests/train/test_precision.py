"""Mixed precision as a policy: float32 masters, bfloat16 compute, float32 loss, norms and routing.

Tolerances, and why:
- bfloat16 keeps 8 significant bits: one rounding is off by at most 2^-9 ~ 2e-3 relative. A tiny
  model's logits pass through a few dozen roundings in series (projections, norms, residual adds,
  two layers), which partly cancel: measured relative error (Frobenius) 4e-3..5e-3 for every
  family. ``BF16_LOGITS_RTOL = 2e-2`` leaves 4x room and still fails for a model whose weights or
  activations were rounded to a coarser format (fp8 e4m3 keeps 4 bits: ~6e-2).
- Losses computed in float32 from the same bfloat16 hidden states agree with a float64 reference
  to float32 rounding (~1e-7 relative); 1e-5 absolute on a loss of ~4 holds with a wide margin and
  fails for a log-softmax taken in bfloat16 (measured 8e-7 for ours, 3e-2 for bf16 logits).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F

import ftitan as ft
from ftitan import tree as T
from ftitan.models import hf
from ftitan.nn import moe as moe_module
from ftitan.train import MixedPrecision, apply_precision
from tests.transforms.test_models import SHRINK, tiny_model  # the registry's tiny configs, one table

FAMILIES = sorted(f.name for f in hf.families())
BF16 = MixedPrecision.from_names("fp32", "bf16", "fp32")
BF16_LOGITS_RTOL = 2e-2
B, T_ = 3, 8


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, SHRINK["vocab_size"], (B, T_ + 1), generator=torch.Generator().manual_seed(seed))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def floating_dtypes(tree: Any) -> set[torch.dtype]:
    return {x.dtype for x in T.leaves(tree) if isinstance(x, torch.Tensor) and x.is_floating_point()}


# ---------------------------------------------------------------- the policy


def test_policy_from_names_parse_and_config_values():
    assert BF16 == MixedPrecision(torch.float32, torch.bfloat16, torch.float32)
    assert BF16 == MixedPrecision(compute_dtype="bf16") == MixedPrecision.parse("bf16")
    assert MixedPrecision.parse("param=fp32, compute=bfloat16, reduce=fp32") == BF16
    assert MixedPrecision.parse("compute=fp16").names == {"param": "fp32", "compute": "fp16", "reduce": "fp32"}
    assert MixedPrecision().is_full and not BF16.is_full
    assert hash(BF16) == hash(MixedPrecision.from_names("fp32", "bf16", "fp32"))  # frozen: safe in compiled code
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        BF16.compute_dtype = torch.float16  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown dtype 'bf61'.*fp32, bf16, fp16"):
        MixedPrecision.from_names("fp32", "bf61")
    with pytest.raises(ValueError, match="not a floating dtype"):
        MixedPrecision(compute_dtype=torch.int8)
    with pytest.raises(ValueError, match="unknown key 'output'"):
        MixedPrecision.parse("param=fp32,output=bf16")


def test_casts_skip_kept_and_integer_leaves():
    model = tiny_model("deepseek_v3")
    policy = BF16.for_model(model)
    assert policy.keep == model.frozen == ("layers.*.moe.router_bias",)
    params = {**model.init(ft.random.key(0)), "count": torch.zeros((), dtype=torch.int64)}
    cast = policy.cast_to_compute(params)
    for path, x in zip(T.paths(cast), T.leaves(cast), strict=True):
        want = torch.int64 if path == "count" else torch.float32 if path.endswith("router_bias") else torch.bfloat16
        assert x.dtype == want, path
    back = policy.cast_to_param(cast)  # masters from a bf16 copy (a checkpoint); kept leaves left as they are
    assert floating_dtypes(back) == {torch.float32} and back["count"].dtype == torch.int64


def test_no_policy_and_the_full_policy_are_the_step_of_today():
    model = tiny_model("llama")
    loss_fn = ft.train.next_token_loss(model)
    assert apply_precision(loss_fn, None) is loss_fn and MixedPrecision().cast_loss(loss_fn) is loss_fn
    opt = ft.optim.adamw(1e-2)
    params = model.init(ft.random.key(0))
    runs = []
    for precision in (None, MixedPrecision()):
        step = ft.train.make_train_step(loss_fn, opt, precision=precision)
        state = ft.train.init_state(params, opt)
        losses = []
        for i in range(2):
            state, m = step(state, make_batch(i))
            losses.append(m["loss"])
        runs.append((losses, state.params))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(T.leaves(runs[0][1]), T.leaves(runs[1][1]), strict=True))


# ---------------------------------------------------------------- models in bf16


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_applies_in_bf16_close_to_fp32(name):
    model = tiny_model(name)
    params = model.init(ft.random.key(0))
    tokens = make_batch()["inputs"]
    ref, _ = model.apply(params, tokens)
    got, _ = model.apply(BF16.for_model(model).cast_to_compute(params), tokens)
    assert got.dtype == torch.bfloat16
    rel = float((got.float() - ref).norm() / ref.norm())
    assert rel <= BF16_LOGITS_RTOL, f"{name}: bf16 logits off by {rel:.2e} (relative, Frobenius)"


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_masters_grads_and_optimizer_state_stay_fp32(name):
    model = tiny_model(name)
    params = model.init(ft.random.key(0))
    policy = BF16.for_model(model)
    loss_fn = ft.train.next_token_loss(model)
    grads, (loss, _) = ft.train.value_and_grad(policy.cast_loss(loss_fn))(params, make_batch())
    assert floating_dtypes(grads) == {torch.float32} and loss.dtype == torch.float32
    opt = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(1e-2))
    step = ft.train.make_train_step(loss_fn, opt, precision=policy, update_buffers=model.update_buffers)
    state = ft.train.init_state(params, opt)
    for i in range(3):
        state, m = step(state, make_batch(i))
        assert m["loss"].dtype == torch.float32 and m["grad_norm"].dtype == torch.float32
    assert floating_dtypes(state.params) == {torch.float32}
    assert floating_dtypes(state.opt_state) == {torch.float32}
    moved = [not torch.equal(a, b) for a, b in zip(T.leaves(params), T.leaves(state.params), strict=True)]
    assert all(moved)  # every leaf trained, the balancing bias (update_buffers) included


def test_accumulation_and_trainable_subsets_compose_with_a_policy():
    model = tiny_model("llama")
    params = model.init(ft.random.key(0))
    opt = ft.optim.adamw(1e-2)
    step = ft.train.make_train_step(ft.train.next_token_loss(model), opt, precision=BF16, accum_steps=3,
                                    trainable="layers.*.attn.**")  # fmt: skip
    state, m = step(ft.train.init_state(params, opt, trainable="layers.*.attn.**"), make_batch())
    assert m["loss"].dtype == torch.float32 and floating_dtypes(state.opt_state) == {torch.float32}
    assert torch.equal(state.params["embed"], params["embed"])  # not trainable: untouched, fp32
    assert not torch.equal(state.params["layers"]["0"]["attn"]["wq"], params["layers"]["0"]["attn"]["wq"])


def test_routing_is_fp32_and_the_balancing_bias_is_never_cast(monkeypatch):
    seen = []
    original = moe_module.route

    def spy(x, p, cfg):
        out = original(x, p, cfg)
        seen.append((x.dtype, p["router"].dtype, p["router_bias"].dtype, out.probs.dtype, out.weights.dtype))
        return out

    monkeypatch.setattr(moe_module, "route", spy)
    model = tiny_model("deepseek_v3")
    params = model.init(ft.random.key(0))
    model.apply(BF16.for_model(model).cast_to_compute(params), make_batch()["inputs"])
    bf, f32 = torch.bfloat16, torch.float32
    # activations and the router weight in bf16; the bias fp32; router probabilities (and so top-k) fp32
    assert seen and all(s == (bf, bf, f32, f32, bf) for s in seen), seen
    seen.clear()
    model.apply(BF16.cast_to_compute(params), make_batch()["inputs"])  # without for_model: the bias is cast
    assert all(s[2] == bf for s in seen)


# ---------------------------------------------------------------- loss and norms in fp32


def test_loss_and_log_softmax_are_fp32_from_bf16_hidden_states():
    model = tiny_model("llama")
    params = model.init(ft.random.key(0))
    params["head"] = params["head"] * 30  # logits of a few units: bf16 rounding of them shows in the loss
    batch = make_batch()
    cast = BF16.cast_to_compute(params)
    h, _ = model.apply(cast, batch["inputs"], logits=False)  # (B, T, D) bf16
    assert h.dtype == torch.bfloat16
    logits64 = h.reshape(-1, h.shape[-1]).double() @ model.head(cast).double().T  # the same bf16 values, fp64
    want = F.cross_entropy(logits64, batch["targets"].reshape(-1))
    loss_fn = BF16.cast_loss(ft.train.next_token_loss(model, chunk_size=5))  # several chunks
    with torch.no_grad():
        plain, _ = loss_fn(params, batch)
    _, (fused, _) = ft.train.value_and_grad(loss_fn)(params, batch)  # the fused Function (gradients in forward)
    for got in (plain, fused):
        assert got.dtype == torch.float32
        assert abs(float(got) - float(want)) <= 1e-5, (float(got), float(want))
    bf16_log_softmax = F.cross_entropy(logits64.to(torch.bfloat16), batch["targets"].reshape(-1))
    assert abs(float(bf16_log_softmax) - float(want)) > 1e-3  # the tolerance above would catch it


def _rms_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_rms_norm_statistics_are_fp32():
    eps = 1e-6
    g = torch.Generator().manual_seed(0)
    x = (50 + 3 * torch.randn(64, 512, generator=g)).to(torch.bfloat16)  # large mean: rounding of x^2 matters
    ones = torch.ones(512, dtype=torch.bfloat16)  # scale 1: the norm's output is its normalized value
    got = ft.nn.rms_norm(x, ones, eps)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, _rms_fp32(x, eps), rtol=0, atol=0)
    bf16_stats = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # what bf16 statistics would give
    assert (bf16_stats != _rms_fp32(x, eps)).float().mean() > 0.1
    # fp16: x^2 = 9e4 overflows (max 65504); float32 statistics do not
    x16 = (300 + torch.randn(8, 256, generator=g)).to(torch.float16)
    got16 = ft.nn.rms_norm(x16, torch.ones(256), eps)
    assert got16.dtype == torch.float16 and torch.isfinite(got16).all()
    torch.testing.assert_close(got16, _rms_fp32(x16, eps), rtol=0, atol=0)
    assert not torch.isfinite(x16.pow(2).mean(-1)).all()


# ---------------------------------------------------------------- compiled


@pytest.mark.parametrize("name", ["llama", pytest.param("deepseek_v3", marks=pytest.mark.slow)])  # MoE: slow tier
def test_compiled_bf16_step_runs_fullgraph_without_recompiles(name):
    model = tiny_model(name)
    params = model.init(ft.random.key(0))
    policy = BF16.for_model(model)
    opt = ft.optim.adamw(ft.optim.warmup_cosine(1e-2, warmup=2, total=10))
    step = ft.train.make_train_step(ft.train.next_token_loss(model), opt, precision=policy,
                                    update_buffers=model.update_buffers)  # fmt: skip
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    state = ref = ft.train.init_state(params, opt)
    for i in range(3):  # new batches, a changing lr: no recompile
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            state, m = compiled(state, make_batch(i))
        ref, m_ref = step(ref, make_batch(i))
        assert m["loss"].dtype == torch.float32
        torch.testing.assert_close(m["loss"], m_ref["loss"], rtol=1e-6, atol=1e-6)
    assert floating_dtypes(state.params) == floating_dtypes(state.opt_state) == {torch.float32}
