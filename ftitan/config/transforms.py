"""Model-config transforms: plain functions ``Config -> Config`` over any family's config.

Each ``with_*(value)`` returns a transform; ``compose`` chains them left to
right, so a recipe reads as a list of edits to a published flavor:

>>> from ftitan.models import llama
>>> small = compose(with_layers(2), with_vocab(4096))(llama.Config.debug())
>>> small.n_layers, small.vocab_size
(2, 4096)

A transform that makes the model invalid raises ``ValueError`` naming the
CLI flag (``--model.dim``), not just the attrs field.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs

__all__ = [
    "ModelTransform",
    "batch_invariant",
    "compose",
    "model_error",
    "with_attn_impl",
    "with_dim",
    "with_float8",
    "with_kernels",
    "with_layers",
    "with_max_seq_len",
    "with_model_fields",
    "with_remat",
    "with_vocab",
]

ModelTransform = Callable[[Any], Any]  # a family Config -> the same family's Config

# family config messages look like "llama.Config.dim=..." or "qwen3_moe.Config: dim=..."
_MODEL_FIELD = re.compile(r"\w+\.Config(?:\.|: )(\w+)=")


def model_error(err: ValueError) -> ValueError:
    """Re-word a family ``Config`` construction error so it names the CLI flag ``--model.<field>``."""
    msg = str(err)
    m = _MODEL_FIELD.search(msg)
    field = f"--model.{m.group(1).replace('_', '-')}" if m else "--model"
    return ValueError(f"{field}: {msg}")


def with_model_fields(**changes: Any) -> ModelTransform:
    """Transform setting arbitrary config fields (the model re-checks itself)."""

    def transform(cfg: Any) -> Any:
        try:
            return attrs.evolve(cfg, **changes)
        except ValueError as e:
            raise model_error(e) from e

    return transform


def with_layers(n: int) -> ModelTransform:
    """Transform setting the number of decoder blocks."""
    return with_model_fields(n_layers=n)


def with_vocab(v: int) -> ModelTransform:
    """Transform setting the vocabulary size (keep ``data.vocab_size`` equal)."""
    return with_model_fields(vocab_size=v)


def with_dim(d: int, *, ffn_dim: int | None = None) -> ModelTransform:
    """Transform setting the model width; ``ffn_dim`` defaults to ``3 * d`` (as the debug model)."""
    return with_model_fields(dim=d, ffn_dim=3 * d if ffn_dim is None else ffn_dim)


def with_max_seq_len(n: int) -> ModelTransform:
    """Transform setting the longest sequence the model is meant for."""
    return with_model_fields(max_seq_len=n)


def with_attn_impl(impl: str) -> ModelTransform:
    """Transform choosing the attention kernel (``ftitan.nn.attention``): "sdpa", "math", "flex", "gemm" (causal
    query blocks as GEMMs on the CPU), "auto", or "batch_invariant" (see :func:`batch_invariant`)."""
    return with_model_fields(attn_impl=impl)


def with_kernels(name: str) -> ModelTransform:
    """Transform choosing the model's kernels: "torch" (plain ops), "triton" (``ftitan.kernels``: RMSNorm,
    SwiGLU, RoPE, ... as Triton kernels on CUDA, their references elsewhere; on the CPU the linear layers' and
    the gemm attention's float32 GEMMs in MKL or oneDNN, the fastest per shape, ``ftitan.kernels.onednn``;
    docs/kernels.md) or "helion" (Helion's kernels where ftitan has one, Triton's otherwise)."""
    from ftitan.kernels.op import check_kernels

    check_kernels(name, "--kernels")
    return with_model_fields(kernels=name)


def with_float8(recipe: str) -> ModelTransform:
    """Transform choosing FP8 training of the blocks' projections: "tensorwise" or "rowwise" (torchao's float8
    recipes, ``ftitan.nn.float8``: float8 GEMMs on CUDA with compute capability 8.9+, torchao's emulation
    elsewhere), "" for none. For llama, qwen3, qwen3_moe and deepseek_v3 (Kimi K2) configs; the config
    validates it (a known recipe, projection widths multiples of 16, not batch-invariant)."""
    from ftitan.nn.float8 import check_recipe

    check_recipe(recipe, "--float8")

    def transform(cfg: Any) -> Any:
        if not hasattr(cfg, "float8"):
            if not recipe:  # none asked for: nothing to set
                return cfg
            name = f"{type(cfg).__module__}.{type(cfg).__qualname__}"
            raise ValueError(f"--float8={recipe!r}: {name} has no float8 projections yet (llama, qwen3, qwen3_moe "
                             "and deepseek_v3 configs have); drop --float8")  # fmt: skip
        return with_model_fields(float8=recipe)(cfg)

    return transform


def with_remat(policy: str) -> ModelTransform:
    """Transform choosing the activation rematerialization of every block (``ftitan.train.remat``): "none",
    "full", "save-matmuls", "regions:attn" or "budget:F" (0 < F < 1). Checked here, naming ``--model.remat``."""
    from ftitan.train.remat import check_policy

    return with_model_fields(remat=check_policy(policy, field="--model.remat"))


def batch_invariant(cfg: Any) -> Any:
    """``cfg`` in the batch-invariant mode (``attn_impl="batch_invariant"``): every matmul, norm, softmax,
    attention and MoE routing/combination of the model, its output head and the log-probs of
    ``ftitan.infer.generate`` and ``ftitan.rl.token_logprobs_and_entropy`` reduce in an order that does
    not depend on batch size, padding, prefill vs decode or the KV length (``ftitan.nn.invariant``), so
    the generator's log-prob of a sampled token equals the trainer's recomputation bit for bit.
    A transform itself (``compose(with_layers(2), batch_invariant)``); slower than the default ops.

    >>> from ftitan.models import llama
    >>> batch_invariant(llama.Config.debug()).attn_impl
    'batch_invariant'
    """
    return with_attn_impl("batch_invariant")(cfg)


def compose(*fns: ModelTransform) -> ModelTransform:
    """Chain transforms, applied left to right; ``compose()`` is the identity."""

    def transform(cfg: Any) -> Any:
        for fn in fns:
            cfg = fn(cfg)
        return cfg

    return transform
