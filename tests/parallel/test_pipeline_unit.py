"""Pipeline parallelism without processes: stage splits, stage params, schedules as data, ``Model.stage``."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest
import torch

import ftitan as ft
from ftitan.models import deepseek_v3, llama, qwen3, qwen3_moe
from ftitan.nn import moe as moe_
from ftitan.parallel import pipeline


def fake_layout(pp: int, stage: int) -> SimpleNamespace:
    """What ``stage_params`` reads of a ``Layout``: the ``pp`` size and this rank's stage."""
    return SimpleNamespace(sizes={"pp": pp}, coords={"pp": stage})


def tiny_llama(**kw) -> llama.Config:
    return attrs.evolve(
        llama.Config.debug(), vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, **kw
    )


# ---------------------------------------------------------------- stage_layers


@pytest.mark.parametrize(("n_layers", "pp"), [(4, 1), (4, 2), (4, 4), (5, 2), (7, 3), (32, 5)])
def test_stage_layers_cover_every_layer_once_in_order_and_evenly(n_layers, pp):
    ranges = [pipeline.stage_layers(n_layers, pp, s) for s in range(pp)]
    assert [i for r in ranges for i in r] == list(range(n_layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra layers go to the early stages (the last has the head)


def test_stage_layers_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="pp=5 stages for a model of 4 layers.*pp <= 4"):
        pipeline.stage_layers(4, 5, 0)
    with pytest.raises(ValueError, match="stage 2 is not in range"):
        pipeline.stage_layers(4, 2, 2)


# ---------------------------------------------------------------- schedules


CASES = [(pp, m) for pp in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


def in_flight(actions: list[pipeline.Action]) -> int:
    """Most micro-batches forwarded but not yet backwarded at once (activations held)."""
    held, most = 0, 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "m"), CASES)
def test_every_microbatch_is_forwarded_then_backwarded_once_per_stage(schedule, pp, m):
    for stage in range(pp):
        actions = pipeline.schedule_actions(schedule, pp, stage, m)
        assert sorted(actions) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        for i in range(m):
            assert actions.index(("F", i)) < actions.index(("B", i))
        # forwards and backwards each in micro-batch order: the order messages arrive between stages
        assert [i for k, i in actions if k == "F"] == list(range(m))
        assert [i for k, i in actions if k == "B"] == list(range(m))


@pytest.mark.parametrize(("pp", "m"), CASES)
def test_1f1b_holds_at_most_pp_minus_stage_activations_gpipe_holds_all(pp, m):
    for stage in range(pp):
        assert in_flight(pipeline.schedule_actions("1f1b", pp, stage, m)) == min(pp - stage, m)
        assert in_flight(pipeline.schedule_actions("gpipe", pp, stage, m)) == m


def test_1f1b_action_list_for_four_stages():
    f, b = "F", "B"
    assert pipeline.one_f_one_b(4, 0, 6) == [(f, 0), (f, 1), (f, 2), (f, 3), (b, 0), (f, 4), (b, 1), (f, 5),
                                             (b, 2), (b, 3), (b, 4), (b, 5)]  # fmt: skip
    assert pipeline.one_f_one_b(4, 3, 3) == [(f, 0), (b, 0), (f, 1), (b, 1), (f, 2), (b, 2)]


def run_without_deadlock(schedule: str, pp: int, m: int) -> list[tuple[int, str, int]]:
    """Simulate every stage with non-blocking sends and blocking receives: a stage waits only when the
    message its next action needs has not been sent. Returns the global order; fails on a deadlock."""
    lists = [pipeline.schedule_actions(schedule, pp, s, m) for s in range(pp)]
    pos, sent, order = [0] * pp, set(), []
    while any(p < len(lst) for p, lst in zip(pos, lists, strict=True)):
        progressed = False
        for s in range(pp):
            if pos[s] == len(lists[s]):
                continue
            kind, i = lists[s][pos[s]]
            needs = None  # the message this action waits for: an activation from s - 1, a gradient from s + 1
            if kind == "F" and s > 0:
                needs = ("act", s - 1, i)
            elif kind == "B" and s < pp - 1:
                needs = ("grad", s + 1, i)
            if needs is None or needs in sent:
                sent.add(("act", s, i) if kind == "F" else ("grad", s, i))
                order.append((s, kind, i))
                pos[s] += 1
                progressed = True
        assert progressed, f"{schedule} pp={pp} M={m} deadlocks at {pos}"
    return order


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "m"), CASES)
def test_schedules_complete_across_stages(schedule, pp, m):
    order = run_without_deadlock(schedule, pp, m)
    assert len(order) == 2 * pp * m


def test_schedule_errors_name_the_fix():
    with pytest.raises(ValueError, match="schedule='zb'.*'1f1b', 'gpipe'"):
        pipeline.schedule_actions("zb", 2, 0, 4)
    with pytest.raises(ValueError, match="n_microbatches=0 must be an int >= 1"):
        pipeline.schedule_actions("1f1b", 2, 0, 0)


# ---------------------------------------------------------------- stage params


def test_stage_params_split_the_tree_with_global_names():
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    parts = [pipeline.stage_params(params, model, fake_layout(3, s)) for s in range(3)]
    assert sorted(parts[0]) == ["embed", "layers"] and sorted(parts[0]["layers"]) == ["0", "1"]
    assert sorted(parts[1]) == ["layers"] and sorted(parts[1]["layers"]) == ["2"]
    assert sorted(parts[2]) == ["head", "layers", "norm"] and sorted(parts[2]["layers"]) == ["3"]
    assert sorted(p for part in parts for p in ft.tree.paths(part)) == sorted(ft.tree.paths(params))
    assert parts[1]["layers"]["2"]["attn"]["wq"] is params["layers"]["2"]["attn"]["wq"]
    axes = pipeline.stage_params(model.param_axes, model, fake_layout(3, 2))  # any tree shaped like params
    assert axes["head"] == model.param_axes["head"]
    assert pipeline.stage_params(params, model, fake_layout(1, 0)) == params


def test_pp_refuses_tied_embeddings_and_families_without_stages():
    tied = llama.model(tiny_llama(tie_embeddings=True))
    with pytest.raises(ValueError, match="llama.Config.tie_embeddings=True.*tie_embeddings=False or pp=1"):
        pipeline.stage_params(tied.init(ft.random.key(0)), tied, fake_layout(2, 0))
    moe_cfg = qwen3_moe.Config(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                               n_experts=4, top_k=2, expert_dim=32, ffn_dim=64, max_seq_len=32)  # fmt: skip
    moe = qwen3_moe.model(moe_cfg)
    assert moe.stage is not None  # the MoE families run staged too
    unstaged = moe._replace(stage=None)  # a family without a `stage` function
    with pytest.raises(ValueError, match="qwen3_moe Model has no `stage` function.*pp=1"):
        pipeline.stage_params(moe.init(ft.random.key(0)), unstaged, fake_layout(2, 0))
    with pytest.raises(ValueError, match="qwen3_moe Model has no `stage`"):
        pipeline.pipeline_grad(unstaged, fake_layout(2, 0))


# ---------------------------------------------------------------- Model.stage


def qwen3_untied() -> qwen3.Config:
    return qwen3.Config(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                        max_seq_len=64, tie_embeddings=False)  # fmt: skip


@pytest.mark.parametrize("make", [lambda: llama.model(tiny_llama()), lambda: qwen3.model(qwen3_untied())])
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_stages_compose_to_apply_exactly(make, pp):
    model = make()
    params = model.init(ft.random.key(0))
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    want, _ = model.apply(params, tokens, logits=False)
    x = tokens
    for s in range(pp):
        part = pipeline.stage_params(params, model, fake_layout(pp, s))
        layers = pipeline.stage_layers(model.config.n_layers, pp, s)
        x, stats, _ = model.stage(part, x, layers=layers, first=s == 0, last=s == pp - 1)
        assert stats == {}  # dense stages have no router statistics
    torch.testing.assert_close(x, want, rtol=0, atol=0)  # the same ops in the same order: bitwise


def tiny_moe(family: str):
    if family == "qwen3_moe":
        return qwen3_moe.model(qwen3_moe.Config(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
                                                head_dim=16, n_experts=4, top_k=2, expert_dim=32, ffn_dim=64,
                                                max_seq_len=64, dense_layers=(1,), aux_loss_coef=0.1))  # fmt: skip
    return deepseek_v3.model(deepseek_v3.Config(
        vocab_size=256, dim=64, n_layers=3, n_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, ffn_dim=128, n_dense_layers=1, n_experts=8, top_k=2, moe_ffn_dim=32,
        n_shared_experts=1, n_groups=2, topk_groups=1, aux_loss_coef=0.1, max_seq_len=64,
    ))  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_moe_stages_compose_to_apply_with_aux_exactly(family, pp):
    model = tiny_moe(family)
    params = model.init(ft.random.key(0))
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    want, _, want_aux = model.apply_with_aux(params, tokens, logits=False)
    x, every = tokens, {}
    for s in range(pp):
        part = pipeline.stage_params(params, model, fake_layout(pp, s))
        layers = pipeline.stage_layers(model.config.n_layers, pp, s)
        x, stats, _ = model.stage(part, x, layers=layers, first=s == 0, last=s == pp - 1)
        assert set(stats) <= set(layers)  # keyed by global layer index, the stage's own MoE layers
        every.update(stats)
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    moe_layers = [i for i in range(3) if "moe" in params["layers"][str(i)]]
    assert sorted(every) == moe_layers  # the dense layer reports nothing
    aux = moe_.moe_aux([every[i] for i in moe_layers], model.config.moe)
    for key in ("loss", "moe.tokens_per_expert", "moe.max_load"):
        torch.testing.assert_close(aux[key], want_aux[key], rtol=0, atol=0)


def test_deepseek_update_buffers_on_a_stage_moves_only_its_biases():
    model = tiny_moe("deepseek_v3")
    params = model.init(ft.random.key(0))
    part = pipeline.stage_params(params, model, fake_layout(2, 1))  # layers 2 (MoE); layer 1 is on stage 0
    load = torch.tensor([[8.0, 0, 0, 0, 0, 0, 0, 0], [0, 8.0, 0, 0, 0, 0, 0, 0]])  # (L_moe, E): rows for 1, 2
    new = model.update_buffers(part, {"moe.tokens_per_expert": load})
    assert sorted(new["layers"]) == ["2"]
    bias = new["layers"]["2"]["moe"]["router_bias"]
    assert bias[1] < 0 and bias[0] > 0  # layer 2 read row 1 of the whole model's load


def test_stage_with_positions_matches_apply():
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(5, 13)
    want, _ = model.apply(params, tokens, positions=positions, logits=False)
    h, _, _ = model.stage(params, tokens, layers=range(2), first=True, last=False, positions=positions)
    h, _, _ = model.stage(params, h, layers=range(2, 4), first=False, last=True, positions=positions)
    torch.testing.assert_close(h, want, rtol=0, atol=0)


def test_later_stage_refuses_tokens():
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    with pytest.raises(ValueError, match=r"later stage's input must be hidden states \(B, T, D\)"):
        model.stage(params, torch.zeros(2, 8, dtype=torch.long), layers=range(2, 4), first=False, last=True)
