import attrs
import pytest

from ftitan import config
from ftitan.config import recipes
from ftitan.models import llama


@pytest.mark.parametrize("name", sorted(config.RECIPES))
def test_every_recipe_builds_and_validates(name, monkeypatch):
    cfg = config.get_recipe(name)
    assert isinstance(cfg, config.TrainConfig)
    assert cfg.recipe == name
    monkeypatch.setenv("WORLD_SIZE", str(cfg.parallel.world_size))  # as torchrun --nproc-per-node N sets it
    assert config.validate(cfg) is cfg
    assert cfg.model.vocab_size == cfg.data.vocab_size


def test_registry_has_the_promised_recipes_and_is_read_only():
    assert {"llama3-debug", "llama3-debug-muon", "llama3-1b", "llama3-8b"} <= set(config.RECIPES)
    with pytest.raises(TypeError):
        config.RECIPES["x"] = recipes.llama3_debug  # type: ignore[index]


def test_debug_recipe_values():
    cfg = config.get_recipe("llama3-debug")
    m = cfg.model
    assert (m.vocab_size, m.dim, m.n_layers) == (2048, 256, 4)
    assert (cfg.data.vocab_size, cfg.data.seq_len, cfg.data.batch_size) == (2048, 256, 8)
    assert (cfg.optim.name, cfg.optim.lr) == ("adamw", 3e-3)
    assert (cfg.steps, cfg.eval_every, cfg.ckpt_every) == (250, 50, 100)


def test_muon_recipe_is_debug_but_for_the_optimizer():
    debug, muon = config.get_recipe("llama3-debug"), config.get_recipe("llama3-debug-muon")
    assert muon.optim.name == "muon"
    assert attrs.evolve(muon, recipe=debug.recipe, optim=debug.optim) == debug


def test_published_recipes_use_the_flavors():
    assert config.get_recipe("llama3-1b").model == llama.Config.llama3_2_1b()
    assert config.get_recipe("llama3-8b").model == llama.Config.llama3_1_8b()


def test_unknown_recipe_lists_known_ones_and_a_close_match():
    with pytest.raises(ValueError, match="known recipes") as e:
        config.get_recipe("llama3-debg")
    msg = str(e.value)
    assert all(name in msg for name in config.RECIPES)
    assert "did you mean 'llama3-debug'" in msg


def test_recipe_decorator_registers_and_stamps_the_name():
    @config.recipe("test-only-debug-long")
    def debug_long():
        return attrs.evolve(recipes.llama3_debug(), steps=1000)

    try:
        assert config.get_recipe("test-only-debug-long").recipe == "test-only-debug-long"
        assert debug_long().steps == 1000
        with pytest.raises(ValueError, match="already registered"):
            config.recipe("test-only-debug-long")(debug_long)
    finally:
        recipes._REGISTRY.pop("test-only-debug-long")


def test_configs_are_hashable():
    assert len({config.get_recipe(n) for n in config.RECIPES}) == len(config.RECIPES)
