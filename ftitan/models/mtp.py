"""Multi-token prediction (MTP) modules of DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 2.2).

``D`` sequential modules share the main model's embedding and output head.
Module ``k`` (1-based; params ``mtp.{k-1}``) at position ``i`` combines the
previous depth's representation ``h^{k-1}_i`` with the embedding of token
``t_{i+k}`` and predicts ``t_{i+k+1}``::

    h'^k_i = M_k [RMSNorm_e(Emb(t_{i+k})) ; RMSNorm_h(h^{k-1}_i)]        M_k = eh_proj: (D, 2D)
    h^k_{0:T-k} = TRM_k(h'^k_{0:T-k})                                    a causal transformer block
    P^k_{i+k+1} = softmax(head(RMSNorm_k(h^k_i)))                        shared head, the module's own norm
    L_MTP = lambda / D * sum_k CE(P^k, t)

Two choices the paper leaves open follow the published checkpoints and the
engines that run them (vLLM's and SGLang's ``deepseek_mtp``):

- ``M_k``'s input puts the embedding half first (the paper writes
  ``[h ; emb]``; the checkpoints' ``eh_proj`` columns are ``[emb ; h]``).
- ``h^0`` is the main model's final-normed hidden state (what its head
  sees, ``apply(..., logits=False)``); deeper modules take ``h^{k-1}``, the
  previous module's block output before its norm.

How the loss enters training: ``deepseek_v3``'s ``apply_with_aux`` (the
loss ``ftitan.train.next_token_loss`` calls with the inputs only) adds
``mtp_loss_weight * mean_k CE_k`` to ``aux["loss"]``. The MTP targets are
the inputs shifted by ``k + 1``: depth ``k`` scores positions
``0 .. T-k-2``, and the last position of each depth (whose target lies past
the row) is dropped, as is any position whose target is in another packed
document (``segments``). Each ``CE_k`` is the mean over the global batch
(summed over the data axes), so data and expert parallelism give the
single-process loss. The batch's ``targets`` are not seen, so prompt
masking (``IGNORE_INDEX``) applies to the main loss only. This keeps the
loss function and the ``Model`` interface unchanged, at the cost of one
scored position per row and depth.

HF checkpoints (``num_nextn_predict_layers``) store module ``k`` as layer
``n_layers + k``: a decoder layer's names plus ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, and copies of the shared
``embed_tokens`` and ``shared_head.head``. ``transformers`` drops them;
:func:`load_hf` imports them.

Params tree (per module ``k``)::

    "mtp": {"0": {"enorm": (D,), "hnorm": (D,), "eh_proj": (D, 2D), "block": {a MoE block}, "norm": (D,)}, ...}
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ftitan import nn, tree
from ftitan.models import decoder, hf
from ftitan.nn import moe as moe_
from ftitan.nn.attention import Attend
from ftitan.parallel import activations as par
from ftitan.parallel.layout import current

__all__ = ["FROZEN", "Block", "hf_weights", "load_hf", "module_apply", "mtp_losses", "mtp_specs", "update_router_bias"]

FROZEN = "mtp.*.block.moe.router_bias"  # the MTP blocks' balancing bias: state, like the main blocks'

# (block params, x (B, T, D), positions (T,) | (B, T), attention op) -> (B, T, D), MoEStats | None
Block = Callable[[Mapping[str, Any], torch.Tensor, torch.Tensor, Attend], tuple[torch.Tensor, Any]]


def mtp_specs(dim: int, n: int, block: Callable[[], dict[str, Any]], *, std: float) -> dict[str, Any]:
    """Specs of ``n`` MTP modules; ``block()`` gives one transformer block's specs."""
    return {
        str(k): {
            "enorm": nn.norm_param(dim),
            "hnorm": nn.norm_param(dim),
            "eh_proj": nn.linear_param(2 * dim, dim, axes=("embed", None), std=std),
            "block": block(),
            "norm": nn.norm_param(dim),
        }
        for k in range(n)
    }


def module_apply(
    params: Mapping[str, Any],  # the model's params (embed and mtp.{k} are read)
    h_prev: torch.Tensor,  # (B, T, D) h^{k}: the main model's final-normed hidden (k = 0) or module k-1's output
    next_tokens: torch.Tensor,  # (B, T) int: t_{i+k+1} at position i
    *,
    k: int,  # module index (0-based)
    positions: torch.Tensor,  # (T,) | (B, T) int positions of h_prev's tokens
    block: Block,
    norm_eps: float,
    kernels: str = "torch",  # the model's kernels (its norms and eh_proj: nn.rms_norm, nn.linear)
    cache: Any = None,  # a base.AttentionCache; the module's attention is its layer 0
    segments: torch.Tensor | None = None,  # (B, T) int document ids (no cache)
) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:  # h^{k+1} (B, T, D), normed for the head (B, T, D), cache, stats
    """One MTP module over a sequence: ``h = TRM(M [enorm(emb(next)) ; hnorm(h_prev)])`` (see the module
    docstring); returns its block output, the same after the module's norm (``h @ head.T`` are its
    logits for the token after ``next_tokens``), the cache it attended through, and its router stats."""
    p = params["mtp"][str(k)]
    e = nn.rms_norm(par.embed(next_tokens, params["embed"]), p["enorm"], norm_eps, kernels=kernels)
    hn = nn.rms_norm(h_prev, p["hnorm"], norm_eps, kernels=kernels)
    x = nn.linear(torch.cat([e, hn.to(e.dtype)], dim=-1), p["eh_proj"], kernels=kernels)
    attend, written = decoder.layer_attention(cache, 0, segments)
    h, stats = block(p["block"], x, positions, attend)
    return h, nn.rms_norm(h, p["norm"], norm_eps, kernels=kernels), written(), stats


def _targets(tokens: torch.Tensor, k: int, segments: torch.Tensor | None) -> torch.Tensor:  # (B, T - k - 2)
    """Depth ``k + 1``'s targets at positions ``0 .. T-k-2``: ``t_{i+k+2}``; ``IGNORE_INDEX`` where it
    lies in another document than position ``i``."""
    from ftitan.train.losses import IGNORE_INDEX  # ftitan.train imports the models

    t = tokens.shape[1]
    targets = tokens[:, k + 2 :]
    if segments is not None:
        other = segments[:, k + 2 :] != segments[:, : t - k - 2]
        targets = torch.where(other, torch.full_like(targets, IGNORE_INDEX), targets)
    return targets


def mtp_losses(
    params: Mapping[str, Any],
    h: torch.Tensor,  # (B, T, D) the main model's final-normed hidden states
    tokens: torch.Tensor,  # (B, T) int inputs
    block: Block,
    *,
    norm_eps: float,
    kernels: str = "torch",  # the model's kernels (the modules' norms)
    positions: torch.Tensor,  # (T,) | (B, T) int
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows
) -> tuple[list[torch.Tensor], list[Any]]:  # CE_k per module (0-d, mean over its targets), router stats
    """Every module's cross-entropy against the inputs shifted (see the module docstring), chunked
    through the shared head; modules whose rows are too short to score are left out."""
    from ftitan.train.losses import IGNORE_INDEX, cross_entropy  # ftitan.train imports the models

    layout = current()
    if layout is not None and (layout.sizes["cp"] > 1 or layout.tp > 1 or layout.sizes["pp"] > 1):
        raise NotImplementedError(
            f"deepseek_v3: the MTP loss under tp={layout.tp}, cp={layout.sizes['cp']}, pp={layout.sizes['pp']}: "
            "its inputs are the tokens shifted along the sequence, which these layouts split; train with "
            "n_mtp_layers=0 (or data / expert parallelism only)"
        )
    losses, stats, t = [], [], tokens.shape[1]
    head = params["head"]
    for k in range(len(params["mtp"])):
        n = t - k - 1  # positions with a next token t_{i+k+1} in the row
        if n < 2:
            break
        pos = positions[..., :n]
        seg = None if segments is None else segments[:, :n]
        h, normed, _, s = module_apply(params, h[:, :n], tokens[:, k + 1 :], k=k, positions=pos, block=block,
                                       norm_eps=norm_eps, kernels=kernels, segments=seg)  # fmt: skip
        stats.append(s)
        scored = normed[:, : n - 1]  # the last position's target lies past the row
        targets = _targets(tokens, k, segments).reshape(-1)
        total = cross_entropy(scored.reshape(-1, scored.shape[-1]), head, targets, reduction="sum")
        losses.append(_global_mean(total, (targets != IGNORE_INDEX).sum(), layout))
    return losses, stats


def _global_mean(total: torch.Tensor, count: torch.Tensor, layout: Any) -> torch.Tensor:  # ()
    """``total / count`` over the global batch: summed over the data axes with ``psum`` (whose backward
    sums the cotangents too), so every rank holds the same value, as the balancing loss's global router
    statistics (``parallel.expert.global_stats``); the trainer's per-rank loss weights then sum to 1."""
    from ftitan.parallel import collectives as C

    packed = torch.stack([total, count.to(total.dtype)])
    for a in () if layout is None else layout.data_axes():
        packed = C.psum(packed, layout.group(a))
    return packed[0] / packed[1].detach().clamp(min=1)


def update_router_bias(mtp: Mapping[str, Any], load: torch.Tensor, rate: float) -> dict[str, Any]:
    """``mtp`` with module ``k``'s block ``router_bias`` moved by ``load[k]`` (E,) (``deepseek_v3.update_buffers``)."""
    out = dict(mtp)
    with torch.no_grad():
        for k in range(load.shape[0]):
            module = dict(out[str(k)])
            block = dict(module["block"])
            moe = dict(block["moe"])
            moe["router_bias"] = moe_.update_router_bias(moe["router_bias"], load[k], rate)
            block["moe"], module["block"], out[str(k)] = moe, block, module
    return out


# ---------------------------------------------------------------- HF checkpoints

_HF_OWN = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
           "norm": "shared_head.norm.weight"}  # fmt: skip


def _with_copies(m: hf.WeightMap, copies: Sequence[str]) -> hf.WeightMap:
    """``m`` (a plain rename) also written under ``copies`` (cloned: safetensors refuses shared memory);
    read from its first name, the copies only checked for presence."""
    return hf.WeightMap(path=m.path, names=(*m.names, *copies), to_hf=lambda x: (x, *(x.clone() for _ in copies)),
                        from_hf=lambda ts: ts[0])  # fmt: skip


def hf_weights(maps: list[hf.WeightMap], block_maps: Sequence[hf.WeightMap], *, n_layers: int
               ) -> list[hf.WeightMap]:  # fmt: skip
    """The main table ``maps`` plus the MTP modules at layers ``n_layers + k``: ``block_maps`` (a decoder
    layer's table at those indices) renamed to ``mtp.{k}.block``, the modules' own tensors, and the
    checkpoints' per-module copies of the shared embedding and head."""
    n = 1 + max(int(m.path.split(".")[1]) for m in block_maps) - n_layers
    out = []
    for m in maps:
        if m.path == "embed":
            m = _with_copies(m, [f"model.layers.{n_layers + k}.embed_tokens.weight" for k in range(n)])
        elif m.path == "head":
            m = _with_copies(m, [f"model.layers.{n_layers + k}.shared_head.head.weight" for k in range(n)])
        out.append(m)
    for m in block_maps:
        _, i, rest = m.path.split(".", 2)
        out.append(attrs.evolve(m, path=f"mtp.{int(i) - n_layers}.block.{rest}"))
    out += [hf.WeightMap(path=f"mtp.{k}.{leaf}", names=(f"model.layers.{n_layers + k}.{name}",))
            for k in range(n) for leaf, name in _HF_OWN.items()]  # fmt: skip
    return out


def _weight_names(directory: Path) -> list[str]:
    index = directory / hf.WEIGHTS_INDEX_FILE
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(directory / hf.WEIGHTS_FILE, "pt") as f:
        return list(f.keys())


def load_hf(
    directory: str | os.PathLike[str], *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tuple[Any, tree.Tree]:
    """``hf.load_hf`` with the MTP modules the checkpoint holds: ``n_mtp_layers`` is the number of layers
    ``n_layers + k`` with an ``eh_proj`` in the weights. (``num_nextn_predict_layers`` alone does not say:
    ``transformers`` writes 1 by default and saves no MTP weights.)"""
    d = Path(directory)
    cfg = hf.config_from_hf(json.loads((d / hf.CONFIG_FILE).read_text()))
    found = {int(m[1]) for n in _weight_names(d) if (m := re.fullmatch(r"model\.layers\.(\d+)\.eh_proj\.weight", n))}
    n = next(k for k in range(len(found) + 1) if cfg.n_layers + k not in found)
    cfg = attrs.evolve(cfg, n_mtp_layers=n)
    return cfg, hf.from_hf(hf._read_weights(d, device), cfg, dtype=dtype, device=device)
