"""Any family's config survives the dict round trip runs and checkpoints use, and builds its own Model."""

import json

import pytest

from ftitan.models import deepseek_v3, llama, qwen3, qwen3_moe, registry

FLAVORS = [(m, name) for m in (llama, qwen3, qwen3_moe, deepseek_v3) for name in m.FLAVORS]


@pytest.mark.parametrize(("module", "flavor"), FLAVORS, ids=[f"{m.__name__.rsplit('.', 1)[1]}-{f}" for m, f in FLAVORS])
def test_config_round_trips_through_json_and_picks_its_family(module, flavor):
    cfg = module.FLAVORS[flavor]()
    d = json.loads(json.dumps(registry.config_to_dict(cfg)))  # what config.json / manifests hold
    assert d["family"] == module.__name__.rsplit(".", 1)[1]
    back = registry.config_from_dict(d)
    assert type(back) is type(cfg) and back == cfg  # nested rope scaling (Llama 3, YaRN) included
    assert registry.model_for(back).config == cfg


def test_dict_without_family_is_read_as_llama_and_unknown_family_is_named():
    d = registry.config_to_dict(llama.Config.debug())
    del d["family"]
    assert registry.config_from_dict(d) == llama.Config.debug()
    with pytest.raises(ValueError, match="'gpt9' is not registered"):
        registry.config_from_dict({"family": "gpt9"})
