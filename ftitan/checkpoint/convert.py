"""``ftitan convert``: a run directory to an HF model directory, and back.

- :func:`run_to_hf`: the run's newest valid checkpoint as ``model.safetensors`` + ``config.json``
  (what ``transformers``' ``from_pretrained`` loads), with the run's tokenizer files and chat template;
  streamed leaf by leaf from however many ranks' files hold it (``ftitan.models.hf_export``). A LoRA
  run's adapters are merged into the weights, and also written in PEFT's format under ``adapter/``;
- :func:`hf_to_run`: an HF model directory as a run directory at step 0 (``ftitan generate --run``
  reads it), its tokenizer copied along. To fine-tune an HF model on your data, start from it with
  ``ftitan train --init.hf DIR`` (a run dir holds one run: ``--resume`` there must keep its model and data).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ftitan.checkpoint._load import Reader
from ftitan.checkpoint._manifest import read_manifest
from ftitan.checkpoint.run import RunDir, newest_of_run

__all__ = ["ADAPTER_DIR", "TOKENIZER_FILES", "copy_tokenizer_files", "hf_to_run", "run_to_hf"]

# what an HF directory's tokenizer is made of (tokenizer.json is the one that must be there)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")  # fmt: skip


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files ``src`` has into ``dst``; returns their names."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and src.resolve() != dst.resolve():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def run_to_hf(run_dir: str | Path, out: str | Path) -> Path:
    """Write the run's newest valid checkpoint to ``out`` as an HF model directory; returns ``out``."""
    from ftitan.data.tokenizer import EOS
    from ftitan.models.hf_export import save_hf_streamed

    run_dir, out = Path(run_dir), Path(out)
    newest, cfg = newest_of_run(RunDir(run_dir))
    manifest = read_manifest(newest)
    prefix = "state.params." + ("base." if cfg.lora.rank else "")  # a LoRA run: the frozen base, adapters merged
    dtypes = {s.path.removeprefix(prefix): getattr(torch, s.dtype) for s in manifest.leaves if s.path.startswith(prefix)}
    with Reader(manifest, verify=False) as reader:  # latest() verified every file
        read = _merged_reader(reader, cfg) if cfg.lora.rank else (lambda path: reader.read(prefix + path))
        # leaf by leaf, each from the chunks every rank wrote of it: never the whole model at once
        save_hf_streamed(read, cfg.model, out, dtypes=dtypes)
        if cfg.lora.rank:
            _save_adapter(reader, cfg, out / ADAPTER_DIR)
    copied = copy_tokenizer_files(run_dir, out)
    if "tokenizer.json" in copied and "tokenizer_config.json" not in copied:  # the run's own byte-level BPE
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "model_max_length": cfg.model.max_seq_len},
            indent=2) + "\n")  # fmt: skip
    return out


ADAPTER_DIR = "adapter"  # a LoRA run's adapters in PEFT's format, beside the merged model


def _merged_reader(reader: Reader, cfg: Any) -> Callable[[str], torch.Tensor]:
    """``path -> W + (alpha / rank) * B @ A`` for the adapted weights of a LoRA run, ``W`` for the others."""
    from ftitan.train import post

    lcfg = post.model_of(cfg).config
    adapted = set(lcfg.paths)

    def read(path: str) -> torch.Tensor:
        w = reader.read(f"state.params.base.{path}")
        if path not in adapted:
            return w
        a, b = (reader.read(f"state.params.lora.{path}.{x}") for x in "AB")
        return w + (lcfg.scale * (b.float() @ a.float())).to(w.dtype)

    return read


def _save_adapter(reader: Reader, cfg: Any, directory: Path) -> None:
    """The run's adapters as a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    from ftitan import tree
    from ftitan.models import lora
    from ftitan.train import post

    lcfg = post.model_of(cfg).config
    adapters = {p: {x: reader.read(f"state.params.lora.{p}.{x}") for x in "AB"} for p in lcfg.paths}
    lora.save_peft({"lora": tree.from_paths(adapters)}, lcfg, directory)


def hf_to_run(hf_dir: str | Path, out: str | Path, *, seed: int = 0) -> Path:
    """Make ``out`` a run directory holding the HF model of ``hf_dir`` as its step-0 checkpoint."""
    from ftitan import optim, random
    from ftitan.config.io import config_to_dict
    from ftitan.config.schema import DataConfig, InitConfig, TrainConfig
    from ftitan.data.pipeline import loader_state_like
    from ftitan.models import hf, registry
    from ftitan.train.state import init_state

    hf_dir, out = Path(hf_dir), Path(out)
    model_cfg, params = hf.load_hf(hf_dir)
    has_tokenizer = (hf_dir / "tokenizer.json").is_file()
    cfg = TrainConfig(
        recipe="hf-import", model=model_cfg, seed=seed, run_dir=str(out), init=InitConfig(hf=str(hf_dir)),
        data=DataConfig(vocab_size=model_cfg.vocab_size, tokenizer=str(hf_dir) if has_tokenizer else "",
                        seq_len=min(DataConfig().seq_len, model_cfg.max_seq_len)),
    )  # fmt: skip
    model = registry.model_for(model_cfg)
    opt = optim.from_config(cfg.optim, cfg.steps, params, frozen=model.frozen)
    run = RunDir(out)
    cfg_dict = config_to_dict(cfg)
    run.create(cfg_dict)
    copy_tokenizer_files(hf_dir, out)
    state: dict[str, Any] = {"state": init_state(params, opt, rng=random.key(seed)), "loader": loader_state_like(cfg)}
    run.save(0, state, keep=cfg.keep, cfg_dict=cfg_dict)
    return out
