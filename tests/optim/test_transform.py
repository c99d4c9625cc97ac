"""Transform composition, multi_transform routing, learning-rate state."""

from __future__ import annotations

import pytest
import torch

import ftitan.optim as fo
from ftitan import tree
from ftitan.optim.multi_transform import resolve_labels

from ._helpers import llama_params


def ones_like(t):
    return tree.map(torch.ones_like, t)


def recording(seen: list, factor: float = 1.0) -> fo.Transform:
    """A transform that records the trees it is given and scales by ``factor``."""

    def init(params):
        seen.append(("init", params))
        return fo.EmptyState()

    def update(grads, state, params=None):
        seen.append(("update", grads, params))
        return tree.map(lambda g: g * factor, grads), state

    return fo.Transform(init, update)


def test_identity_scale_chain():
    params = {"a": torch.ones(2), "b": {"c": torch.ones(3)}}
    opt = fo.chain(fo.identity(), fo.scale(2.0), fo.scale(-3.0))
    state = opt.init(params)
    assert isinstance(state, tuple) and len(state) == 3
    updates, new_state = opt.update(ones_like(params), state, params)
    assert torch.equal(updates["b"]["c"], torch.full((3,), -6.0))
    assert tree.structure(new_state) == tree.structure(state)


def test_chain_checks_state_and_arguments():
    opt = fo.chain(fo.scale(2.0))
    with pytest.raises(ValueError, match="chain of 1 transforms got a state of 2"):
        opt.update({"a": torch.ones(1)}, (fo.EmptyState(), fo.EmptyState()))
    with pytest.raises(TypeError, match="argument 1"):
        fo.chain(fo.scale(1.0), lambda g: g)


def test_apply_updates_rounds_once_in_param_dtype():
    p = {"w": torch.tensor([1.0], dtype=torch.bfloat16)}
    u = {"w": torch.tensor([2**-8 + 2**-17], dtype=torch.float32)}
    out = fo.apply_updates(p, u)["w"]
    assert out.dtype == torch.bfloat16
    # bf16 spacing at 1 is 2^-7: 1 + 2^-8 + 2^-17 is past the halfway point and rounds up;
    # rounding u to bf16 first (2^-8) would land on the tie and round to even, 1.0
    assert out.item() == 1.0 + 2**-7
    assert (p["w"] + u["w"].to(torch.bfloat16)).item() == 1.0
    assert fo.apply_updates(p, {"w": torch.zeros(1, dtype=torch.bfloat16)})["w"].item() == 1.0


def test_add_decayed_weights_mask_and_params_required():
    params = {"w": torch.full((2,), 2.0), "norm": torch.full((2,), 2.0)}
    t = fo.add_decayed_weights(0.5, mask=lambda path, x: path != "norm")
    updates, _ = t.update(ones_like(params), t.init(params), params)
    assert updates["w"].tolist() == [2.0, 2.0] and updates["norm"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="needs params"):
        t.update(ones_like(params), t.init(params))
    with pytest.raises(ValueError, match="weight_decay"):
        fo.add_decayed_weights(-0.1)


def test_multi_transform_routes_flat_dicts():
    params = llama_params()
    seen_m: list = []
    seen_a: list = []
    opt = fo.multi_transform({"muon": recording(seen_m, 2.0), "adamw": recording(seen_a, 3.0)}, fo.muon_labels)
    state = opt.init(params)
    updates, new_state = opt.update(ones_like(params), state, params)
    assert tree.structure(updates) == tree.structure(params)
    # each inner transform saw a flat {dotted path: leaf} dict of just its leaves
    (_, init_m), (_, grads_m, params_m) = seen_m
    assert sorted(init_m) == sorted(grads_m) == sorted(params_m)
    assert "layers.0.attn.wq" in grads_m and "layers.1.moe.w1" in grads_m
    assert set(seen_a[1][1]) == {
        "embed", "head", "norm", "layers.0.attn_norm", "layers.0.mlp_norm", "layers.1.attn_norm",
        "layers.1.mlp_norm", "layers.1.moe.bias",
    }  # fmt: skip
    assert params_m["layers.0.attn.wq"] is params["layers"]["0"]["attn"]["wq"]
    for path, u in zip(tree.paths(updates), tree.leaves(updates), strict=True):
        expected = 3.0 if path in seen_a[1][1] else 2.0
        assert torch.all(u == expected), path
    assert tree.structure(new_state) == tree.structure(state)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_multi_transform_label_forms_agree(compiled):
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    by_leaf = lambda path, x: "m" if x.ndim == 2 else "v"  # noqa: E731
    by_tree = lambda t: tree.map(lambda x: "m" if x.ndim == 2 else "v", t)  # noqa: E731
    explicit = {"w": "m", "b": "v"}
    results = []
    for labels in (by_leaf, by_tree, explicit):
        opt = fo.multi_transform({"m": fo.scale(2.0), "v": fo.scale(5.0)}, labels)
        update = torch.compile(opt.update, fullgraph=True, backend="eager") if compiled else opt.update
        updates, _ = update(ones_like(params), opt.init(params), params)
        results.append((updates["w"][0, 0].item(), updates["b"][0].item()))
    assert results == [(2.0, 5.0)] * 3


def test_multi_transform_unknown_label_names_path_and_labels():
    params = llama_params()
    opt = fo.multi_transform({"muon": fo.identity()}, fo.muon_labels)
    with pytest.raises(ValueError, match=r"embed: label 'adamw' has no transform; known labels are \['muon'\]"):
        opt.init(params)


def test_multi_transform_label_tree_mismatch():
    opt = fo.multi_transform({"a": fo.identity()}, {"x": "a"})
    with pytest.raises(ValueError, match=r"y: not in the labels tree \(it labels \['x'\]\)"):
        opt.init({"x": torch.ones(1), "y": torch.ones(1)})
    with pytest.raises(ValueError, match=r"unlabelled paths \['y'\]"):
        resolve_labels({"x": "a"}, {"x": torch.ones(1), "y": torch.ones(1)})


def test_scale_by_learning_rate_schedule_and_state():
    schedule = fo.linear_warmup(1.0, warmup=4)
    t = fo.scale_by_learning_rate(schedule)
    params = {"w": torch.ones(3)}
    state = t.init(params)
    assert state.step.dtype == torch.int64 and state.step.shape == ()
    assert state.lr.dtype == torch.float32 and state.lr.shape == ()
    lrs = []
    for _ in range(6):
        updates, state = t.update(ones_like(params), state)
        lrs.append(state.lr.item())
        assert torch.equal(updates["w"], -state.lr.expand(3))
    assert lrs == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert state.step.item() == 6


def test_float_lr_scales_float64_exactly():
    t = fo.scale_by_learning_rate(0.1)
    g = {"w": torch.ones(1, dtype=torch.float64)}
    updates, state = t.update(g, t.init(g))
    assert updates["w"].item() == -0.1  # a float32 lr tensor would give -0.10000000149
    assert state.lr.dtype == torch.float64  # the lr of float64 params is stored exactly
    assert t.init({"w": torch.ones(1)}).lr.dtype == torch.float32


def test_float_lr_is_read_from_the_state():
    """A float lr lives in the state and the update reads it there: setting it to 0 stops the params,
    and what the state reports is what was applied."""
    opt = fo.sgd(0.5)
    params = {"w": torch.ones(2)}
    state = opt.init(params)
    assert fo.current_lr(state).item() == 0.5
    state = state[:2] + (state[2]._replace(lr=torch.zeros(())),)
    updates, state = opt.update(ones_like(params), state, params)
    assert torch.equal(updates["w"], torch.zeros(2)) and fo.current_lr(state).item() == 0.0
    state = state[:2] + (state[2]._replace(lr=torch.tensor(0.25)),)
    updates, state = opt.update(ones_like(params), state, params)
    assert updates["w"].tolist() == [-0.25, -0.25] and fo.current_lr(state).item() == 0.25


def test_current_lr_in_nested_states():
    params = llama_params()
    opt = fo.chain(
        fo.clip_by_global_norm(1.0),
        fo.muon_with_adamw(params, lr=fo.constant(0.02), adamw_lr=fo.linear_warmup(1e-3, warmup=2)),
    )
    state = opt.init(params)
    for _ in range(2):
        _, state = opt.update(ones_like(params), state, params)
    assert fo.current_lr(state, "muon").item() == pytest.approx(0.02)
    assert fo.current_lr(state, "adamw").item() == pytest.approx(5e-4)  # lr at step 1 of 2 warmup
    assert len(fo.learning_rates(state)) == 2
    single = fo.sgd(0.5)
    assert fo.current_lr(single.init(params)).item() == 0.5
    with pytest.raises(ValueError, match="no scale_by_learning_rate state under label 'nope'"):
        fo.current_lr(state, "nope")
    with pytest.raises(ValueError, match="no scale_by_learning_rate state"):
        fo.current_lr(fo.clip_by_global_norm(1.0).init(params))
