"""Pipeline parallelism without processes: stage splits, stage params, schedules as data, ``Model.stage``."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest
import torch

import ftitan as ft
from ftitan.models import llama, qwen3, qwen3_moe
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
    with pytest.raises(ValueError, match="qwen3_moe Model has no `stage` function.*pp=1"):
        pipeline.stage_params(moe.init(ft.random.key(0)), moe, fake_layout(2, 0))
    with pytest.raises(ValueError, match="qwen3_moe Model has no `stage`"):
        pipeline.pipeline_grad(moe, fake_layout(2, 0))


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
        x = model.stage(part, x, layers=layers, first=s == 0, last=s == pp - 1)
    torch.testing.assert_close(x, want, rtol=0, atol=0)  # the same ops in the same order: bitwise


def test_stage_with_positions_matches_apply():
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(5, 13)
    want, _ = model.apply(params, tokens, positions=positions, logits=False)
    h = model.stage(params, tokens, layers=range(2), first=True, last=False, positions=positions)
    h = model.stage(params, h, layers=range(2, 4), first=False, last=True, positions=positions)
    torch.testing.assert_close(h, want, rtol=0, atol=0)


def test_later_stage_refuses_tokens():
    model = llama.model(tiny_llama())
    params = model.init(ft.random.key(0))
    with pytest.raises(ValueError, match=r"later stage's input must be hidden states \(B, T, D\)"):
        model.stage(params, torch.zeros(2, 8, dtype=torch.long), layers=range(2, 4), first=False, last=True)
