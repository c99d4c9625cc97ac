"""Expert-parallel seams in one process: exactly ``nn.moe`` without a layout, the regrouping of
received rows, the idle-rank padding, and where the rules put the MoE leaves."""

from __future__ import annotations

import pytest
import torch

import ftitan as ft
from ftitan import nn, parallel
from ftitan.models import deepseek_v3, qwen3_moe
from ftitan.nn import moe as M
from ftitan.parallel import collectives as C
from ftitan.parallel import expert

D = 32
CFG = M.MoEConfig(n_experts=8, top_k=2, expert_dim=16, n_shared_experts=1, score_func="sigmoid",
                  score_bias=True, aux_loss_coef=0.1)  # fmt: skip


def _params(seed: int = 0):
    p = nn.init(M.moe_params(D, CFG, std=0.2), ft.random.key(seed))
    p["router_bias"] = 0.1 * torch.randn(CFG.n_experts, generator=torch.Generator().manual_seed(seed))
    return p


def test_seams_without_a_layout_are_exactly_nn_moe():
    assert parallel.current() is None
    p, x = _params(), torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    y, s = expert.moe(x, p, CFG)
    y_ref, s_ref = M.moe(x, p, CFG)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(tuple(s), tuple(s_ref), rtol=0, atol=0)
    assert expert.global_stats([s]) == [s]
    aux, aux_ref = expert.moe_aux([s], CFG), M.moe_aux([s_ref], CFG)
    torch.testing.assert_close(aux, aux_ref, rtol=0, atol=0)
    xs, offs = torch.randn(6, D), torch.tensor([2, 2, 3, 3, 3, 5, 6, 6], dtype=torch.int32)
    ex = p["experts"]
    got = expert.experts_forward(xs, offs, **ex)
    torch.testing.assert_close(got, M.experts_forward(xs, offs, **ex), rtol=0, atol=0)


def test_collectives_without_a_group_are_identities():
    x = torch.randn(3)
    assert C.psum(x, None) is x


def test_regroup_orders_received_rows_by_local_expert_then_source():
    recv = torch.tensor([[2, 0, 1], [1, 3, 0]])  # (source rank, local expert): rows received
    # received rows as (source, expert) labels, grouped by source then expert
    labels = [(s, e) for s in range(2) for e in range(3) for _ in range(int(recv[s, e]))]
    order, offs = expert.regroup_by_expert(recv)
    got = [labels[i] for i in order.tolist()]
    assert got == sorted(labels, key=lambda se: (se[1], se[0]))
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 6, 7]
    assert order.tolist()[:3] == [0, 1, 3]  # stable: the source's own row order is kept


def test_idle_rank_runs_its_experts_on_no_rows_with_zero_gradients():
    ex = {k: v.clone().requires_grad_(True) for k, v in _params()["experts"].items()}
    x = torch.zeros(0, D, requires_grad=True)
    y = expert._local_experts(x, torch.zeros(8, dtype=torch.int32), **ex)
    assert y.shape == (0, D)
    grads = torch.autograd.grad(y.sum(), [x, *ex.values()])  # stays in the graph: every weight is reached
    assert grads[0].shape == (0, D)
    assert all(not g.any() for g in grads[1:])


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_rules_split_routed_experts_and_their_router_rows_over_ep(family):
    module = {"qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}[family]
    model = module.model(module.Config.debug())
    meta = ft.tree.map(lambda s: torch.empty(s.shape, device="meta"), module.param_specs(model.config))
    placements = parallel.dump(parallel.resolve(meta, model.param_axes, parallel.default_rules(),
                                                {"ep": 2, "dp_shard": 2}))  # fmt: skip
    layer = str(model.config.n_layers - 1)
    pre = f"layers.{layer}.moe"
    assert placements[f"{pre}.experts.w1"] == "(ep, -, dp_shard)"
    assert placements[f"{pre}.experts.w2"] == "(ep, dp_shard, -)"
    assert placements[f"{pre}.router"] == "(ep, dp_shard)"  # all-gathered over ep for routing
    if family == "deepseek_v3":
        assert placements[f"{pre}.router_bias"] == "(ep)"
        assert "ep" not in placements[f"{pre}.shared.w1"]


@pytest.mark.parametrize(("dtype", "n_experts", "tol"), [(torch.float32, 8, 1e-6), (torch.bfloat16, 520, 2e-2)])
def test_padded_exchange_math_equals_the_routed_experts(dtype, n_experts, tol):
    """The padded exchange in one process: each destination's block of the send buffer, run through that
    rank's experts (``_local_routed``), summed over ranks == nn.moe's routed output. The expert ids travel
    bit-cast in the rows' dtype: exact in bf16 too, for E = 520 > 256 where a value cast would round.
    Tolerance: fp32 rounding (1e-6); bf16 sums the ranks' partials in another order (2e-2)."""
    cfg = M.MoEConfig(n_experts=n_experts, top_k=3, expert_dim=4)
    p = ft.tree.map(lambda t: t.to(dtype), nn.init(M.moe_params(8, cfg, std=0.3), ft.random.key(0)))
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    routing = M.route(x, p, cfg)
    ep, n_local = 2, n_experts // 2
    buf = expert._send_buffer(x, routing, n_local, ep).view(ep, 10, -1)  # (ep, N, D + 2k)
    ids = buf[..., 8 + 3 :].contiguous().view(expert._INT_OF_SIZE[x.element_size()]).long() - 1
    for r in range(ep):  # each destination sees exactly its own experts' local ids
        mine = routing.experts // n_local == r
        assert torch.equal(ids[r], torch.where(mine, routing.experts % n_local, -1))
    ex = p["experts"]
    partials = [expert._local_routed(buf[r], {k: w[r * n_local : (r + 1) * n_local] for k, w in ex.items()}, cfg)
                for r in range(ep)]  # fmt: skip
    d = M.dispatch(x, routing, n_experts)
    ref = M.combine(M.experts_forward(d.x, d.offs, ex["w1"], ex["w2"], ex["w3"]), d, routing)
    torch.testing.assert_close(partials[0] + partials[1], ref, rtol=tol, atol=tol)


def test_exchange_is_validated_and_scoped():
    assert expert.current_exchange() == "padded"
    with expert.exchange("sync"):
        assert expert.current_exchange() == "sync"
    assert expert.current_exchange() == "padded"
    with pytest.raises(ValueError, match="expected one of"):
        with expert.exchange("fast"):
            pass
