"""DPO / IPO: the loss against the published formulas, completion log-probs, train steps, accumulation, compile."""

import math

import attrs
import pytest
import torch
import torch.nn.functional as F

import ftitan as ft
from ftitan import tree as T
from ftitan.models import llama
from ftitan.train import dpo

IGNORE = ft.train.IGNORE_INDEX


def tiny_model(dtype=torch.float32):
    cfg = attrs.evolve(llama.Config.debug(), vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_dim=48, max_seq_len=16)  # fmt: skip
    model = llama.model(cfg)
    return model, model.init(ft.random.key(0), dtype=dtype)


def pair_batch(b=4, t=12, prompt=5, seed=0, vocab=64):
    """Random preference rows: ``prompt`` target positions ignored, then a completion, then padding."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for side, pad in (("chosen", 2), ("rejected", 0)):
        tokens = torch.randint(1, vocab, (b, t + 1), generator=g)
        targets = tokens[:, 1:].clone()
        targets[:, : prompt - 1] = IGNORE
        if pad:
            targets[:, -pad:] = IGNORE
        out[f"{side}_inputs"], out[f"{side}_targets"] = tokens[:, :-1], targets
    return out


def logps(p=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(-10 * torch.rand(p, generator=g, dtype=torch.float64)).requires_grad_() for _ in range(4)]


# ---------------------------------------------------------------------------------------------- the formula


def by_hand(pc, pr, rc, rr, beta, loss_type, eps):
    """Loss and d loss / d (pi_chosen, pi_rejected), written out from the papers (mean over P pairs)."""
    p = pc.shape[0]
    h = (pc - pr) - (rc - rr)
    if loss_type == "sigmoid":  # Rafailov et al. 2023 eq. 7; eps: conservative DPO
        loss = (-(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)).mean()
        # d/dh: -(1 - eps) beta sigmoid(-beta h) + eps beta sigmoid(beta h)
        dh = (-(1 - eps) * beta * torch.sigmoid(-beta * h) + eps * beta * torch.sigmoid(beta * h)) / p
    else:  # IPO, Azar et al. 2023 eq. 17
        loss = ((h - 1 / (2 * beta)) ** 2).mean()
        dh = 2 * (h - 1 / (2 * beta)) / p
    return loss, dh, -dh


@pytest.mark.parametrize(
    "loss_type,eps,reference_free",
    [("sigmoid", 0.0, False), ("sigmoid", 0.25, False), ("ipo", 0.0, False), ("sigmoid", 0.0, True),
     ("sigmoid", 0.1, True), ("ipo", 0.0, True)],
)  # fmt: skip
def test_loss_and_gradient_match_the_published_formula(loss_type, eps, reference_free):
    # float64 throughout: the only difference is summation order, far below 1e-6
    pc, pr, rc, rr = logps()
    beta = 0.3
    loss, _ = ft.train.dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps,
                                reference_free=reference_free)  # fmt: skip
    g_c, g_r = torch.autograd.grad(loss, (pc, pr))
    zero = torch.zeros_like(rc)
    want, dc, dr = by_hand(pc.detach(), pr.detach(), zero if reference_free else rc.detach(),
                           zero if reference_free else rr.detach(), beta, loss_type, eps)  # fmt: skip
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(g_c, dc, rtol=0, atol=1e-6)
    torch.testing.assert_close(g_r, dr, rtol=0, atol=1e-6)


def test_sigmoid_is_log2_at_the_reference_and_metrics():
    pc, pr, rc, rr = (x.detach() for x in logps())
    loss, _ = ft.train.dpo_loss(rc, rr, rc, rr)  # policy == reference: h = 0
    assert math.isclose(float(loss), math.log(2), rel_tol=1e-12)
    loss, m = ft.train.dpo_loss(pc, pr, rc, rr, beta=0.5)
    rw_c, rw_r = 0.5 * (pc - rc), 0.5 * (pr - rr)
    torch.testing.assert_close(m["rewards/chosen"], rw_c.mean())
    torch.testing.assert_close(m["rewards/rejected"], rw_r.mean())
    torch.testing.assert_close(m["rewards/margin"], (rw_c - rw_r).mean())
    assert float(m["rewards/accuracy"]) == float((rw_c > rw_r).double().mean())
    assert all(v.dim() == 0 and v.is_floating_point() and not v.requires_grad for v in m.values())


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"loss_type": "hinge"}, "loss_type='hinge' is unknown; use one of 'sigmoid', 'ipo'"),
        ({"beta": 0.0}, "beta=0.0 must be > 0"),
        ({"label_smoothing": 0.5}, r"label_smoothing=0.5 must be in \[0, 0.5\)"),
        ({"label_smoothing": -0.1}, "must be in"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "applies to loss_type='sigmoid' only"),
    ],
)
def test_arguments_are_validated(kw, message):
    pc, pr, rc, rr = logps()
    with pytest.raises(ValueError, match=message):
        ft.train.dpo_loss(pc, pr, rc, rr, **kw)
    model, _ = tiny_model()
    with pytest.raises(ValueError, match=message.replace("dpo_loss", "dpo_loss_fn")):
        ft.train.dpo_loss_fn(model, **kw)


def test_shape_mismatch_and_missing_reference_are_named():
    pc, pr, rc, rr = logps()
    with pytest.raises(ValueError, match="must all be"):
        ft.train.dpo_loss(pc, pr[:3], rc, rr)
    model, params = tiny_model()
    with pytest.raises(ValueError, match="with_reference"):
        ft.train.dpo_loss_fn(model)(params, pair_batch())
    with pytest.raises(ValueError, match="'chosen_inputs'"):
        ft.train.dpo_loss_fn(model, reference_free=True)(params, {"inputs": torch.zeros(2, 3, dtype=torch.int64)})


# ---------------------------------------------------------------------------------------------- log-probs


def full_logits_logprobs(model, params, inputs, targets):
    """Independent: all logits, log_softmax, gather, masked sum."""
    logits, _ = model.apply(params, inputs)  # (B, T, V)
    logp = torch.log_softmax(logits.double(), dim=-1)
    valid = targets != IGNORE
    picked = logp.gather(-1, torch.where(valid, targets, 0)[..., None]).squeeze(-1)
    return (picked * valid).sum(dim=1)


def test_completion_logprobs_equal_full_logits_and_fused_gradients_equal_plain():
    # float64 params: the chunked fused path and the plain path differ only in summation order
    model, params = tiny_model(torch.float64)
    b = pair_batch()
    x, y = b["chosen_inputs"], b["chosen_targets"]
    want = full_logits_logprobs(model, params, x, y)
    got = ft.train.completion_logprobs(model, params, x, y, chunk_size=7)  # chunks straddle rows
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert float(ft.train.completion_logprobs(model, params, x, torch.full_like(y, IGNORE)).abs().sum()) == 0.0

    weights = torch.linspace(-1, 2, x.shape[0], dtype=torch.float64)  # a different incoming gradient per row

    def f(p, fused):
        return (ft.train.completion_logprobs(model, p, x, y, chunk_size=7, fused=fused) * weights).sum()

    g_fused = torch.func.grad(f)(params, True)
    g_plain = torch.func.grad(f)(params, False)
    for path, a, c in zip(T.paths(g_fused), T.leaves(g_fused), T.leaves(g_plain), strict=True):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-12, msg=lambda m, p=path: f"{p}: {m}")


def test_positions_are_passed_to_apply():
    model, params = tiny_model()
    b = pair_batch()
    loss_fn = ft.train.dpo_loss_fn(model, reference_free=True)
    base, _ = loss_fn(params, b)
    arange = torch.arange(12).expand(4, 12)
    same, _ = loss_fn(params, {**b, "chosen_positions": arange, "rejected_positions": arange})
    # RoPE is relative: a uniform shift would change nothing, a stretch does
    stretched, _ = loss_fn(params, {**b, "chosen_positions": 2 * arange, "rejected_positions": arange})
    torch.testing.assert_close(same, base, rtol=0, atol=1e-6)
    assert not torch.allclose(stretched, base)


def test_with_reference_and_ipo_averages_per_token():
    model, params = tiny_model(torch.float64)
    ref = T.map(lambda p: p + 0.01, params)
    b = ft.train.with_reference(model, ref, pair_batch())
    assert b["ref_chosen"].dtype == torch.float32 and b["ref_chosen"].shape == (4,)
    pi_c = ft.train.completion_logprobs(model, params, b["chosen_inputs"], b["chosen_targets"])
    pi_r = ft.train.completion_logprobs(model, params, b["rejected_inputs"], b["rejected_targets"])
    n_c = (b["chosen_targets"] != IGNORE).sum(1)
    n_r = (b["rejected_targets"] != IGNORE).sum(1)
    loss, aux = ft.train.dpo_loss_fn(model, beta=0.2, loss_type="ipo")(params, b)
    h = (pi_c / n_c - pi_r / n_r) - (b["ref_chosen"].double() / n_c - b["ref_rejected"].double() / n_r)
    torch.testing.assert_close(loss, ((h - 1 / (2 * 0.2)) ** 2).mean(), rtol=1e-6, atol=1e-9)
    assert int(aux["n_pairs"]) == int(aux["n_tokens"]) == 4


def test_sides_of_different_lengths_and_per_example_grads():
    model, params = tiny_model()
    b = pair_batch(b=2)
    b["rejected_inputs"], b["rejected_targets"] = b["rejected_inputs"][:, :9], b["rejected_targets"][:, :9]
    loss_fn = ft.train.dpo_loss_fn(model, reference_free=True)
    loss, _ = loss_fn(params, b)
    pc = ft.train.completion_logprobs(model, params, b["chosen_inputs"], b["chosen_targets"])
    pr = ft.train.completion_logprobs(model, params, b["rejected_inputs"], b["rejected_targets"])
    torch.testing.assert_close(loss, -F.logsigmoid(0.1 * (pc - pr)).mean())
    # vmap(grad(...)): the plain log-prob path; row 0's gradient is that of a batch of row 0 alone
    grads, (losses, _) = ft.train.per_example_grads(loss_fn)(params, b)
    g0, _ = torch.func.grad(loss_fn, has_aux=True)(params, T.map(lambda x: x[:1], b))
    for a, c in zip(T.leaves(grads), T.leaves(g0), strict=True):
        torch.testing.assert_close(a[0], c, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------- training


def test_train_steps_raise_reward_accuracy():
    model, params = tiny_model()
    batch = ft.train.with_reference(model, params, pair_batch(b=8))
    opt = ft.optim.adamw(3e-3)
    step = ft.train.make_train_step(ft.train.dpo_loss_fn(model, beta=0.5), opt)
    state = ft.train.init_state(params, opt)
    state, first = step(state, batch)
    assert math.isclose(float(first["loss"]), math.log(2), rel_tol=1e-5)  # policy == reference
    for _ in range(10):
        state, m = step(state, batch)
    assert float(m["loss"]) < 0.5 * math.log(2)
    assert float(m["rewards/accuracy"]) == 1.0 and float(m["rewards/margin"]) > 0


def test_accumulation_equals_full_batch():
    model, params = tiny_model()
    ref = T.map(lambda p: p * 0.9, params)
    batch = ft.train.with_reference(model, ref, pair_batch(b=4))
    opt = ft.optim.sgd(0.5)
    loss_fn = ft.train.dpo_loss_fn(model, beta=0.5, label_smoothing=0.1)
    s_full, m_full = ft.train.make_train_step(loss_fn, opt)(ft.train.init_state(params, opt), batch)
    s_acc, m_acc = ft.train.make_train_step(loss_fn, opt, accum_steps=2)(ft.train.init_state(params, opt), batch)
    # float32: two half-batch means against one mean, a few ulps apart
    for k in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin"):
        torch.testing.assert_close(m_acc[k], m_full[k], rtol=1e-5, atol=1e-6, msg=k)
    assert int(m_acc["n_pairs"]) == int(m_full["n_pairs"]) == 4
    for path, a, c in zip(T.paths(s_acc.params), T.leaves(s_acc.params), T.leaves(s_full.params), strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=lambda m, p=path: f"{p}: {m}")


def test_compiled_step_matches_eager():
    model, params = tiny_model()
    batch = ft.train.with_reference(model, T.map(lambda p: p * 0.9, params), pair_batch())
    opt = ft.optim.sgd(0.1)
    step = ft.train.make_train_step(ft.train.dpo_loss_fn(model, beta=0.1, chunk_size=16), opt)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    s_eager, m_eager = step(ft.train.init_state(params, opt), batch)
    s_comp, m_comp = compiled(ft.train.init_state(params, opt), batch)
    torch.testing.assert_close(m_comp["loss"], m_eager["loss"], rtol=1e-5, atol=1e-6)
    for a, c in zip(T.leaves(s_comp.params), T.leaves(s_eager.params), strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
