"""Build a vLLM engine on ftitan weights, and push new weights into a running one.

>>> import ftitan as ft, ftitan.vllm
>>> llm = ft.vllm.engine((model, params), dtype="float32")                  # doctest: +SKIP
>>> out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], vllm.SamplingParams(max_tokens=8))  # doctest: +SKIP
>>> ft.vllm.push_weights(llm, new_params)   # RL: after each optimizer step  # doctest: +SKIP

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager, with an explicit
KV-cache size; the model inside is ``ftitan.vllm.model.FtitanForCausalLM``, i.e. the family's own
pure ``apply``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ftitan import tree
from ftitan.models import hf
from ftitan.nn import invariant as nn_invariant
from ftitan.models.base import Model
from ftitan.vllm._env import cache_root, import_vllm
from ftitan.vllm._families import check_supported

if TYPE_CHECKING:
    import vllm

__all__ = ["Source", "close", "engine", "export_hf", "push_weights"]

# an HF-format directory (hf.save_hf), an ftitan run directory, or (model, params)
Source = str | os.PathLike[str] | tuple[Model, tree.Tree]


def _has_weights(d: Path) -> bool:
    weights = (d / hf.WEIGHTS_FILE).is_file() or (d / hf.WEIGHTS_INDEX_FILE).is_file()
    return weights and (d / hf.CONFIG_FILE).is_file()


def _new_export_dir() -> Path:
    parent = cache_root() / "vllm" / "exports"
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="ftitan-", dir=parent))


def _export_run(run_dir: Path, out: Path) -> None:
    from ftitan.data.tokenizer import EOS, TOKENIZER_FILE
    from ftitan.train.trainer import load_run  # the trainer imports data/optim: only when a run is given

    _, model, params, tok, _ = load_run(run_dir)
    hf.save_hf(params, model.config, out)
    # the run's byte-level BPE as a transformers fast tokenizer: vLLM then takes text and detokenizes
    tok.hf.save(str(out / TOKENIZER_FILE))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS,
                        "clean_up_tokenization_spaces": False}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    config = {**json.loads((out / hf.CONFIG_FILE).read_text()), "eos_token_id": tok.eos_id}  # vLLM stops there
    (out / hf.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_hf(source: Source) -> tuple[Path, Callable[[], None] | None]:
    """``(directory, cleanup)``: an HF-format directory vLLM can load for ``source``.

    An HF directory (``config.json`` + safetensors) is used as is (``cleanup`` None). A run
    directory (``ftitan train``'s, with ``checkpoints/``; its newest checkpoint, plus its tokenizer)
    and ``(model, params)`` are written to a fresh folder under ``<cache>/vllm/exports``;
    ``cleanup()`` deletes it.
    """
    if isinstance(source, tuple) and not isinstance(source, Model) and len(source) == 2:
        model, params = source
        if not isinstance(model, Model):
            raise TypeError(f"ftitan.vllm.engine: expected (model, params), got ({type(model).__name__}, ...)")
        out = _new_export_dir()
        hf.save_hf(params, model.config, out)
        return out, lambda: shutil.rmtree(out, ignore_errors=True)
    if not isinstance(source, str | os.PathLike):
        raise TypeError(
            f"ftitan.vllm.engine: source must be a directory or (model, params), got {type(source).__name__}"
        )
    d = Path(source)
    if (d / "checkpoints").is_dir():
        out = _new_export_dir()
        _export_run(d, out)
        return out, lambda: shutil.rmtree(out, ignore_errors=True)
    if _has_weights(d):
        return d, None
    raise FileNotFoundError(
        f"ftitan.vllm.engine: {d} is neither an HF model directory ({hf.CONFIG_FILE} + {hf.WEIGHTS_FILE}, "
        "as hf.save_hf writes) nor an ftitan run directory (with checkpoints/)"
    )


class _DropTokenizerWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Chat template warmup failed"


@contextlib.contextmanager
def _quiet_tokenizer_warmup() -> Iterator[None]:
    """vLLM 0.32 warms up a chat template even with ``skip_tokenizer_init=True`` and logs the failure
    with a full traceback; drop that one record while the engine starts."""
    logger, drop = logging.getLogger("vllm.renderers.base"), _DropTokenizerWarmup()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def engine(
    source: Source,
    *,
    dtype: str | torch.dtype = "auto",  # "auto": the checkpoint's (config.json "dtype"); "float32", ...
    kv_cache_bytes: int | None = 256 << 20,  # KV cache size; None: VLLM_CPU_KVCACHE_SPACE (GiB) decides
    max_model_len: int | None = None,  # longest prompt + completion; None: the config's max_seq_len
    seed: int = 0,  # vLLM's sampling seed for requests without their own
    enforce_eager: bool = True,  # no torch.compile / graph capture: starts in seconds
    batch_invariant: bool | None = None,  # None: as a (model, params) source's config says, else False
    **llm_kwargs: Any,  # anything else vllm.LLM takes (they win over the above)
) -> vllm.LLM:
    """A ``vllm.LLM`` running ``source`` (see :func:`export_hf`) through the ftitan model class.

    Prompts are token ids (``{"prompt_token_ids": [...]}``) unless the directory has a tokenizer
    (run directories bring theirs). Raises ValueError for a family vLLM cannot run or a head_dim
    vLLM's CPU attention has no kernel for, before starting anything.

    ``batch_invariant`` (default: a ``(model, params)`` source in ``ftitan.config.batch_invariant``'s
    mode): the model runs ftitan's batch-invariant ops, attention included (``InvariantPagedAttention``),
    and the engine reports each sampled token's log-prob as the trainer computes it
    (``logprobs_mode="raw_logits"`` over the model's invariant log-softmax): bit-equal to
    ``ftitan.rl.token_logprobs_and_entropy`` of the same model in the mode.
    """
    if batch_invariant is None:
        batch_invariant = isinstance(source, tuple) and len(source) == 2 and nn_invariant.enabled(
            getattr(source[0], "config", None))  # fmt: skip
    directory, cleanup = export_hf(source)
    try:
        cfg = hf.config_from_hf(json.loads((directory / hf.CONFIG_FILE).read_text()))
        vllm = import_vllm()
        from vllm.platforms import current_platform

        from ftitan.vllm.model import register

        arch = check_supported(cfg, cpu=current_platform.is_cpu())
        register()
        has_tokenizer = (directory / "tokenizer_config.json").is_file()
        kwargs: dict[str, Any] = dict(
            model=str(directory), hf_overrides={"architectures": [arch]}, skip_tokenizer_init=not has_tokenizer,
            dtype=dtype, seed=seed, enforce_eager=enforce_eager, max_model_len=max_model_len,
        )  # fmt: skip
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        if batch_invariant:
            from ftitan.vllm.model import ATTN_IMPL_KEY

            kwargs["hf_overrides"] = {**kwargs["hf_overrides"], ATTN_IMPL_KEY: nn_invariant.IMPL}
            kwargs["logprobs_mode"] = "raw_logits"  # compute_logits returns the invariant log-probs
        with _quiet_tokenizer_warmup():
            llm = vllm.LLM(**{**kwargs, **llm_kwargs})
    except BaseException:
        if cleanup is not None:
            cleanup()
        raise
    if cleanup is not None:
        weakref.finalize(llm, cleanup)  # vLLM may reread the directory (reload from disk) while it lives
    return llm


def push_weights(llm: vllm.LLM, params: tree.Tree) -> None:
    """Copy a ftitan params tree into a running in-process engine's model, then reset its prefix cache.

    The copy goes straight into the model's parameters (``llm.apply_model``; dtype converted), so
    the next request runs the new weights; cached prefixes computed with the old weights are
    dropped (``llm.reset_prefix_cache()``), otherwise a prompt of 128+ tokens would reuse stale KV.
    Raises ValueError, copying nothing, unless ``params`` has exactly the engine model's paths and
    shapes; TypeError for an engine not running a ftitan model class.
    """

    def copy(model: Any) -> None:
        if not callable(getattr(model, "copy_params_", None)):
            raise TypeError(
                f"ftitan.vllm.push_weights: the engine runs {type(model).__name__}, not a ftitan model class; "
                "build it with ftitan.vllm.engine"
            )
        model.copy_params_(params)

    llm.apply_model(copy)
    if not llm.reset_prefix_cache():
        raise RuntimeError("ftitan.vllm.push_weights: vLLM refused to reset its prefix cache (requests still running)")


def close(llm: vllm.LLM) -> None:
    """Shut an in-process engine down now: its model, KV cache and vLLM's process-wide distributed
    state go (idempotent; ``llm`` is unusable afterwards).

    In-process engines share that state, set up by the first one alive: build the next engine after
    closing the previous one (a vLLM Qwen3-MoE engine started while a dense one lives fails on its
    missing expert-parallel group, and closing any engine tears the state down under the others).
    """
    llm.llm_engine.engine_core.shutdown()
