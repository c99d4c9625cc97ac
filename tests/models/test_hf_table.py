"""The generic HF table machinery with a toy family whose leaf is split across checkpoint names."""

import attrs
import pytest
import torch

from ftitan import nn, random, tree
from ftitan.models import hf
from ftitan.models.base import Model


@attrs.frozen(kw_only=True)
class ToyConfig:
    dim: int = 4


def toy_model(cfg: ToyConfig) -> Model:
    specs = {"qkv": nn.linear_param(cfg.dim, 3 * cfg.dim, axes=("heads", "embed")), "norm": nn.norm_param(cfg.dim)}
    return Model(
        config=cfg,
        init=lambda key, *, dtype=torch.float32, device=None: nn.init(specs, key, dtype=dtype, device=device),
        apply=None,  # type: ignore[arg-type]  # not needed for import/export
        head=lambda params: params["qkv"],
        param_axes=nn.axes(specs),
        flops_per_token=lambda seq_len: 0.0,
    )


def toy_weights(cfg: ToyConfig) -> list[hf.WeightMap]:
    # one fused ftitan leaf <-> three HF tensors
    return [
        hf.WeightMap(
            path="qkv",
            names=("attn.q.weight", "attn.k.weight", "attn.v.weight"),
            to_hf=lambda w: w.chunk(3, dim=0),
            from_hf=lambda ws: torch.cat(tuple(ws), dim=0),
        ),
        hf.WeightMap(path="norm", names=("norm.weight",)),
    ]


TOY = hf.Family(
    name="toy",
    config_type=ToyConfig,
    model_type="ftitan-test-toy",
    model=toy_model,
    weights=toy_weights,
    config_to_hf=lambda cfg: {"model_type": "ftitan-test-toy", "hidden_size": cfg.dim},
    config_from_hf=lambda d: ToyConfig(dim=d["hidden_size"]),
)


@pytest.fixture(autouse=True)
def toy_family():
    # registered only while these tests run: the registry drives other suites (the transform matrix
    # over every family), which a toy without an apply must not join
    hf.register_family(TOY)
    yield
    hf.unregister_family(TOY)


def test_split_and_join_round_trip(tmp_path):
    cfg = ToyConfig()
    params = toy_model(cfg).init(random.key(0))
    state = hf.to_hf(params, cfg)
    assert sorted(state) == ["attn.k.weight", "attn.q.weight", "attn.v.weight", "norm.weight"]
    assert torch.equal(state["attn.k.weight"], params["qkv"][4:8])
    back = hf.from_hf(state, cfg)
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(back), tree.leaves(params), strict=True))
    hf.save_hf(params, cfg, tmp_path)
    cfg2, loaded = hf.load_hf(tmp_path)
    assert cfg2 == cfg and torch.equal(loaded["qkv"], params["qkv"])


def test_table_that_misses_a_leaf_is_reported():
    cfg = ToyConfig()
    broken = attrs.evolve(TOY, weights=lambda c: toy_weights(c)[:1])
    hf.register_family(broken)
    try:
        with pytest.raises(ValueError, match=r"no entry for \[norm\]"):
            hf.to_hf(toy_model(cfg).init(random.key(0)), cfg)
    finally:
        hf.unregister_family(broken)
        hf.register_family(TOY)
