import pytest

from ftitan import config


def test_overrides_land_in_the_right_fields():
    cfg = config.parse_train_args(
        ["--recipe", "llama3-debug", "--model.n-layers", "2", "--optim.lr", "1e-3", "--data.seq-len", "64"]
    )
    base = config.get_recipe("llama3-debug")
    assert (cfg.model.n_layers, cfg.optim.lr, cfg.data.seq_len) == (2, 1e-3, 64)
    assert (cfg.model.dim, cfg.optim.name, cfg.data.batch_size) == (base.model.dim, "adamw", base.data.batch_size)


def test_recipe_flag_forms_and_default():
    assert config.parse_train_args([]).recipe == "llama3-debug"
    assert config.parse_train_args(["--recipe=llama3-debug-muon"]).optim.name == "muon"
    cfg = config.parse_train_args(["--steps", "20", "--recipe", "llama3-debug-muon", "--optim.warmup", "5"])
    assert (cfg.recipe, cfg.optim.name, cfg.steps, cfg.optim.warmup) == ("llama3-debug-muon", "muon", 20, 5)


def test_booleans_take_a_value():
    assert config.parse_train_args(["--compile", "False"]).compile is False
    assert config.parse_train_args(["--model.tie-embeddings", "True"]).model.tie_embeddings is True


def test_nested_rope_scaling_of_published_flavor():
    cfg = config.parse_train_args(["--recipe", "llama3-8b", "--model.rope-scaling.factor", "4"])
    assert cfg.model.rope_scaling.factor == 4.0


def test_unknown_recipe():
    with pytest.raises(ValueError, match="known recipes: .*llama3-debug"):
        config.parse_train_args(["--recipe", "nope"])
    with pytest.raises(ValueError, match="--recipe needs a name"):
        config.parse_train_args(["--recipe"])


def test_unknown_override_exits_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_train_args(["--optim.lrr", "1e-3"])
    assert e.value.code == 2
    err = capsys.readouterr()
    text = err.out + err.err
    assert "--optim.lrr" in text and "--optim.lr" in text


def test_model_rejection_exits_naming_the_field(capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_train_args(["--model.dim", "100"])
    assert e.value.code == 2
    err = capsys.readouterr()
    assert "dim=100" in err.out + err.err


def test_validation_runs_after_overrides():
    with pytest.raises(ValueError, match="--data.vocab-size"):
        config.parse_train_args(["--data.vocab-size", "4096"])


def test_help_lists_fields_with_comments(capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_train_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--data.seq-len" in out and "tokens per training row" in out
    assert "--model.n-layers" in out and "decoder blocks" in out
    assert "llama3-debug-muon" in out  # recipes are listed in the description
