"""Training with fused projections (``fuse_projections=True``: ``wqkv``, ``w13``) against the unfused model.

The unfused model is the reference: the same init values stacked, the same logits, gradients that are
the unfused ones stacked (torch.func and autograd), AdamW steps that follow the unfused run, HF
checkpoints with HF's separate names both ways, and the run-config refusals naming the flag.
"""

import attrs
import pytest
import torch

import ftitan as ft
from ftitan import config
from ftitan.models import fused, hf, llama, qwen3
from ftitan.config.schema import ParallelConfig
from ftitan.train.runtime import Runtime

FAMILIES = {"llama": llama, "qwen3": qwen3}


def _cfgs(family, **fields):
    base = attrs.evolve(family.Config.debug(), vocab_size=256, n_layers=2, **fields)
    return base, attrs.evolve(base, fuse_projections=True)


def _stack(tree):
    """The unfused tree's leaves as the fused tree holds them (the reference for a fused tree)."""
    return fused.fuse_projections(tree)


def _assert_trees_close(got, want, atol):
    gp, gl, _ = ft.tree.flatten_with_paths(got)
    wp, wl, _ = ft.tree.flatten_with_paths(want)
    assert gp == wp
    for path, g, w in zip(gp, gl, wl, strict=True):
        torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=path)


@pytest.mark.parametrize("name", FAMILIES)
def test_init_axes_and_logits_are_the_unfused_models(name):
    family = FAMILIES[name]
    cfg, fcfg = _cfgs(family)
    model, fmodel = family.model(cfg), family.model(fcfg)
    params, fparams = model.init(ft.random.key(3)), fmodel.init(ft.random.key(3))
    attn, mlp = fparams["layers"]["0"]["attn"], fparams["layers"]["0"]["mlp"]
    assert "wqkv" in attn and not {"wq", "wk", "wv"} & set(attn)
    assert "w13" in mlp and not {"w1", "w3"} & set(mlp)
    assert torch.equal(attn["wqkv"], torch.cat([params["layers"]["0"]["attn"][k] for k in ("wq", "wk", "wv")]))
    _assert_trees_close(fparams, _stack(params), atol=0)
    # param_axes has the params' structure; the stacked leaves mix heads, so no parallel rule splits them
    axes = dict(_flat_axes(fmodel.param_axes))
    assert set(axes) == set(ft.tree.flatten_with_paths(fparams)[0])
    assert axes["layers.0.attn.wqkv"] == ("fused_qkv", "embed") and axes["layers.1.mlp.w13"] == ("fused_mlp", "embed")
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fmodel.apply(fparams, tokens)[0], model.apply(params, tokens)[0], atol=1e-5, rtol=0)


def _flat_axes(node, prefix=""):
    for k, v in node.items():
        yield from _flat_axes(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]


def _batch(cfg, seed=0):
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(seed))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_gradients_are_the_unfused_gradients_stacked(kernels):
    cfg, fcfg = _cfgs(llama, kernels=kernels)
    model, fmodel = llama.model(cfg), llama.model(fcfg)
    params = model.init(ft.random.key(0))
    batch = _batch(cfg)
    for impl in ("func", "autograd"):  # torch.func.grad, and the train step's autograd path
        vg = ft.train.value_and_grad(ft.train.next_token_loss(model), impl=impl)
        fvg = ft.train.value_and_grad(ft.train.next_token_loss(fmodel), impl=impl)
        grads, (loss, _) = vg(params, batch)
        fgrads, (floss, _) = fvg(_stack(params), batch)
        torch.testing.assert_close(floss, loss, atol=1e-6, rtol=0)
        _assert_trees_close(fgrads, _stack(grads), atol=1e-6)


def test_vmap_of_grad_gives_per_example_gradients_stacked():
    # a JAX user's per-example gradients on the fused tree
    cfg, fcfg = _cfgs(llama)
    model, fmodel = llama.model(cfg), llama.model(fcfg)
    params = model.init(ft.random.key(1))
    batch = _batch(cfg, seed=1)

    def per_example(m):
        loss = ft.train.next_token_loss(m)

        def one(p, inputs, targets):
            return loss(p, {"inputs": inputs[None], "targets": targets[None]})[0]

        return torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))

    want = per_example(model)(params, batch["inputs"], batch["targets"])
    got = per_example(fmodel)(_stack(params), batch["inputs"], batch["targets"])
    for i in range(2):
        _assert_trees_close(ft.tree.map(lambda g, i=i: g[i], got), _stack(ft.tree.map(lambda g, i=i: g[i], want)),
                            atol=1e-6)  # fmt: skip


def test_adamw_steps_follow_the_unfused_run():
    cfg, fcfg = _cfgs(llama)
    opt = ft.optim.adamw(3e-3, weight_decay=0.1)
    runs = {}
    for name, c in (("unfused", cfg), ("fused", fcfg)):
        model = llama.model(c)
        step = ft.train.make_train_step(ft.train.next_token_loss(model), opt, donate=True)
        state = ft.train.init_state(model.init(ft.random.key(2)), opt)
        losses = []
        for _ in range(4):
            state, metrics = step(state, _batch(cfg))  # one batch: the loss must fall
            losses.append(float(metrics["loss"]))
        runs[name] = (losses, state.params)
    assert runs["fused"][0] == pytest.approx(runs["unfused"][0], abs=1e-5)
    assert runs["unfused"][0][-1] < runs["unfused"][0][0] - 0.05  # the steps trained: the comparison means something
    # Adam divides by sqrt(v): where a gradient is ~0, its ulp differences move a weight by up to ~lr a step
    # (one element of 98304 here moved 4e-5); 1e-4 is far below the 4 steps' reach of 4 * lr = 1.2e-2
    _assert_trees_close(runs["fused"][1], _stack(runs["unfused"][1]), atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_checkpoints_keep_the_separate_names(name, tmp_path):
    family = FAMILIES[name]
    cfg, fcfg = _cfgs(family)
    params = family.model(cfg).init(ft.random.key(4))
    fparams = _stack(params)
    state, fstate = hf.to_hf(params, cfg), hf.to_hf(fparams, fcfg)
    assert fstate.keys() == state.keys()
    assert all(torch.equal(fstate[k], state[k]) for k in state)
    _assert_trees_close(hf.from_hf(state, fcfg), fparams, atol=0)
    # a run loading an HF directory into a fused model stacks what it read
    hf.save_hf(params, cfg, tmp_path / "hf")
    loaded = Runtime(None, ParallelConfig()).load_hf(family.model(fcfg), str(tmp_path / "hf"))
    _assert_trees_close(loaded, fparams, atol=0)
    # a checkpoint of another shape is refused naming the stacked leaf and the HF tensor
    k = "model.layers.0.self_attn.k_proj.weight"
    bad = dict(state, **{k: state[k][:-1]})
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wqkv \(from model\.layers\.0\.self_attn\.k_proj\.weight\)"):
        hf.from_hf(bad, fcfg)


def test_config_refusals_name_the_flag(monkeypatch):
    base = config.get_recipe("llama3-debug")
    on = attrs.evolve(base, model=config.with_model_fields(fuse_projections=True)(base.model))
    assert config.validate(on) is on
    with pytest.raises(ValueError, match=r"fuse_projections='yes'"):
        attrs.evolve(base.model, fuse_projections="yes")
    refused = [
        (attrs.evolve(on, optim=attrs.evolve(on.optim, name="muon")), "orthogonalizes"),
        (attrs.evolve(on, lora=attrs.evolve(on.lora, rank=4)), "LoRA"),
        (attrs.evolve(on, rl=attrs.evolve(on.rl, env="add", sft_steps=2)), "RL generator"),
    ]
    for cfg, why in refused:
        with pytest.raises(ValueError, match=rf"--model\.fuse-projections=True: .*{why}"):
            config.validate(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")  # under torchrun: dp, cp and pp run it (tests/parallel), tp does not
    for degrees in (dict(dp_shard=4), dict(dp_shard=2, cp=2)):
        assert config.validate(attrs.evolve(on, parallel=attrs.evolve(on.parallel, **degrees)))
    with pytest.raises(ValueError, match=r"--model\.fuse-projections=True: runs without tensor or expert paral"):
        config.validate(attrs.evolve(on, parallel=attrs.evolve(on.parallel, dp_shard=2, tp=2)))
