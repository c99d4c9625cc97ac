"""``--checkpoint.*``: parsed into ``TrainConfig.checkpoint``, checked with one-line errors, kept in config.json."""

import attrs
import pytest

from ftitan.config import parse_train_args
from ftitan.config.io import config_from_dict, config_to_dict


def test_flags_parse_and_round_trip_through_config_json(tmp_path):
    cfg = parse_train_args(["--checkpoint.backend", "dcp", "--checkpoint.commit-timeout", "30",
                            "--run-dir", str(tmp_path)])  # fmt: skip
    assert cfg.checkpoint.backend == "dcp" and cfg.checkpoint.commit_timeout == 30.0
    assert config_from_dict(config_to_dict(cfg)) == cfg
    old = config_to_dict(cfg)
    del old["checkpoint"]  # a config.json from before the section existed: the defaults
    assert config_from_dict(old).checkpoint.backend == "torch-checkpointing"


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--checkpoint.backend", "tape"], r"^--checkpoint.backend='tape': expected one of \('torch-checkpointing'"),
        (["--checkpoint.commit-timeout", "0"], r"^--checkpoint.commit-timeout=0.0: .* must be > 0$"),
    ],
)
def test_bad_values_name_the_flag(tmp_path, flags, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_train_args([*flags, "--run-dir", str(tmp_path)])
    assert "\n" not in str(e.value)


def test_a_missing_torch_checkpointing_says_how_to_get_it(tmp_path, monkeypatch):
    import importlib.util

    from ftitan.config.validate import validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_checkpointing" else real(name, *a))  # fmt: skip
    cfg = parse_train_args(["--checkpoint.backend", "sync", "--run-dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"pip install torch-checkpointing==0.1.1, or use --checkpoint.backend dcp"):
        validate(attrs.evolve(cfg, checkpoint=attrs.evolve(cfg.checkpoint, backend="torch-checkpointing")))
