"""The vLLM model class: ftitan's pure ``apply`` over a params tree of ``nn.Parameter`` leaves.

There is no second model definition. :class:`FtitanForCausalLM` holds the family's ``Model``
(``registry.model_for``) and registers every leaf of its inference params tree as a parameter
(``layers.3.attn.wqkv`` is ``layers__3__attn__wqkv``: vLLM parameter names cannot contain
``.``). That tree has the q/k/v and gate/up projections stacked (``ftitan.infer.fuse_projections``,
which the model functions read as they are), so a decoder layer makes four matmuls, as vLLM's
own models do. Attention goes through :class:`PagedAttention`, an ``AttentionCache``
(``ftitan.models.base``) whose ``attend`` calls one vLLM paged ``Attention`` per layer over the
flat token stream of every running request.

Where vLLM has its oneDNN CPU GEMM, the tree ``apply`` reads holds :class:`PackedLinear` weights
(prepacked once per weight load or push, as vLLM's ``dispatch_cpu_unquantized_gemm`` does for its
own layers; ``ftitan.nn.linear`` calls them); elsewhere it holds the parameters themselves.

Importing this module imports vLLM; ``ftitan.vllm.engine`` does it on first use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn as tnn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.platforms import current_platform

from ftitan import nn, random, tree
from ftitan.nn import invariant
from ftitan.infer.fuse import fuse_projections, fused_slices
from ftitan.models import hf, registry
from ftitan.models.base import soft_cap
from ftitan.vllm._families import ARCHITECTURES, check_supported

__all__ = ["ATTN_IMPL_KEY", "FtitanForCausalLM", "InvariantPagedAttention", "PackedLinear", "PagedAttention",
           "param_name", "register"]  # fmt: skip

# hf_overrides key carrying ftitan's attn_impl into the engine's model config (config.json has no such field)
ATTN_IMPL_KEY = "ftitan_attn_impl"

# the matrices every token multiplies (packed for oneDNN); embeddings, routers and experts stay
_PACKED = ("wqkv", "wo", "w13", "w2", "head")


def param_name(path: str) -> str:
    """The ``nn.Parameter`` name of a ftitan leaf path: ``layers.3.attn.wq`` -> ``layers__3__attn__wq``."""
    return path.replace(".", "__")


class PagedAttention:
    """``AttentionCache`` over vLLM's paged KV cache: layer ``i`` attends through ``layers[i]``.

    vLLM's ``Attention`` finds the KV cache, block tables and sequence boundaries of the current
    batch in its forward context, so this object holds no state and ``attend`` returns ``self``.
    """

    def __init__(self, layers: Sequence[Attention], scale: float) -> None:
        self.layers, self.scale = layers, scale

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # (1, N, H, Dk) RoPE'd queries of the flat token stream
        k: torch.Tensor,  # (1, N, KV, Dk)
        v: torch.Tensor,  # (1, N, KV, Dv)
        *,
        impl: str,  # ftitan's attention kernel choice; vLLM's backend decides here
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, PagedAttention]:  # (1, N, H, Dv), self
        if not causal or not math.isclose(scale, self.scale, rel_tol=1e-6):
            raise ValueError(
                f"ftitan.vllm: layer {layer} asked for causal={causal}, scale={scale}; vLLM's Attention "
                f"was built causal with scale={self.scale}"
            )
        b, t, h, _ = q.shape
        if b != 1:
            raise ValueError(f"ftitan.vllm: attend got batch {b}; vLLM runs one flat token stream (batch 1)")
        o = self.layers[layer](q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1))  # (N, H * Dv)
        return o.view(1, t, h, -1), self


class InvariantPagedAttention:
    """``AttentionCache`` of the batch-invariant mode (``ftitan.config.batch_invariant``): vLLM schedules
    (block tables, slot mapping, sequence lengths of the current batch), ftitan attends.

    vLLM's paged kernels sum in an order of their own (and its CPU cache packs keys per ISA), so
    each layer keeps its keys/values in a slot-indexed copy of vLLM's paged layout (slot =
    block * block_size + offset, the same slots vLLM assigns, so prefix-cached blocks are found too)
    and attends with ``ftitan.nn.invariant.attention`` per request, keys gathered from key 0 through
    its block table: the bits the trainer's forward gives. vLLM's own KV cache stays allocated, unused.
    """

    def __init__(self, layers: Sequence[Attention], scale: float) -> None:
        self.layers, self.scale = layers, scale
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (slots, KV, Dk)
        self.values: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, impl: str, causal: bool,
               scale: float) -> tuple[torch.Tensor, InvariantPagedAttention]:  # fmt: skip
        from vllm.model_executor.layers.attention.attention import get_attention_context

        md, _, kv_cache, _ = get_attention_context(self.layers[layer].layer_name)
        if md is None:  # vLLM's profiling / warm-up run: no cache, the tokens attend causally among themselves
            return nn.attention(q, k, v, impl=impl, causal=True, scale=scale), self
        n, t = int(md.num_actual_tokens), q.shape[1]
        block = kv_cache.shape[2]  # (blocks, KV, block_size, ...): CPU_ATTN's layout
        slots = kv_cache.shape[0] * block
        if layer not in self.keys or self.keys[layer].shape[0] != slots:
            self.keys[layer] = k.new_zeros(slots, *k.shape[2:])
            self.values[layer] = v.new_zeros(slots, *v.shape[2:])
        where = md.slot_mapping[:n].long()
        self.keys[layer].index_copy_(0, where, k[0, :n])
        self.values[layer].index_copy_(0, where, v[0, :n])
        starts, seq = md.query_start_loc.long(), md.seq_lens.long()  # (R + 1,), (R,)
        q_len = starts[1:] - starts[:-1]
        s, tq = int(seq.max()), int(q_len.max())
        j = torch.arange(s, device=q.device)
        key_slot = md.block_table.long()[:, j // block] * block + j % block  # (R, S): request r's j-th key
        key_slot = torch.where(j < seq[:, None], key_slot, torch.zeros_like(key_slot))
        i = torch.arange(tq, device=q.device)
        row = starts[:-1, None] + i  # (R, Tq) each query's token in the stream
        real = i < q_len[:, None]
        row = torch.where(real, row, torch.zeros_like(row))
        pos = (seq - q_len)[:, None] + i  # each query's position in its sequence
        mask = (j <= pos[:, :, None]) & (j < seq[:, None, None])  # (R, Tq, S)
        mask = mask | ((j == 0) & ~real[:, :, None])  # padding queries see key 0 (finite, dropped)
        o = invariant.attention(q[0][row], self.keys[layer][key_slot], self.values[layer][key_slot],
                                scale=scale, mask=mask)  # fmt: skip
        out = q.new_zeros(t, q.shape[2], v.shape[3]).index_copy(0, row[real], o[real])
        return out[None], self


class PackedLinear:
    """A ``(out, in)`` weight prepacked for vLLM's oneDNN CPU GEMM: ``nn.linear(x, packed)`` is
    ``x @ weight.T`` (``ftitan.nn.linear`` calls :meth:`linear` for weights that are not tensors)."""

    def __init__(self, weight: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        self.shape = weight.shape
        self._handler = ops.create_onednn_mm(weight.detach().t(), 32)  # packs a copy of the weight

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:  # (..., in) -> (..., out)
        from vllm import _custom_ops as ops

        return ops.onednn_mm(self._handler, x, b)


def _packs() -> bool:
    """Whether this vLLM has its oneDNN GEMM (x86 / Arm CPU builds), which fp32 and bf16 weights use."""
    from vllm import _custom_ops as ops

    return current_platform.is_cpu() and ops._supports_onednn


class FtitanForCausalLM(tnn.Module):
    """A ftitan family (``llama``, ``qwen3``, ``qwen3_moe``) as a vLLM text-generation model.

    Built by vLLM from the HF ``config.json`` (``hf.config_from_hf``); registered as
    ``FtitanLlamaForCausalLM`` etc. by :func:`register`, chosen with
    ``LLM(..., hf_overrides={"architectures": [name]})`` (``ftitan.vllm.engine`` does both).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config.to_dict()
        self.config = hf.config_from_hf(hf_config)
        if hf_config.get(ATTN_IMPL_KEY):  # ftitan.vllm.engine(batch_invariant=True): the mode is no HF field
            self.config = attrs.evolve(self.config, attn_impl=hf_config[ATTN_IMPL_KEY])
        self.invariant = invariant.enabled(self.config)
        check_supported(self.config, cpu=current_platform.is_cpu())
        self.model = registry.model_for(self.config)
        dtype = vllm_config.model_config.dtype
        # shapes from a meta init; vLLM loads the values next (load_weights), so nothing is drawn
        unfused = self.model.init(random.key(0), dtype=dtype, device="meta")
        self.slices = fused_slices(unfused)  # unfused leaf path -> (fused path, rows)
        self.unfused_shapes = dict(zip(tree.paths(unfused), (x.shape for x in tree.leaves(unfused)), strict=True))
        self._unfused_treedef = tree.flatten_with_paths(unfused)[2]
        paths, metas, treedef = tree.flatten_with_paths(fuse_projections(unfused))
        leaves = []
        for path, meta in zip(paths, metas, strict=True):
            p = tnn.Parameter(torch.empty(meta.shape, dtype=meta.dtype), requires_grad=False)
            p.weight_loader = default_weight_loader  # reload_weights only loads through weight_loader
            self.register_parameter(param_name(path), p)
            leaves.append(p)
        self.params = tree.unflatten(treedef, leaves)  # its leaves are the Parameters
        self.paths = dict(zip(map(param_name, paths), paths, strict=True))  # parameter name -> ftitan path
        self._treedef = treedef
        self._runtime: tree.Tree | None = None  # what apply reads: params, linears packed (built lazily)
        cfg, head_dim = self.config, self.config.head_dim
        self.attn = tnn.ModuleList(
            Attention(cfg.n_heads, head_dim, head_dim**-0.5, num_kv_heads=cfg.n_kv_heads,
                      cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn.{i}" if prefix else f"attn.{i}")
            for i in range(cfg.n_layers)
        )  # fmt: skip
        paged = InvariantPagedAttention if self.invariant else PagedAttention
        self.paged = paged(list(self.attn), head_dim**-0.5)

    def runtime_params(self) -> tree.Tree:
        """The tree ``apply`` reads: the parameters, with :data:`_PACKED` matrices prepacked for oneDNN
        where vLLM has it; rebuilt after every weight load or push."""
        if self._runtime is None:
            pack = _packs() and not self.invariant
            # from the live attributes: vLLM's reload_weights may have put new Parameter objects there
            self.params = tree.unflatten(self._treedef, [getattr(self, name) for name in self.paths])
            if self.invariant:  # the trainer's (unfused) GEMM shapes, plain tensors: row views of the fused ones
                fused = {path: getattr(self, param_name(path)) for path in self.paths.values()}
                self._runtime = tree.unflatten(self._unfused_treedef, [
                    fused[self.slices[p][0]][self.slices[p][1] : self.slices[p][2]] if p in self.slices else fused[p]
                    for p in self.unfused_shapes])  # fmt: skip
                return self._runtime
            self._runtime = tree.map_with_path(
                lambda path, p: PackedLinear(p) if pack and p.dim() == 2 and path.rsplit(".", 1)[-1] in _PACKED else p,
                self.params)  # fmt: skip
        return self._runtime

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, D)
        return nn.embed(input_ids, self.runtime_params()["embed"])

    def forward(
        self,
        input_ids: torch.Tensor | None,  # (N,) every scheduled token of every request, concatenated
        positions: torch.Tensor,  # (N,) each token's position in its own sequence
        intermediate_tensors: Any = None,  # pipeline parallelism (unsupported)
        inputs_embeds: torch.Tensor | None = None,  # (N, D) instead of input_ids
    ) -> torch.Tensor:  # (N, D) final-normed hidden states
        if intermediate_tensors is not None:
            raise NotImplementedError("ftitan.vllm: pipeline parallelism inside vLLM is not supported")
        if inputs_embeds is not None:  # the same layers, entered after the embedding
            every = range(self.config.n_layers)
            h, _, _ = self.model.stage(self.runtime_params(), inputs_embeds[None], layers=every, first=False,
                                       last=True, positions=positions[None], cache=self.paged)  # fmt: skip
        else:
            h, _ = self.model.apply(self.runtime_params(), input_ids[None], positions=positions[None],
                                    cache=self.paged, logits=False)  # fmt: skip
        return h[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # (n, D) -> (n, V)
        """The logits; in the batch-invariant mode the log-probs (``nn.invariant.log_softmax``: the same
        distribution to sample from, and with ``logprobs_mode="raw_logits"``, which ``engine`` sets, vLLM
        reports these values: the trainer's bits). A soft-capping model's (``Model.logit_softcap``) logits are
        capped as its ``apply`` caps them."""
        logits = nn.linear(hidden_states, self.model.head(self.runtime_params()), invariant=self.invariant)
        logits = soft_cap(logits, self.model.logit_softcap)
        return invariant.log_softmax(logits.float(), dim=-1) if self.invariant else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (``hf.to_hf`` names) through each parameter's ``weight_loader``; returns
        the parameter names loaded. A parameter is loaded once all its pieces have arrived: tensors HF
        stores split (Qwen3-MoE's per-expert ones) are joined by the family's table, and the leaves a
        fused projection stacks (``q_proj``, ``k_proj``, ``v_proj`` -> ``wqkv``) are concatenated."""
        family = hf.family_of(self.config)
        maps = family.weights(self.config)
        by_name = {n: m for m in maps for n in m.names}
        ignored = family.ignored(self.config)
        empty = family.empty(self.config)  # zero-size tensors HF keeps where the config has none
        live = dict(self.named_parameters())  # looked up now: vLLM's reload swaps parameters while loading
        stacks: dict[str, list[str]] = {}  # fused path -> the leaves it stacks, in row order
        for leaf, (fused, _, _) in sorted(self.slices.items(), key=lambda kv: kv[1][1]):
            stacks.setdefault(fused, []).append(leaf)
        split: dict[str, dict[str, torch.Tensor]] = {}  # leaf path -> its HF pieces so far
        stacked: dict[str, dict[str, torch.Tensor]] = {}  # fused path -> its leaves so far
        loaded: set[str] = set()
        for name, tensor in weights:
            m = by_name.get(name)
            if m is None:
                if any(tree.match(name, g) for g in ignored) or (name in empty and not tensor.numel()):
                    continue
                raise KeyError(f"ftitan.vllm: checkpoint tensor {name!r} has no place in ftitan's {family.name} model")
            pieces = split.setdefault(m.path, {})
            pieces[name] = tensor
            if len(pieces) < len(m.names):
                continue
            leaf = m.from_hf([pieces[n] for n in m.names]) if m.from_hf else tensor
            del split[m.path]
            if m.path not in self.slices:
                loaded.add(_load_leaf(live[param_name(m.path)], leaf, m.path, m.names))
                continue
            fused = self.slices[m.path][0]
            leaves = stacked.setdefault(fused, {})
            leaves[m.path] = leaf
            if len(leaves) == len(stacks[fused]):
                joined = torch.cat([leaves[p] for p in stacks[fused]])
                loaded.add(_load_leaf(live[param_name(fused)], joined, fused, stacks[fused]))
                del stacked[fused]
        self._runtime = None  # repack at the next forward
        if split or stacked:
            missing = sorted({*split, *(p for f in stacked for p in stacks[f] if p not in stacked[f])})
            raise KeyError(f"ftitan.vllm: incomplete checkpoint: no tensors yet for {missing}")
        return loaded

    @torch.no_grad()
    def copy_params_(self, params: tree.Tree) -> None:
        """Copy a ftitan params tree (as training holds it, or already fused) into the parameters in
        place (dtype converted); ValueError, before anything is copied, unless its paths and shapes are
        exactly this model's."""
        given = dict(zip(*tree.flatten_with_paths(params)[:2], strict=True))
        if not {fused for fused, _, _ in self.slices.values()} & set(given):  # unfused: errors name its paths
            _check_same_leaves(self.unfused_shapes, given)
        fused = dict(zip(*tree.flatten_with_paths(fuse_projections(params))[:2], strict=True))
        mine = {path: getattr(self, name) for name, path in self.paths.items()}
        _check_same_leaves({path: p.shape for path, p in mine.items()}, fused)
        for path, p in mine.items():
            p.copy_(fused[path])
        self._runtime = None  # repack at the next forward


def _load_leaf(param: torch.Tensor, x: torch.Tensor, path: str, names: Sequence[str]) -> str:
    if tuple(x.shape) != tuple(param.shape):
        raise ValueError(f"{path} (from {', '.join(names)}): checkpoint shape {tuple(x.shape)}, "
                         f"the engine's model has {tuple(param.shape)}")  # fmt: skip
    param.weight_loader(param, x)
    return param_name(path)


def _check_same_leaves(mine: Mapping[str, torch.Size], new: Mapping[str, Any]) -> None:
    def some(items: list[str]) -> str:
        return ", ".join(items[:6]) + (f", ... ({len(items) - 6} more)" if len(items) > 6 else "")

    missing, extra = sorted(set(mine) - set(new)), sorted(set(new) - set(mine))
    shapes = [f"{p} {tuple(new[p].shape)} (engine {tuple(mine[p])})"
              for p in mine if p in new and tuple(getattr(new[p], "shape", ())) != tuple(mine[p])]  # fmt: skip
    problems = [f"{what} [{some(items)}]" for what, items in
                (("missing", missing), ("unexpected", extra), ("misshapen", shapes)) if items]  # fmt: skip
    if problems:
        raise ValueError(
            f"ftitan.vllm.push_weights: the params tree does not match the engine's model: {'; '.join(problems)}. "
            "Push a tree of the family and config the engine was built from"
        )


def register() -> None:
    """Register :class:`FtitanForCausalLM` with ``vllm.ModelRegistry`` under every name in
    ``ARCHITECTURES`` (idempotent; usable as a ``vllm.general_plugins`` entry point)."""
    from vllm import ModelRegistry

    for arch in ARCHITECTURES.values():
        ModelRegistry.register_model(arch, FtitanForCausalLM)
