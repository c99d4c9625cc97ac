"""The train step with an MoE model: balancing loss in the loss, router load in the metrics,
frozen balancing bias moved only by update_buffers. A minimal MoE LM (embed -> MoE -> head)
keeps this independent of the model families."""

import functools

import torch

import ftitan as ft
from ftitan import nn
from ftitan.models.base import Model, drop_aux
from ftitan.nn import moe as M

V, D = 64, 32
CFG = M.MoEConfig(n_experts=4, top_k=2, expert_dim=16, score_func="sigmoid", score_bias=True,
                  aux_loss_coef=0.05, bias_update_rate=0.01)  # fmt: skip
SPECS = {"embed": nn.embed_param(V, D), "moe": M.moe_params(D, CFG, std=0.2), "head": nn.linear_param(D, V, axes=("vocab", "embed"))}


def _apply_with_aux(params, tokens, *, positions=None, cache=None, logits=True):
    h = nn.embed(tokens, params["embed"])
    y, stats = M.moe(h, params["moe"], CFG)
    h = h + y
    return (nn.linear(h, params["head"]) if logits else h), cache, M.moe_aux([stats], CFG)


def _update_buffers(params, metrics):
    bias = M.update_router_bias(params["moe"]["router_bias"], metrics["moe.tokens_per_expert"][0], CFG.bias_update_rate)
    return {**params, "moe": {**params["moe"], "router_bias": bias}}


MODEL = Model(
    config=CFG, init=functools.partial(nn.init, SPECS), apply=drop_aux(_apply_with_aux), head=lambda p: p["head"],
    param_axes=nn.axes(SPECS), flops_per_token=lambda t: 0.0, apply_with_aux=_apply_with_aux,
    frozen=("moe.router_bias",), update_buffers=_update_buffers,
)  # fmt: skip


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (4, 9), generator=g)
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def test_loss_adds_weighted_balancing_loss_and_reports_load():
    params, batch = MODEL.init(ft.random.key(0)), _batch()
    loss, aux = ft.train.next_token_loss(MODEL)(params, batch)
    logits, _ = MODEL.apply(params, batch["inputs"])
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), batch["targets"].reshape(-1))
    torch.testing.assert_close(aux["ce_loss"], ce)
    torch.testing.assert_close(loss, ce + CFG.aux_loss_coef * aux["moe.aux_loss"])
    assert aux["moe.tokens_per_expert"].sum() == batch["inputs"].numel() * CFG.top_k


def test_bias_is_frozen_for_the_optimizer_and_moved_by_update_buffers():
    params = MODEL.init(ft.random.key(1))
    opt = ft.optim.chain(ft.optim.adamw(1e-2, weight_decay=0.5), ft.optim.freeze(MODEL.frozen))
    plain = ft.train.make_train_step(ft.train.next_token_loss(MODEL), opt)
    with_buffers = ft.train.make_train_step(ft.train.next_token_loss(MODEL), opt, update_buffers=MODEL.update_buffers)
    state = ft.train.init_state(params, opt)
    s1, m = plain(state, _batch())
    torch.testing.assert_close(s1.params["moe"]["router_bias"], params["moe"]["router_bias"], rtol=0, atol=0)
    assert not torch.equal(s1.params["moe"]["router"], params["moe"]["router"])  # the rest trains
    s2, m2 = with_buffers(state, _batch())
    load = m2["moe.tokens_per_expert"][0]
    delta = s2.params["moe"]["router_bias"] - params["moe"]["router_bias"]
    over, under = load > load.mean(), load < load.mean()
    assert over.any() and (delta[over] < 0).all() and (delta[under] > 0).all()


def test_compiled_moe_step_equals_eager_without_recompiles():
    params = MODEL.init(ft.random.key(2))
    opt = ft.optim.chain(ft.optim.adamw(ft.optim.linear_warmup(1e-2, 3)), ft.optim.freeze(MODEL.frozen))
    step = ft.train.make_train_step(ft.train.next_token_loss(MODEL), opt, update_buffers=MODEL.update_buffers)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_state = compiled_state = ft.train.init_state(params, opt)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(3):
            eager_state, em = step(eager_state, _batch(i))
            compiled_state, cm = compiled(compiled_state, _batch(i))
            torch.testing.assert_close(cm["loss"], em["loss"], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(cm["moe.tokens_per_expert"], em["moe.tokens_per_expert"])
    torch.testing.assert_close(compiled_state.params, eager_state.params, rtol=1e-5, atol=1e-6)
