"""Tiny fp32 checkpoints of each family and the vLLM engines on them, each built once per session.

An in-process engine starts in ~0.5-2 s once vLLM is imported (~5 s); the first request with
logprobs compiles vLLM's sampler with inductor (~20 s cold, ~4 s with the repo's .cache warm).

(No ``__init__.py`` here: a package named ``vllm`` under tests/ would shadow the real one.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import ftitan as ft
import ftitan.vllm as fv
from ftitan.models import hf, llama, qwen3, qwen3_moe

_SET_NUM_THREADS = torch.set_num_threads  # before any engine replaces it (see `engines`)
KV_BYTES = 64 << 20  # KV cache of every test engine: 32-64k tokens of these models

# head_dim 32 (Llama: 128 // 4) and 64 (Qwen3), GQA 2:1, init_std 0.1 so logits are far from
# uniform (near-ties would make greedy token parity a coin flip)
CONFIGS = {
    "llama": llama.Config(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256,
                          max_seq_len=512, init_std=0.1),
    "qwen3": qwen3.Config(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256,
                          max_seq_len=512, tie_embeddings=True, init_std=0.1),
    "qwen3_moe": qwen3_moe.Config(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                                  n_experts=4, top_k=2, expert_dim=64, ffn_dim=256, max_seq_len=512, init_std=0.1),
}  # fmt: skip


class Tiny(NamedTuple):
    cfg: Any
    model: ft.models.Model
    params: Any
    directory: Path  # hf.save_hf of params


def perturbed_norms(params: Any, key: torch.Tensor) -> Any:
    """``params`` with every norm scale multiplied by ``1 + 0.3 * noise`` (init leaves them all ones,
    which would hide a norm applied to the wrong tensor or not loaded at all)."""

    def perturb(path: str, x: torch.Tensor) -> torch.Tensor:
        if "norm" not in path:
            return x
        return x * (1 + 0.3 * ft.random.normal(ft.random.fold_in(key, path), x.shape, dtype=x.dtype))

    return ft.tree.map_with_path(perturb, params)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Tiny]:
    """``tiny(family)``: a random fp32 model with perturbed norms, saved in HF format (cached)."""
    made: dict[str, Tiny] = {}

    def get(family: str) -> Tiny:
        if family not in made:
            cfg = CONFIGS[family]
            model = hf.family_of(cfg).model(cfg)
            params = perturbed_norms(model.init(ft.random.key(1)), ft.random.key(2))
            directory = hf.save_hf(params, cfg, tmp_path_factory.mktemp(family))
            made[family] = Tiny(cfg, model, params, directory)
        return made[family]

    return get


@pytest.fixture(scope="session")
def engines(tiny: Callable[[str], Tiny]) -> Iterator[Callable[..., Any]]:
    """``engines(family, kind)``: ``"ftitan"`` (ftitan.vllm.engine, raw logprobs), ``"processed"`` (the
    same, logprobs after temperature), ``"vllm"`` (vLLM's own implementation of the architecture), or
    ``"sync"`` (``ftitan.vllm.engine((model, params))``, for tests that push weights into it),
    ``"embeds"`` (the ftitan engine taking prompt embeddings too), or
    ``"none"`` (closes the live engine, returns None: for a test that builds its own).

    One engine lives at a time (asking for another closes it): in-process vLLM engines share the
    process's distributed state, which the first one sets up (``ft.vllm.close``). Tests that use
    the same engine are grouped so that it is rebuilt rarely (~1 s a build).
    """
    live: dict[tuple[str, str], Any] = {}

    def get(family: str, kind: str = "ftitan") -> Any:
        if (family, kind) not in live:
            for llm in live.values():
                if llm is not None:
                    fv.close(llm)
            live.clear()
            live[family, kind] = build(tiny(family), kind)
        return live[family, kind]

    yield get
    for llm in live.values():
        if llm is not None:
            fv.close(llm)
    # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op; later tests in this
    # process may need the real one
    torch.set_num_threads = _SET_NUM_THREADS


def build(t: Tiny, kind: str) -> Any:
    if kind == "none":
        return None
    if kind == "sync":
        return fv.engine((t.model, t.params), dtype="float32", kv_cache_bytes=KV_BYTES)
    directory = t.directory
    if kind == "vllm":
        from vllm import LLM

        return LLM(model=str(directory), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                   kv_cache_memory_bytes=KV_BYTES, seed=0)  # fmt: skip
    if kind == "embeds":
        return fv.engine(directory, dtype="float32", kv_cache_bytes=KV_BYTES, enable_prompt_embeds=True)
    mode = {"ftitan": "raw_logprobs", "processed": "processed_logprobs"}[kind]
    return fv.engine(directory, dtype="float32", kv_cache_bytes=KV_BYTES, logprobs_mode=mode)


@pytest.fixture(scope="session")
def make_prompts() -> Callable[..., list[list[int]]]:
    """``make_prompts(vocab, lengths, seed)``: random token-id prompts of the given (ragged) lengths."""

    def make(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]

    return make
