"""``save_hf_streamed`` (leaf by leaf, as ``ftitan convert`` of a sharded run writes) gives the same
files as ``save_hf`` (the whole params at once): per-expert MoE tensors, empty shared experts, tied heads."""

import pytest
import torch
from safetensors.torch import load_file

from ftitan import random, tree
from ftitan.models import deepseek_v3, hf, qwen3, qwen3_moe
from ftitan.models.hf_export import save_hf_streamed


@pytest.mark.parametrize("family", [qwen3, qwen3_moe, deepseek_v3], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_streamed_export_equals_save_hf(tmp_path, family):
    cfg = family.Config.debug()
    params = family.model(cfg).init(random.key(0))
    flat = dict(zip(tree.paths(params), tree.leaves(params), strict=True))
    read = []
    hf.save_hf(params, cfg, tmp_path / "whole")
    save_hf_streamed(lambda p: read.append(p) or flat[p], cfg, tmp_path / "streamed",
                     dtypes={p: x.dtype for p, x in flat.items()})  # fmt: skip
    assert sorted(read) == sorted(flat)  # each leaf read once
    want, got = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "streamed" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert (tmp_path / "whole" / "config.json").read_text() == (tmp_path / "streamed" / "config.json").read_text()
