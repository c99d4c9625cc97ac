"""GRPO / DAPO losses against the published formulas written out by hand; train steps, accumulation, compile."""

import math
import statistics

import attrs
import pytest
import torch

import ftitan as ft
from ftitan import tree as T
from ftitan.models import llama
from ftitan import rl

IGNORE = ft.train.IGNORE_INDEX


def tiny_model(dtype=torch.float32):
    cfg = attrs.evolve(llama.Config.debug(), vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_dim=48, max_seq_len=16)  # fmt: skip
    model = llama.model(cfg)
    return model, model.init(ft.random.key(0), dtype=dtype)


def rl_batch(b=4, t=10, prompt=4, seed=0, vocab=64):
    """Rows of prompt + completion + padding; completions of different lengths (row i has i pad tokens)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (b, t + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[:, : prompt - 1] = IGNORE
    for i in range(b):
        if i:
            targets[i, t - i :] = IGNORE
    adv = torch.tensor([1.0, -1.0] * (b // 2))
    return {"inputs": tokens[:, :-1], "targets": targets, "advantages": adv}


# ---------------------------------------------------------------------------------------------- rewards


def test_group_advantages_match_the_formula():
    rewards = torch.tensor([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 0, 0, 0, 1], dtype=torch.float64)
    g = 4
    want_std, want_none = [], []
    for p in range(3):
        grp = rewards[p * g : (p + 1) * g].tolist()
        mean, std = statistics.fmean(grp), statistics.stdev(grp)  # sample std (G - 1), as documented
        want_std += [(r - mean) / (std + 1e-6) for r in grp]
        want_none += [r - mean for r in grp]
    got = rl.group_advantages(rewards, g)
    torch.testing.assert_close(got, torch.tensor(want_std, dtype=torch.float64), rtol=0, atol=1e-10)
    got = rl.group_advantages(rewards, g, scale="none")
    torch.testing.assert_close(got, torch.tensor(want_none, dtype=torch.float64), rtol=0, atol=1e-10)
    assert rl.group_advantages(rewards.float(), g).dtype == torch.float32
    assert rl.keep_informative_groups(rewards, g).tolist() == [True, False, True]
    assert rl.keep_informative_groups(torch.tensor([1, 1, 1, 0]), 2).tolist() == [False, True]


def test_overlong_penalty_matches_the_formula():
    max_len, cache = 20, 8
    lengths = torch.arange(0, 26)

    def by_hand(n):  # DAPO eq. 13
        if n <= max_len - cache:
            return 0.0
        if n <= max_len:
            return ((max_len - cache) - n) / cache
        return -1.0

    got = rl.overlong_penalty(lengths, max_len=max_len, cache=cache, dtype=torch.float64)
    want = torch.tensor([by_hand(n) for n in lengths.tolist()], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert rl.overlong_penalty(lengths, max_len=max_len, cache=cache).dtype == torch.float32


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: rl.group_advantages(torch.zeros(6), 4), "multiple of"),
        (lambda: rl.group_advantages(torch.zeros(4), 1), "group_size >= 2"),
        (lambda: rl.group_advantages(torch.zeros(4), 2, scale="max"), "scale="),
        (lambda: rl.overlong_penalty(torch.zeros(2), max_len=4, cache=8), "cache=8"),
        (lambda: rl.policy_loss(*[torch.zeros(2, 3)] * 2, torch.zeros(2), torch.ones(2, 3), loss_agg="sum"),
         "loss_agg="),
        (lambda: rl.policy_loss(*[torch.zeros(2, 3)] * 2, torch.zeros(2), torch.ones(2, 3), kl_coef=0.1),
         "needs ref_logp"),
        (lambda: rl.policy_loss(*[torch.zeros(2, 3)] * 2, torch.zeros(2), torch.ones(2, 3), tis_cap=2.0),
         "needs gen_logp"),
        (lambda: rl.policy_loss(*[torch.zeros(2, 3)] * 2, torch.zeros(3), torch.ones(2, 3)), "advantages"),
    ],
)  # fmt: skip
def test_arguments_are_validated(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------------------------------- the surrogate

# ratios below, inside and above [1 - 0.2, 1 + 0.28] for a positive and a negative advantage; one masked token
RATIOS = [[0.5, 0.9, 1.25, 1.5, 1.0], [0.5, 1.1, 1.5, 0.7, 2.0]]
MASK = [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
ADV = [1.5, -2.0]


def surrogate_by_hand(ratios, adv, mask, clip_low, clip_high, loss_agg, ref_minus=None, kl_coef=0.0, w=None):
    """Loss, d loss / d logp and clip fraction, token by token from the formula (PPO / DAPO / GRPO eq. 3)."""
    terms, grads, active = [], [], []
    for i, (row, a) in enumerate(zip(ratios, adv, strict=True)):
        t_row, g_row, c_row = [], [], []
        for j, r in enumerate(row):
            c = min(max(r, 1 - clip_low), 1 + clip_high)
            wt = 1.0 if w is None else w[i][j]
            unclipped_taken = r * a <= c * a
            loss = -min(r * a, c * a) * wt
            grad = -r * a * wt if unclipped_taken else 0.0  # d(ratio)/d(logp) = ratio
            if ref_minus is not None:  # k3 = exp(d) - d - 1, d = ref - logp: dk3/dlogp = 1 - exp(d)
                d = ref_minus[i][j]
                loss += kl_coef * (math.exp(d) - d - 1)
                grad += kl_coef * (1 - math.exp(d))
            t_row.append(loss)
            g_row.append(grad)
            c_row.append(0.0 if unclipped_taken or r * a == c * a else 1.0)
        terms.append(t_row)
        grads.append(g_row)
        active.append(c_row)
    n_tok = sum(map(sum, mask))
    if loss_agg == "token-mean":
        weight = [[m / n_tok for m in row] for row in mask]
    else:
        rows = [row for row in mask if sum(row)]
        weight = [[m / sum(row) / len(rows) if sum(row) else 0.0 for m in row] for row in mask]

    def agg(x):
        return sum(xi * wi for rx, rw in zip(x, weight, strict=True) for xi, wi in zip(rx, rw, strict=True))

    grad = torch.tensor([[g * wi for g, wi in zip(rg, rw, strict=True)] for rg, rw in zip(grads, weight, strict=True)],
                        dtype=torch.float64)  # fmt: skip
    return agg(terms), grad, agg(active)


def logps(ratios, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -5 * torch.rand(len(ratios), len(ratios[0]), generator=g, dtype=torch.float64)
    return (old + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_(), old


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("clip_high", [0.2, 0.28])
def test_clipped_surrogate_and_gradient_match_the_formula(loss_agg, clip_high):
    logp, old = logps(RATIOS)
    mask = torch.tensor(MASK, dtype=torch.bool)
    loss, m = rl.policy_loss(logp, old, torch.tensor(ADV, dtype=torch.float64), mask, clip_low=0.2,
                                clip_high=clip_high, loss_agg=loss_agg)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    want, want_grad, frac = surrogate_by_hand(RATIOS, ADV, MASK, 0.2, clip_high, loss_agg)
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-10)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(m["clip_fraction"], torch.tensor(frac, dtype=torch.float64), rtol=0, atol=1e-10)
    # clipped tokens: A > 0 above 1 + clip_high, A < 0 below 1 - clip_low; no gradient there
    assert grad[0, 3] == 0 and grad[1, 0] == 0 and grad[0, 1] != 0 and grad[1, 2] != 0
    assert (grad[0, 2] == 0) == (clip_high == 0.2)  # ratio 1.25: clipped only without clip-higher
    assert grad[0, 4] == 0 and grad[1, 3:].abs().sum() == 0  # masked
    approx = sum(r - 1 - math.log(r) for row, mrow in zip(RATIOS, MASK, strict=True)
                 for r, mk in zip(row, mrow, strict=True) if mk)  # fmt: skip
    if loss_agg == "token-mean":
        torch.testing.assert_close(m["approx_kl"], torch.tensor(approx / 7, dtype=torch.float64), rtol=0, atol=1e-10)
    assert set(m) == {"clip_fraction", "approx_kl"}


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_k3_kl_and_truncated_importance_weights_match_the_formula(loss_agg):
    logp, old = logps(RATIOS)
    g = torch.Generator().manual_seed(1)
    ref = logp.detach() + 0.5 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    gen = old + 0.7 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    cap, kl_coef = 1.5, 0.3
    w = torch.exp(old - gen).clamp(max=cap)
    assert (w == cap).any() and (w < cap).any()  # the cap is exercised
    loss, m = rl.policy_loss(logp, old, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK),
                                clip_high=0.28, loss_agg=loss_agg, ref_logp=ref, kl_coef=kl_coef, gen_logp=gen,
                                tis_cap=cap)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    d = (ref - logp.detach()).tolist()
    want, want_grad, _ = surrogate_by_hand(RATIOS, ADV, MASK, 0.2, 0.28, loss_agg, ref_minus=d, kl_coef=kl_coef,
                                           w=w.tolist())  # fmt: skip
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-10)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-10)
    # the metrics: k3 means by hand, aggregated like the loss
    mask = torch.tensor(MASK, dtype=torch.float64)

    def mean(x):
        if loss_agg == "token-mean":
            return (x * mask).sum() / mask.sum()
        return ((x * mask).sum(1) / mask.sum(1)).mean()

    dd = torch.tensor(d, dtype=torch.float64)
    torch.testing.assert_close(m["kl"], mean(dd.exp() - dd - 1), rtol=0, atol=1e-10)
    mis = old - gen
    torch.testing.assert_close(m["mismatch_kl"], mean(mis.exp() - mis - 1), rtol=0, atol=1e-10)
    torch.testing.assert_close(m["tis_weight"], mean(w), rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------- log-probs


def test_token_logprobs_and_entropy_equal_full_logits():
    model, params = tiny_model(torch.float64)
    b = rl_batch()
    logits = model.apply(params, b["inputs"])[0]  # (B, T, V)
    full = torch.log_softmax(logits.double(), dim=-1)
    valid = b["targets"] != IGNORE
    want_lp = full.gather(-1, torch.where(valid, b["targets"], 0)[..., None]).squeeze(-1) * valid
    want_ent = -(full.exp() * full).sum(-1) * valid
    lp, ent = rl.token_logprobs_and_entropy(model, params, b["inputs"], b["targets"], chunk_size=7)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-10)
    assert lp.shape == ent.shape == (4, 10) and not ent.requires_grad


# ---------------------------------------------------------------------------------------------- training


def test_train_steps_raise_positive_advantage_logprobs():
    model, params = tiny_model()
    batch = rl_batch()
    with torch.no_grad():
        old, _ = rl.token_logprobs_and_entropy(model, params, batch["inputs"], batch["targets"])
    batch["old_logp"] = old
    opt = ft.optim.adamw(1e-2)
    step = ft.train.make_train_step(rl.grpo_loss_fn(model, clip_high=0.28), opt)
    state = ft.train.init_state(params, opt)
    for _ in range(3):
        state, m = step(state, batch)
    with torch.no_grad():
        new, _ = rl.token_logprobs_and_entropy(model, state.params, batch["inputs"], batch["targets"])
    gain = (new - old).sum(1)  # (B,)
    assert (gain[batch["advantages"] > 0] > 0).all() and (gain[batch["advantages"] < 0] < 0).all()
    assert float(m["approx_kl"]) > 0 and float(m["entropy"]) > 0
    assert int(m["n_tokens"]) == int((batch["targets"] != IGNORE).sum())


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_accumulation_equals_full_batch(loss_agg):
    model, params = tiny_model()
    batch = rl_batch()
    batch["targets"][1] = IGNORE  # a row with no completion: seq-mean counts only the others
    g = torch.Generator().manual_seed(2)
    valid = batch["targets"] != IGNORE
    batch["old_logp"] = torch.where(valid, -4 + 0.3 * torch.randn(4, 10, generator=g), 0.0)
    batch["gen_logp"] = torch.where(valid, batch["old_logp"] + 0.2 * torch.randn(4, 10, generator=g), 0.0)
    batch["ref_logp"] = torch.where(valid, batch["old_logp"] + 0.2 * torch.randn(4, 10, generator=g), 0.0)
    opt = ft.optim.sgd(0.5)
    loss_fn = rl.grpo_loss_fn(model, loss_agg=loss_agg, kl_coef=0.1, tis_cap=2.0)
    s_full, m_full = ft.train.make_train_step(loss_fn, opt)(ft.train.init_state(params, opt), batch)
    s_acc, m_acc = ft.train.make_train_step(loss_fn, opt, accum_steps=2)(ft.train.init_state(params, opt), batch)
    # float32: two half-batch means against one mean, a few ulps apart
    for k in ("loss", "clip_fraction", "approx_kl", "kl", "mismatch_kl", "tis_weight", "entropy"):
        torch.testing.assert_close(m_acc[k], m_full[k], rtol=1e-5, atol=1e-6, msg=k)
    n = int(valid.sum()) if loss_agg == "token-mean" else 3
    assert int(m_acc["n_tokens"]) == int(m_full["n_tokens"]) == n
    for path, a, c in zip(T.paths(s_acc.params), T.leaves(s_acc.params), T.leaves(s_full.params), strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=lambda msg, p=path: f"{p}: {msg}")


def test_compiled_step_matches_eager():
    model, params = tiny_model()
    batch = rl_batch()
    batch["gen_logp"] = torch.where(batch["targets"] != IGNORE, -4.0, 0.0)
    opt = ft.optim.sgd(0.1)
    step = ft.train.make_train_step(rl.grpo_loss_fn(model, tis_cap=2.0, chunk_size=16), opt)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    s_eager, m_eager = step(ft.train.init_state(params, opt), batch)
    s_comp, m_comp = compiled(ft.train.init_state(params, opt), batch)
    for k in ("loss", "mismatch_kl", "entropy"):
        torch.testing.assert_close(m_comp[k], m_eager[k], rtol=1e-5, atol=1e-6, msg=k)
    for a, c in zip(T.leaves(s_comp.params), T.leaves(s_eager.params), strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
