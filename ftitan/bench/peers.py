"""Peer training steps for the step benchmark: Hugging Face and TorchTitan Llama.

Each ``*_step`` function builds a peer model from the shared benchmark config
and returns a :class:`PeerStep`: a zero-argument callable doing one full
forward + backward + ``torch.optim.AdamW`` step on a fixed random batch and
returning the loss as a float.

The shared config is a plain dict::

    {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
     "seq_len", "batch_size", "rope_theta"}      # optional: "norm_eps" (1e-5)

Both peers see ``batch_size * seq_len`` input tokens per step and compute a
mean next-token cross-entropy; both are fp32, untied embeddings, no biases,
RMSNorm eps 1e-5, SwiGLU with hidden size ``ffn_dim``, RoPE with
``rope_theta`` and no RoPE scaling, causal SDPA attention with GQA. Both have
the same parameter count for the same config.

``transformers`` is imported lazily (dev/bench extras); ``torchtitan`` only by
:func:`torchtitan_llama_step` / :func:`build_torchtitan_llama` (bench extra).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "CONFIG_KEYS",
    "CORE_CONFIG",
    "PeerStep",
    "build_hf_llama",
    "build_torchtitan_llama",
    "hf_llama_step",
    "make_batch",
    "param_count",
    "torchtitan_llama_step",
]

CONFIG_KEYS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "seq_len",
    "batch_size",
    "rope_theta",
)

# The core step-bench config (see FACTS.md, "Anchor figures"). ffn_dim 1536 is
# also what TorchTitan's Llama 3 formula gives for dim 512:
# compute_ffn_hidden_dim(512, multiple_of=256) == 256 * ceil(int(8 * 512 / 3) / 256).
CORE_CONFIG: dict[str, Any] = {
    "vocab_size": 8192,
    "dim": 512,
    "n_layers": 8,
    "n_heads": 8,
    "n_kv_heads": 2,
    "ffn_dim": 1536,
    "seq_len": 256,
    "batch_size": 4,
    "rope_theta": 500000.0,
}

DEFAULT_NORM_EPS = 1e-5
# Optimizer settings shared by every peer (TorchTitan's AdamW defaults apart
# from lr): only the implementation speed matters here, not convergence.
DEFAULT_LR = 1e-4
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
ADAMW_WEIGHT_DECAY = 0.1


def _check_cfg(cfg: Mapping[str, Any]) -> None:
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"benchmark config lacks keys {missing}")
    if cfg["dim"] % cfg["n_heads"]:
        raise ValueError("dim must be divisible by n_heads")
    if cfg["n_heads"] % cfg["n_kv_heads"]:
        raise ValueError("n_heads must be divisible by n_kv_heads")


def param_count(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def make_batch(cfg: Mapping[str, Any], *, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """Fixed random token ids of shape ``(batch_size, seq_len + 1)`` (int64).

    Inputs are ``[:, :-1]`` and next-token labels ``[:, 1:]``; the same
    tensor for the same ``cfg`` and ``seed``.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(
        0, cfg["vocab_size"], (cfg["batch_size"], cfg["seq_len"] + 1), generator=g
    ).to(device)


def _adamw(params, *, lr: float, impl: str) -> torch.optim.AdamW:
    kw: dict[str, Any] = {}
    if impl == "foreach":
        kw["foreach"] = True
    elif impl == "fused":
        kw["fused"] = True
    elif impl == "for-loop":
        kw["foreach"] = False
    elif impl != "default":
        raise ValueError(f"unknown AdamW implementation {impl!r}")
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=ADAMW_BETAS,
        eps=ADAMW_EPS,
        weight_decay=ADAMW_WEIGHT_DECAY,
        **kw,
    )


@dataclasses.dataclass(eq=False)
class PeerStep:
    """One peer's training step: ``step()`` runs fwd+bwd+AdamW, returns loss.

    ``model`` is the uncompiled module (for parameter counts and state),
    ``tokens_per_step`` the number of input tokens per call.
    """

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    tokens_per_step: int
    _step: Callable[[], float] = dataclasses.field(repr=False)

    def __call__(self) -> float:
        return self._step()

    @property
    def n_params(self) -> int:
        return param_count(self.model)


# --------------------------------------------------------------------------
# Hugging Face transformers


def build_hf_llama(cfg: Mapping[str, Any], *, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """``transformers.LlamaForCausalLM`` for ``cfg``: fp32, SDPA, no KV cache, built on ``device``.

    Weights come from HF's own init (normal, std 0.02) under ``seed``.
    """
    _check_cfg(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["dim"],
        intermediate_size=cfg["ffn_dim"],
        num_hidden_layers=cfg["n_layers"],
        num_attention_heads=cfg["n_heads"],
        num_key_value_heads=cfg["n_kv_heads"],
        max_position_embeddings=cfg["seq_len"],
        rms_norm_eps=cfg.get("norm_eps", DEFAULT_NORM_EPS),
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg["rope_theta"])},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
    return model.train()


def hf_llama_step(
    cfg: Mapping[str, Any],
    *,
    compile: bool,
    seed: int = 0,
    lr: float = DEFAULT_LR,
    adamw_impl: str = "default",
    device: str | torch.device = "cpu",
    autocast_dtype: torch.dtype | None = None,
) -> PeerStep:
    """HF ``LlamaForCausalLM`` train step, the way HF users write it.

    ``model(input_ids=x, labels=x).loss`` (HF shifts the labels itself, so the
    loss averages over ``seq_len - 1`` positions per row), ``backward()``,
    ``AdamW.step()``. ``compile=True`` wraps the whole model in
    ``torch.compile`` (inductor; the loss is inside the compiled forward); the
    optimizer stays eager. ``adamw_impl``: "default" (torch's choice: the
    for-loop kernel on CPU tensors), "foreach", "fused" or "for-loop".
    ``autocast_dtype`` (e.g. bf16): mixed precision as HF's Trainer runs it,
    fp32 master weights and the forward under ``torch.autocast``.
    """
    model = build_hf_llama(cfg, seed=seed, device=device)
    opt = _adamw(model.parameters(), lr=lr, impl=adamw_impl)
    fwd = torch.compile(model) if compile else model
    input_ids = make_batch(cfg, seed=seed, device=device)[:, :-1].contiguous()
    device_type = torch.device(device).type

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext():
            loss = fwd(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        opt.step()
        return loss.item()

    return PeerStep(
        name="hf-compiled" if compile else "hf-eager",
        model=model,
        optimizer=opt,
        tokens_per_step=input_ids.numel(),
        _step=step,
    )


# --------------------------------------------------------------------------
# TorchTitan


def build_torchtitan_llama(cfg: Mapping[str, Any], *, seed: int = 0) -> nn.Module:
    """TorchTitan 0.3.0's ``Llama3Model`` for ``cfg`` on CPU, fp32.

    Built like TorchTitan's own Llama 3 flavors (``torchtitan.models.llama3``:
    fused wqkv, depth-scaled init, ``ComplexRoPE``, untied embeddings as in
    the 8B flavor) with three changes: ``hidden_dim = cfg["ffn_dim"]``
    instead of ``compute_ffn_hidden_dim``, RoPE scaling "none" (HF's default
    Llama has none either), and the inner attention swapped to
    ``ScaledDotProductAttention`` (TorchTitan's registry only offers
    flex/varlen for language models; FlexAttention has no CPU backward). With
    SDPA the model is called without positions or masks (causal, one document
    per row). Weights are initialized with TorchTitan's ``init_weights()``
    under ``seed``.
    """
    _check_cfg(cfg)
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    dim, vocab = cfg["dim"], cfg["vocab_size"]
    eps = cfg.get("norm_eps", DEFAULT_NORM_EPS)
    # "flex" only selects the inner-attention config, replaced below; nothing
    # flex is built.
    layers = _build_llama3_layers(
        fuse_qkv=True,
        n_layers=cfg["n_layers"],
        dim=dim,
        n_heads=cfg["n_heads"],
        n_kv_heads=cfg["n_kv_heads"],
        hidden_dim=cfg["ffn_dim"],
        rope=ComplexRoPE.Config(
            dim=dim // cfg["n_heads"],
            max_seq_len=cfg["seq_len"],
            theta=float(cfg["rope_theta"]),
            scaling="none",
        ),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = eps
        layer.ffn_norm.eps = eps
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)
        ),
        layers=layers,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = config.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    # No ``model.to(torch.float32)``: Module.to(dtype) would cast the complex64
    # RoPE cache to real. Parameters are fp32 already (the default dtype).
    for p in model.parameters():
        if p.dtype != torch.float32:
            raise TypeError(f"expected fp32 parameters, got {p.dtype}")
    return model.train()


def torchtitan_llama_step(
    cfg: Mapping[str, Any],
    *,
    compile: bool,
    seed: int = 0,
    lr: float = DEFAULT_LR,
    adamw_impl: str = "default",
) -> PeerStep:
    """TorchTitan Llama 3 train step, as TorchTitan's trainer does it.

    ``logits = model(tokens[:, :-1])``; loss is TorchTitan's
    ``cross_entropy_loss`` (sum over ``seq_len`` positions per row, fp32)
    divided by the token count, i.e. a mean; ``backward()``, ``AdamW.step()``.
    No gradient clipping (neither peer clips).

    ``compile=True`` follows TorchTitan's ``--compile.enable`` with its default
    components ``["model", "loss"]``: each TransformerBlock is compiled
    separately (``block.compile(fullgraph=True)``, as
    ``torchtitan.distributed.compile.apply_compile`` does: the blocks share one
    graph, so compile time stays one block's) and the loss function is
    ``torch.compile``d; embedding, final norm and lm_head stay eager. The
    optimizer stays eager.
    """
    from torchtitan.components.loss import cross_entropy_loss

    model = build_torchtitan_llama(cfg, seed=seed)
    opt = _adamw(model.parameters(), lr=lr, impl=adamw_impl)
    loss_fn: Callable[..., torch.Tensor] = cross_entropy_loss
    if compile:
        for block in model.layers.values():
            block.compile(backend="inductor", fullgraph=True)
        loss_fn = torch.compile(cross_entropy_loss, backend="inductor")
    tokens = make_batch(cfg, seed=seed)
    inputs = tokens[:, :-1].contiguous()
    labels = tokens[:, 1:].contiguous()
    n_tokens = labels.numel()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = loss_fn(logits, labels) / n_tokens
        loss.backward()
        opt.step()
        return loss.item()

    return PeerStep(
        name="torchtitan-compiled" if compile else "torchtitan-eager",
        model=model,
        optimizer=opt,
        tokens_per_step=inputs.numel(),
        _step=step,
    )
