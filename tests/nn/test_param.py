"""nn.init under torch.func.vmap: a batch of keys gives the stack of single inits, for every family."""

import attrs
import pytest
import torch

from ftitan import random, tree
from ftitan.models import deepseek_v3, llama, qwen3, qwen3_moe

FAMILIES = {"llama": llama, "qwen3": qwen3, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}


def _tiny(family):
    # the debug config with a small vocabulary and 2 layers (deepseek: one dense, one MoE)
    return family.model(attrs.evolve(family.Config.debug(), vocab_size=128, dim=64, n_layers=2))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_vmap_of_model_init_equals_stacked_inits(name):
    model = _tiny(FAMILIES[name])
    keys = random.split(random.key(0), 2)
    batched = torch.func.vmap(model.init)(keys)
    singles = [model.init(k) for k in keys]
    paths, leaves, _ = tree.flatten_with_paths(batched)
    for path, got, *want in zip(paths, leaves, *(tree.leaves(s) for s in singles), strict=True):
        assert torch.equal(got, torch.stack(want)), path
    # the keys differ, so the drawn leaves do too (not a broadcast of one init)
    assert not torch.equal(singles[0]["embed"], singles[1]["embed"])


@pytest.mark.slow
def test_compiled_model_init_equals_eager():
    # ~8 s of aot_eager tracing over every leaf: compiled code can draw, with the same bits
    model = _tiny(llama)
    got = torch.compile(model.init, fullgraph=True, backend="aot_eager")(random.key(4))
    for a, b in zip(tree.leaves(got), tree.leaves(model.init(random.key(4))), strict=True):
        assert torch.equal(a, b)
