"""ftitan's cache root: the user's cache directory (XDG), ``FTITAN_CACHE_DIR`` first; never the checkout."""

import os
from pathlib import Path

import pytest

import ftitan
from ftitan import _cache
from ftitan.vllm import _env  # only the env defaults: importing this does not import vLLM

ROOT = Path(__file__).resolve().parents[1]
VARS = ("FTITAN_CACHE_DIR", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT")


@pytest.fixture
def clean_env(monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_tests_keep_caches_in_the_repo():
    assert _cache.cache_root() == ROOT / ".cache"  # tests/conftest.py sets FTITAN_CACHE_DIR
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(ROOT / ".cache")


def test_installed_defaults_are_under_xdg_cache_home(clean_env, tmp_path):
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path))
    clean_env.chdir(ROOT)  # even from inside the checkout
    assert _cache.cache_root() == tmp_path / "ftitan"
    _env.set_defaults()  # what ftitan.vllm runs before importing vLLM (it also runs ftitan._cache's)
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "ftitan" / "vllm")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ftitan" / "inductor")
    package = Path(ftitan.__file__).parent
    for var in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        assert not Path(os.environ[var]).is_relative_to(package) and not Path(os.environ[var]).is_relative_to(ROOT)


def test_home_fallback_and_override(clean_env, tmp_path):
    clean_env.setenv("HOME", str(tmp_path / "home"))
    assert _cache.cache_root() == tmp_path / "home" / ".cache" / "ftitan"
    clean_env.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored, as the XDG spec says
    assert _cache.cache_root() == tmp_path / "home" / ".cache" / "ftitan"
    clean_env.setenv("FTITAN_CACHE_DIR", str(tmp_path / "mine"))
    assert _cache.cache_root() == tmp_path / "mine"
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))  # a variable the user set wins
    assert _cache.set_defaults() == tmp_path / "mine"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "theirs")
