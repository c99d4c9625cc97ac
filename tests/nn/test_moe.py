"""MoE layer: grouped compute vs a naive per-expert loop, routing rules, balancing loss vs transformers."""

import pytest
import torch

import ftitan as ft
from ftitan import nn
from ftitan.nn import moe as M

D = 32
QWEN_LIKE = M.MoEConfig(n_experts=8, top_k=2, expert_dim=16, aux_loss_coef=0.01)
DEEPSEEK_LIKE = M.MoEConfig(
    n_experts=8, top_k=3, expert_dim=16, n_shared_experts=1, score_func="sigmoid",
    n_groups=4, topk_groups=2, routed_scale=2.5, score_bias=True,
)  # fmt: skip
CONFIGS = {"softmax": QWEN_LIKE, "sigmoid-grouped-biased-shared": DEEPSEEK_LIKE}


def _params(cfg: M.MoEConfig, seed: int = 0):
    p = nn.init(M.moe_params(D, cfg, std=0.2), ft.random.key(seed))
    if cfg.score_bias:  # a nonzero bias, so that selection differs from the raw scores
        p["router_bias"] = torch.randn(cfg.n_experts, generator=torch.Generator().manual_seed(seed)) * 0.1
    return p


def _naive(x, p, cfg):
    x2 = x.reshape(-1, D)
    out = M.experts_reference(x2, M.route(x2, p, cfg), **p["experts"])
    if cfg.n_shared_experts:
        out = out + nn.swiglu(x2, **p["shared"])
    return out.view(x.shape)


@pytest.mark.parametrize("name", CONFIGS)
def test_grouped_experts_equal_naive_loop_values_and_grads(name):
    cfg = CONFIGS[name]
    p = _params(cfg)
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1))
    # same GEMMs on the same rows, but the combine sums the k choices in a different
    # order than the loop's index_add: fp32 rounding only
    torch.testing.assert_close(M.moe(x, p, cfg)[0], _naive(x, p, cfg), rtol=1e-6, atol=1e-6)

    def loss(fn, p, x):
        return fn(x, p).square().mean()

    g_fast = torch.func.grad(lambda p, x: loss(lambda x, p: M.moe(x, p, cfg)[0], p, x), argnums=(0, 1))(p, x)
    g_ref = torch.func.grad(lambda p, x: loss(lambda x, p: _naive(x, p, cfg), p, x), argnums=(0, 1))(p, x)
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-5, atol=1e-7)
    assert g_fast[0]["router"].abs().sum() > 0, "the router learns through the routing weights"


def test_group_limited_routing_only_picks_from_the_best_groups():
    cfg = DEEPSEEK_LIKE
    p = _params(cfg, seed=2)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(3))
    r = M.route(x, p, cfg)
    choice = torch.sigmoid(x @ p["router"].T) + p["router_bias"]
    per_group = cfg.n_experts // cfg.n_groups
    group_score = choice.view(-1, cfg.n_groups, per_group).topk(2, -1).values.sum(-1)
    best = group_score.topk(cfg.topk_groups, -1).indices  # (N, topk_groups)
    for row in range(x.shape[0]):
        assert set((r.experts[row] // per_group).tolist()) <= set(best[row].tolist())


def test_bias_steers_selection_but_not_weights():
    cfg = M.MoEConfig(n_experts=8, top_k=2, expert_dim=4, score_func="sigmoid", score_bias=True, norm_topk=False)
    p = _params(cfg, seed=4)
    x = torch.randn(32, D, generator=torch.Generator().manual_seed(5))
    p["router_bias"] = torch.zeros(8).index_fill(0, torch.tensor([6]), 10.0)  # expert 6 always chosen
    r = M.route(x, p, cfg)
    assert (r.experts == 6).any(-1).all()
    scores = torch.sigmoid(x @ p["router"].T)
    torch.testing.assert_close(r.weights, scores.gather(1, r.experts))  # unbiased scores


@pytest.mark.parametrize("name", CONFIGS)
def test_weights_sum_to_routed_scale_when_normalized(name):
    cfg = CONFIGS[name]
    r = M.route(torch.randn(16, D), _params(cfg), cfg)
    torch.testing.assert_close(r.weights.sum(-1), torch.full((16,), cfg.routed_scale))


def test_balancing_loss_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    cfg = QWEN_LIKE
    layers = [_params(cfg, seed=s) for s in range(3)]
    xs = [torch.randn(2, 5, D, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    stats = [M.moe(x, p, cfg)[1] for x, p in zip(xs, layers, strict=True)]
    logits = tuple(x.reshape(-1, D) @ p["router"].T for x, p in zip(xs, layers, strict=True))
    ref = load_balancing_loss_func(logits, cfg.n_experts, cfg.top_k)
    aux = M.moe_aux(stats, cfg)
    torch.testing.assert_close(aux["moe.aux_loss"], ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(aux["loss"], cfg.aux_loss_coef * ref, rtol=1e-6, atol=0)
    assert aux["moe.tokens_per_expert"].shape == (3, cfg.n_experts)
    torch.testing.assert_close(aux["moe.tokens_per_expert"].sum(-1), torch.full((3,), 10.0 * cfg.top_k))


def test_balancing_loss_is_top_k_for_a_uniform_router():
    cfg = QWEN_LIKE
    p = _params(cfg)
    p["router"] = torch.zeros_like(p["router"])
    _, st = M.moe(torch.randn(4, 6, D), p, cfg)
    torch.testing.assert_close(M.load_balancing_loss([st]), torch.tensor(float(cfg.top_k)))


def test_router_bias_update_moves_towards_balance():
    bias = torch.zeros(4)
    load = torch.tensor([10.0, 2.0, 4.0, 0.0])  # mean 4
    new = M.update_router_bias(bias, load, 0.01)
    torch.testing.assert_close(new, torch.tensor([-0.01, 0.01, 0.0, 0.01]))


@pytest.mark.parametrize("name", CONFIGS)
def test_compiled_grad_equals_eager(name):
    cfg = CONFIGS[name]
    p, x = _params(cfg), torch.randn(2, 9, D)

    def f(p, x):
        return torch.func.grad_and_value(lambda p: M.moe(x, p, cfg)[0].square().mean())(p)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(p, x), f(p, x))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="top_k=9 exceeds n_experts=8"):
        M.MoEConfig(n_experts=8, top_k=9, expert_dim=4)
    with pytest.raises(ValueError, match="n_groups=3"):
        M.MoEConfig(n_experts=8, top_k=2, expert_dim=4, n_groups=3)
    with pytest.raises(ValueError, match="score_func"):
        M.MoEConfig(n_experts=8, top_k=2, expert_dim=4, score_func="relu")
