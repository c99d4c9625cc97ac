"""Models with ``kernels="triton"``: RMSNorm, SwiGLU and RoPE by ``ftitan.kernels`` (Triton in the interpreter
here) give the ``kernels="torch"`` model's logits and gradients; on the CPU without ``op.interpret()`` the
Triton model *is* the torch model, bit for bit, where its GEMMs are too small for oneDNN (the tiny configs),
and runs its projections, head and loss GEMMs in oneDNN (``ftitan.kernels.onednn``) where they are not.

Gradients of the Triton model come from ``ft.train.value_and_grad(impl="autograd")`` (the kernels' autograd
Functions; under torch.func they would step aside), compared with the torch model's ``torch.func`` path.

Tolerances (fp32): rtol 1e-4, atol 1e-6, as the transform matrix's: the kernels sum the norms' statistics and
dw in another order than the references (each ~1e-7 relative), accumulated over two layers; the loss and
gradients here are 1e-4..1.
"""

import attrs
import pytest
import torch

import ftitan as ft
from ftitan.kernels import onednn as k_onednn
from ftitan.kernels import op
from ftitan.kernels import rms_norm as k_norm
from ftitan.kernels import rope as k_rope
from ftitan.kernels import swiglu as k_swiglu
from tests.kernels._kernel_checks import Spy
from tests.tiny_families import SHRINK, family, tiny_config

F32 = dict(rtol=1e-4, atol=1e-6)
B, T = 2, 8


def _models(name):
    cfg = tiny_config(name)
    fam = family(name)
    return fam.model(cfg), fam.model(attrs.evolve(cfg, kernels="triton"))


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SHRINK["vocab_size"], (B, T + 1), generator=g)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _spies(monkeypatch):
    return (Spy(monkeypatch, k_norm, ("_fwd_op", "_bwd_op")), Spy(monkeypatch, k_swiglu, ("_fwd_op", "_bwd_op")),
            Spy(monkeypatch, k_rope, ("_rope_op",)))  # fmt: skip


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # qwen3: the QK-norm too
def test_triton_model_logits_and_autograd_gradients_equal_the_torch_model(name, monkeypatch):
    torch_model, triton_model = _models(name)
    params, batch = torch_model.init(ft.random.key(0)), _batch()
    norm, swiglu, rope = _spies(monkeypatch)
    with op.interpret():
        logits = triton_model.apply(params, batch["inputs"])[0]
        grads, (loss, _) = ft.train.value_and_grad(ft.train.next_token_loss(triton_model), impl="autograd")(params, batch)
    layers = SHRINK["n_layers"]
    qk = 2 * layers if name == "qwen3" else 0
    # each forward: 2 norms per layer + the final one (+ QK-norms), 1 RoPE launch (q and k) and 1 SwiGLU per layer
    assert norm.calls == {"_fwd_op": 2 * (2 * layers + 1 + qk), "_bwd_op": 2 * layers + 1 + qk}
    assert rope.calls == {"_rope_op": 2 * layers + layers}
    assert swiglu.calls == {"_fwd_op": 2 * layers, "_bwd_op": layers}
    want_grads, (want_loss, _) = ft.train.value_and_grad(ft.train.next_token_loss(torch_model))(params, batch)
    torch.testing.assert_close(logits, torch_model.apply(params, batch["inputs"])[0], **F32)
    torch.testing.assert_close((loss, grads), (want_loss, want_grads), **F32)


def test_compiled_triton_step_gradients_equal_the_torch_model(monkeypatch):
    torch_model, triton_model = _models("llama")
    params, batch = torch_model.init(ft.random.key(0)), _batch()
    grad_fn = ft.train.value_and_grad(ft.train.next_token_loss(triton_model), impl="autograd")
    graphs = []

    def backend(gm, example):
        graphs.append(gm.print_readable(print_output=False))
        return torch._dynamo.backends.debugging.aot_eager(gm, example)

    torch._dynamo.reset()
    with op.interpret():
        grads, (loss, _) = torch.compile(grad_fn, backend=backend, fullgraph=True)(params, batch)
    torch._dynamo.reset()
    code = "\n".join(graphs)
    for name in ("rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd", "swiglu_bwd", "rope"):
        assert f"ftitan_kernels.{name}" in code, name
    want_grads, (want_loss, _) = ft.train.value_and_grad(ft.train.next_token_loss(torch_model))(params, batch)
    torch.testing.assert_close((loss, grads), (want_loss, want_grads), **F32)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_on_cpu_the_triton_model_is_the_torch_model_bit_for_bit(name, monkeypatch):
    torch_model, triton_model = _models(name)
    params, batch = torch_model.init(ft.random.key(0)), _batch()
    spies = (*_spies(monkeypatch), Spy(monkeypatch, k_onednn, ("_linear_op",)))
    got = ft.train.value_and_grad(ft.train.next_token_loss(triton_model), impl="autograd")(params, batch)
    logits = triton_model.apply(params, batch["inputs"])[0]
    assert sum(s.total() for s in spies) == 0  # no interpret(): the references ran; GEMMs below oneDNN's sizes
    want = ft.train.value_and_grad(ft.train.next_token_loss(torch_model), impl="autograd")(params, batch)
    assert torch.equal(logits, torch_model.apply(params, batch["inputs"])[0])
    for a, b in zip(ft.tree.leaves(got), ft.tree.leaves(want), strict=True):
        assert torch.equal(a, b)


def test_on_cpu_the_triton_model_runs_its_gemms_through_the_onednn_ops(monkeypatch):
    """With oneDNN's size floors lifted, the tiny llama's seven projections per layer run through
    ``ftitan.kernels.onednn``'s ops (each in the library picked for its shape: forward and input gradient by
    ``onednn_linear``, the weight gradient by ``gemm_tn``), and the fused loss's logits and ``grad_h`` GEMMs;
    eager and compiled (aot_eager, the autograd path traced), the logits and gradients are the torch model's
    to float32 rounding."""
    monkeypatch.setattr(k_onednn, "MIN_WEIGHT", 0)
    monkeypatch.setattr(k_onednn, "MIN_FLOP", 0)
    torch_model, triton_model = _models("llama")
    params, batch = torch_model.init(ft.random.key(0)), _batch()
    the_op = k_onednn._linear_op
    the_tn = k_onednn._tn_op
    spy = Spy(monkeypatch, k_onednn, ("_linear_op", "_tn_op"))
    grad_fn = ft.train.value_and_grad(ft.train.next_token_loss(triton_model), impl="autograd")
    got = grad_fn(params, batch)
    layers = SHRINK["n_layers"]
    assert spy.calls == {"_linear_op": 2 * 7 * layers + 2, "_tn_op": 7 * layers + 1}  # + weight gradients
    logits = triton_model.apply(params, batch["inputs"])[0]
    # no gradient: forwards and the head
    assert spy.calls == {"_linear_op": 2 * 7 * layers + 2 + 7 * layers + 1, "_tn_op": 7 * layers + 1}
    want = ft.train.value_and_grad(ft.train.next_token_loss(torch_model))(params, batch)
    torch.testing.assert_close(logits, torch_model.apply(params, batch["inputs"])[0], **F32)
    torch.testing.assert_close(got, want, **F32)
    graphs = []

    def backend(gm, example):
        graphs.append(gm.print_readable(print_output=False))
        return torch._dynamo.backends.debugging.aot_eager(gm, example)

    monkeypatch.setattr(k_onednn, "_linear_op", the_op)  # dynamo refuses the spy's count inside a Function
    monkeypatch.setattr(k_onednn, "_tn_op", the_tn)
    torch._dynamo.reset()
    compiled = torch.compile(grad_fn, backend=backend, fullgraph=True)(params, batch)
    torch._dynamo.reset()
    assert "\n".join(graphs).count("ftitan_kernels.onednn_linear") >= 2 * 7 * layers + 2
    assert "\n".join(graphs).count("ftitan_kernels.gemm_tn") >= 7 * layers + 1
    torch.testing.assert_close(compiled, want, **F32)


def test_kernels_field_is_checked():
    with pytest.raises(ValueError, match=r"llama\.Config\.kernels='cuda'"):
        attrs.evolve(tiny_config("llama"), kernels="cuda")
    with pytest.raises(ValueError, match=r"qwen3_moe\.Config\.kernels"):
        attrs.evolve(tiny_config("qwen3_moe"), kernels="")
    assert ft.config.with_kernels("triton")(tiny_config("deepseek_v3")).kernels == "triton"
    with pytest.raises(ValueError, match="--kernels='cuda'"):
        ft.config.with_kernels("cuda")


# qwen3_next is slow here: its Gated DeltaNet chunk kernel (kernels="triton" too) runs in the interpreter
@pytest.mark.parametrize("name", ["deepseek_v3", "muse_glimmer", "qwen3_moe",
                                  pytest.param("qwen3_next", marks=pytest.mark.slow)])  # fmt: skip
def test_other_families_run_the_kernels_and_keep_their_logits(name, monkeypatch):
    """The families' own call sites (MLA's latent norms and rope dims, Muse Glimmer's centered norms,
    Qwen3-Next's zero-centered norms and partial RoPE, the MoE shared experts) reach the kernels (the tiny
    Qwen3-MoE has no dense MLP and no shared expert)."""
    torch_model, triton_model = _models(name)
    params, tokens = torch_model.init(ft.random.key(0)), _batch()["inputs"]
    norm, swiglu, rope = _spies(monkeypatch)
    with op.interpret():
        logits = triton_model.apply(params, tokens)[0]
    assert norm.total() >= 2 * SHRINK["n_layers"] and rope.total() >= 1
    assert swiglu.total() >= (name != "qwen3_moe")
    torch.testing.assert_close(logits, torch_model.apply(params, tokens)[0], **F32)


@pytest.mark.parametrize("name, per_layer", [("deepseek_v3", 5), ("muse_glimmer", 8), ("qwen3_moe", 4),
                                             ("qwen3_next", 2)])  # fmt: skip
def test_other_families_run_their_projections_in_onednn(name, per_layer, monkeypatch):
    """With oneDNN's size floors lifted, the families' own projections (MLA's, Muse Glimmer's gated
    attention, Qwen3-Next's full and GDN layers) and their heads run there without a gradient: at least
    ``per_layer`` per layer of the tiny configs, plus the head; the logits are the torch model's."""
    monkeypatch.setattr(k_onednn, "MIN_WEIGHT", 0)
    monkeypatch.setattr(k_onednn, "MIN_FLOP", 0)
    torch_model, triton_model = _models(name)
    params, tokens = torch_model.init(ft.random.key(0)), _batch()["inputs"]
    spy = Spy(monkeypatch, k_onednn, ("_linear_op",))
    logits = triton_model.apply(params, tokens)[0]
    assert spy.calls["_linear_op"] >= per_layer * SHRINK["n_layers"] + 1
    torch.testing.assert_close(logits, torch_model.apply(params, tokens)[0], **F32)


def test_kernels_flag_sets_the_model_field(tmp_path):
    from ftitan.config import config_from_dict, config_to_dict, parse_train_args

    args = ["--recipe", "deepseek-v3-debug", "--run-dir", str(tmp_path)]
    cfg = parse_train_args([*args, "--kernels", "triton"])
    assert cfg.model.kernels == "triton" and config_from_dict(config_to_dict(cfg)) == cfg
    assert parse_train_args(args).model.kernels == "torch"  # "" keeps the model's
    assert parse_train_args([*args, "--model.kernels", "triton"]).model.kernels == "triton"
    with pytest.raises(ValueError, match="--kernels='cuda'"):
        parse_train_args([*args, "--kernels", "cuda"])


def test_generation_with_triton_kernels_equals_the_torch_model(monkeypatch):
    """The KV-cache path (prefill + decode steps, fused qkv / gate-up projections) with the kernels: the same
    greedy tokens and log-probs (to fp32 rounding) as the torch model."""
    torch_model, triton_model = _models("llama")
    params = torch_model.init(ft.random.key(0))
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    spies = _spies(monkeypatch)
    with op.interpret():
        tokens, logprobs = ft.infer.generate(triton_model, params, prompts, max_new_tokens=4, logprobs=True)
    steps = 4  # the prefill and 3 decode steps, each through every kernel once per layer at least
    assert all(s.total() >= steps * SHRINK["n_layers"] for s in spies)
    want_tokens, want_logprobs = ft.infer.generate(torch_model, params, prompts, max_new_tokens=4, logprobs=True)
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), **F32)


def test_mtp_loss_and_gradients_with_triton_kernels(monkeypatch):
    """DeepSeek-V3 with an MTP module: its norms (enorm, hnorm, block, final) reach the kernel too, and the
    loss (main + MTP) and gradients equal the torch model's."""
    cfg = tiny_config("deepseek_v3", n_mtp_layers=1)
    torch_model = family("deepseek_v3").model(cfg)
    triton_model = family("deepseek_v3").model(attrs.evolve(cfg, kernels="triton"))
    params, batch = torch_model.init(ft.random.key(0)), _batch()
    norm = Spy(monkeypatch, k_norm, ("_fwd_op",))
    with op.interpret():
        grads, (loss, aux) = ft.train.value_and_grad(ft.train.next_token_loss(triton_model), impl="autograd")(params, batch)
    # main: 2 block norms + 2 MLA latent norms per layer, the final norm; MTP: enorm, hnorm, 4 in its block, norm
    assert norm.total() == 4 * SHRINK["n_layers"] + 1 + 7 and "mtp.ce_loss" in aux
    want_grads, (want_loss, _) = ft.train.value_and_grad(ft.train.next_token_loss(torch_model))(params, batch)
    torch.testing.assert_close((loss, grads), (want_loss, want_grads), **F32)
