"""Qwen3-MoE (Qwen3 Technical Report, Yang et al. 2025) as pure functions.

Qwen3's decoder (QK-normed GQA attention, RoPE base 1e6, see ``qwen3``) with
a mixture-of-experts feed-forward in every layer: a softmax router picks
``top_k`` of ``n_experts`` SwiGLU experts per token, their weights
renormalized to sum to 1 (``norm_topk``), no shared experts. Layers listed
in ``dense_layers`` keep a dense SwiGLU instead (HF ``mlp_only_layers`` /
``decoder_sparse_step``; none in the published sizes). Training adds the
Switch load-balancing loss times ``aux_loss_coef`` (HF
``router_aux_loss_coef``, 0.001); ``apply_with_aux`` returns it with the
router statistics (``nn.moe.moe_aux``). Logits and the aux loss match
``transformers.Qwen3MoeForCausalLM`` to float32 rounding.

Parallel (``ftitan.parallel``): FSDP / DDP, tensor and sequence parallel
(heads, expert and MLP widths, vocab over ``tp``), context parallel, and
expert parallel (routed experts over ``ep``, ``ftitan.parallel.expert``),
with the balancing loss and router load of the global batch.

>>> import torch, ftitan as ft
>>> from ftitan.models import qwen3_moe
>>> m = qwen3_moe.model(qwen3_moe.Config.debug())
>>> params = m.init(ft.random.key(0))
>>> logits, _, aux = m.apply_with_aux(params, torch.zeros(2, 16, dtype=torch.long))
>>> logits.shape, aux["moe.tokens_per_expert"].shape
(torch.Size([2, 16, 2048]), torch.Size([4, 8]))

Params tree::

    {"embed": (V, D),
     "layers": {"0": {"attn_norm": (D,),
                      "attn": {"wq": (H*Dh, D), "wk": (KV*Dh, D), "wv": (KV*Dh, D), "wo": (D, H*Dh),
                               "q_norm": (Dh,), "k_norm": (Dh,)},
                      "mlp_norm": (D,),
                      "moe": {"router": (E, D),
                              "experts": {"w1": (E, Fe, D), "w2": (E, D, Fe), "w3": (E, Fe, D)}}},
                      # a dense layer has "mlp": {"w1": (F, D), "w2": (D, F), "w3": (F, D)} instead of "moe"
                "1": ...},
     "norm": (D,),
     "head": (V, D)}            # absent when tie_embeddings

HF checkpoints store one tensor per expert
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, the layout of the hub
files, of ``save_pretrained`` and of vLLM); ``hf_weights`` stacks them into
the ``(E, ...)`` leaves on import and splits them on export.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from ftitan import nn, tree
from ftitan.models import base, decoder, hf, qwen3
from ftitan.models.base import Model
from ftitan.nn import invariant
from ftitan.nn.attention import Attend, AttentionImpl
from ftitan.nn.moe import MoEConfig
from ftitan.parallel import expert

__all__ = [
    "FLAVORS",
    "Config",
    "active_params",
    "config_from_hf",
    "config_to_hf",
    "flops_per_token",
    "hf_weights",
    "model",
    "param_specs",
]


def _sorted_layers(value: Sequence[int]) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"qwen3_moe.Config.dense_layers={value!r}: expected a sequence of int layer indices")
    return tuple(sorted(value))


@attrs.frozen(kw_only=True)
class Config:
    """Qwen3-MoE architecture. Published sizes: ``Config.qwen3_30b_a3b()`` etc., see ``FLAVORS``."""

    vocab_size: int  # V: rows of the embedding / output head
    dim: int  # D: model (residual stream) width (HF hidden_size)
    n_layers: int  # L: decoder blocks
    n_heads: int  # H: query heads
    n_kv_heads: int  # KV: key/value heads (GQA); n_heads % n_kv_heads == 0
    head_dim: int  # Dh: width of one head, explicit (H * Dh need not equal dim)
    n_experts: int  # E: routed experts per MoE layer (HF num_experts)
    top_k: int  # experts each token is sent to (HF num_experts_per_tok)
    expert_dim: int  # Fe: SwiGLU hidden width of one expert (HF moe_intermediate_size)
    ffn_dim: int  # F: SwiGLU hidden width of the dense layers (HF intermediate_size; unused without dense_layers)
    dense_layers: tuple[int, ...] = attrs.field(default=(), converter=_sorted_layers)  # layers with a dense SwiGLU
    norm_topk: bool = True  # renormalize the top_k routing weights to sum to 1 (HF norm_topk_prob)
    aux_loss_coef: float = 0.001  # weight of the load-balancing loss in the training loss (HF router_aux_loss_coef)
    norm_eps: float = 1e-6  # epsilon of every RMSNorm, QK-norm included
    rope_theta: float = 1_000_000.0  # RoPE base
    max_seq_len: int = 40_960  # longest sequence the model is meant for (HF max_position_embeddings)
    tie_embeddings: bool = False  # output head reuses the embedding table
    # "sdpa", "math" (explicit fp32 softmax), "batch_invariant" (all ops, nn.invariant), "flex" (FlexAttention,
    # SDPA with the same mask where it cannot run), "gemm" (causal query blocks as GEMMs on the CPU, else sdpa),
    # "auto" (flex on CUDA under torch.compile, gemm on the CPU, else sdpa)
    attn_impl: AttentionImpl = "sdpa"
    kernels: str = "torch"  # "torch", "triton" or "helion" (ftitan.kernels on CUDA, their references elsewhere)
    float8: str = ""  # "tensorwise" / "rowwise": the blocks' projections in float8 (torchao's recipes, nn.float8)
    float8_experts: bool = False  # the routed experts' grouped GEMMs in float8 (torchao's rowwise MoE recipe)
    remat: str = "none"  # activation rematerialization of each block (ftitan.config.with_remat): "none", "full", ...
    init_std: float = 0.02  # std of the (truncated) normal init; residual outputs wo/w2 get init_std/sqrt(2L)

    def __attrs_post_init__(self) -> None:
        qwen3.check_config(self, "qwen3_moe")
        for name in ("n_experts", "top_k", "expert_dim", "ffn_dim"):
            decoder.check_positive_int(self, "qwen3_moe", name)
        if self.top_k > self.n_experts:
            raise ValueError(f"qwen3_moe.Config: top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"qwen3_moe.Config.aux_loss_coef={self.aux_loss_coef!r}: must be >= 0")
        bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
        if bad or len(set(self.dense_layers)) != len(self.dense_layers):
            raise ValueError(
                f"qwen3_moe.Config.dense_layers={self.dense_layers}: need distinct layer indices in "
                f"[0, {self.n_layers}); out of range: {bad}"
            )
        if len(self.dense_layers) == self.n_layers:
            raise ValueError("qwen3_moe.Config: every layer is in dense_layers; use ftitan.models.qwen3 instead")
        decoder.check_float8(self, "qwen3_moe")
        nn.float8.check_experts(self, "qwen3_moe", {"dim": self.dim, "expert_dim": self.expert_dim})

    @property
    def moe(self) -> MoEConfig:
        """The MoE layer's config: softmax routing, no shared experts, no groups, no balancing bias."""
        return MoEConfig(
            n_experts=self.n_experts, top_k=self.top_k, expert_dim=self.expert_dim, score_func="softmax",
            norm_topk=self.norm_topk, aux_loss_coef=self.aux_loss_coef, batch_invariant=invariant.enabled(self),
            kernels=self.kernels, float8=self.float8, float8_experts=self.float8_experts,
        )  # fmt: skip

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers with an MoE feed-forward, ascending."""
        return tuple(i for i in range(self.n_layers) if i not in self.dense_layers)

    @classmethod
    def debug(cls) -> Config:
        """Tiny model that trains on 2 CPU cores: 8 experts, top 2, head_dim 32."""
        return cls(
            vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32,
            n_experts=8, top_k=2, expert_dim=128, ffn_dim=768, max_seq_len=2048,
        )  # fmt: skip

    # Published hyperparameters: config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on the HF hub
    # (both: vocab 151,936, head_dim 128, 128 experts, top 8, norm_topk_prob, no dense layers, untied).
    @classmethod
    def qwen3_30b_a3b(cls) -> Config:
        """Qwen3-30B-A3B: 30,532,122,624 params, 3,353,032,704 active per token."""
        return cls(
            vocab_size=151_936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
            n_experts=128, top_k=8, expert_dim=768, ffn_dim=6144,
        )  # fmt: skip

    @classmethod
    def qwen3_235b_a22b(cls) -> Config:
        """Qwen3-235B-A22B: 235,093,634,560 params, 22,190,763,520 active per token."""
        return cls(
            vocab_size=151_936, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
            n_experts=128, top_k=8, expert_dim=1536, ffn_dim=12_288,
        )  # fmt: skip


FLAVORS = {
    "debug": Config.debug,
    "qwen3_30b_a3b": Config.qwen3_30b_a3b,
    "qwen3_235b_a22b": Config.qwen3_235b_a22b,
}


def param_specs(cfg: Config) -> dict[str, Any]:
    """Tree of ``nn.Param`` specs (shape, logical axes, init) shaped like the params."""
    std, out_std = cfg.init_std, decoder.residual_std(cfg)

    def layer(i: int) -> dict[str, Any]:
        ffn = (
            {"mlp": nn.swiglu_params(cfg.dim, cfg.ffn_dim, std=std, out_std=out_std)}
            if i in cfg.dense_layers
            else {"moe": nn.moe_params(cfg.dim, cfg.moe, std=std, out_std=out_std)}
        )
        return {"attn_norm": nn.norm_param(cfg.dim), "attn": decoder.attention_params(cfg, qk_norm=True),
                "mlp_norm": nn.norm_param(cfg.dim), **ffn}  # fmt: skip

    return {
        "embed": nn.embed_param(cfg.vocab_size, cfg.dim, std=std),
        "layers": {str(i): layer(i) for i in range(cfg.n_layers)},
        "norm": nn.norm_param(cfg.dim),
        **decoder.head_params(cfg),
    }


def active_params(cfg: Config) -> int:
    """Parameters one token uses: all but the ``E - top_k`` unchosen experts of every MoE layer.

    Embedding and output head included, as in Qwen's headline counts ("A3B", "A22B").
    """
    total = sum(math.prod(spec.shape) for spec in tree.leaves(param_specs(cfg)))
    return total - len(cfg.moe_layers) * (cfg.n_experts - cfg.top_k) * 3 * cfg.dim * cfg.expert_dim


def flops_per_token(cfg: Config, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``, active weights only.

    ``6 * N_active + 6 * L * T * H * Dh``. ``N_active`` counts the matmul
    weights a token goes through: per layer the attention projections, then
    per MoE layer the router (``E * D``) and ``top_k`` experts
    (``top_k * 3 * D * Fe``) or per dense layer its SwiGLU (``3 * D * F``),
    and the output head (the embedding when tied); not the embedding lookup
    or the norms. A weight costs 2 FLOPs per token forward and 4 backward;
    attention scores and values cost 12 * L * T * H * Dh for forward +
    backward, halved for the causal mask (as ``qwen3.flops_per_token``).
    Routing, dispatch and the softmax are not counted.
    """
    attn, scores = decoder.attention_flops(cfg, seq_len)
    moe = cfg.n_experts * cfg.dim + cfg.top_k * 3 * cfg.dim * cfg.expert_dim
    dense = 3 * cfg.dim * cfg.ffn_dim
    n_moe = len(cfg.moe_layers)
    matmul = cfg.n_layers * attn + n_moe * moe + (cfg.n_layers - n_moe) * dense + cfg.vocab_size * cfg.dim
    return float(6 * matmul + scores)


def _stage(
    cfg: Config,
    moe_cfg: MoEConfig,  # cfg.moe, built once outside: dynamo cannot trace a frozen attrs __init__
    params: Mapping[str, Any],  # this stage's subtree: layers.{i} of ``layers``, embed if first, norm if last
    x: torch.Tensor,  # (B, T) int tokens if first, else (B, T, D) hidden from the previous stage
    *,
    layers: range,
    first: bool,
    last: bool,
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int; default arange(T)
    cache: Any = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows (None: one document a row)
) -> base.StageOut:  # h (B, T, D), {layer: this rank's MoEStats}, cache
    """Embed (``first``), blocks ``layers``, final norm (``last``): the layer loop of ``apply_with_aux``
    and one pipeline stage (``base.StageFn``)."""
    cos, sin = decoder.rope(cfg, decoder.stage_positions(x, positions, first=first, family="qwen3_moe",
                                                             segments=segments))  # fmt: skip

    # the parallel seams (decoder.attention/norm/mlp, expert.moe) are the single-process ops without a layout
    def block(_i: int, p: Mapping[str, Any], h: torch.Tensor, attend: Attend) -> tuple[torch.Tensor, Any]:
        h = h + decoder.attention(cfg, p["attn"], decoder.norm(cfg, h, p["attn_norm"]), cos, sin, attend=attend)
        x = decoder.norm(cfg, h, p["mlp_norm"])
        if "moe" in p:
            y, stats = expert.moe(x, p["moe"], moe_cfg)  # routed experts over ep, hidden width over tp
            return h + y, stats
        return h + decoder.mlp(x, p["mlp"], invariant=moe_cfg.batch_invariant, kernels=cfg.kernels,
                               float8=cfg.float8), None

    return decoder.run_stage(cfg, params, x, block, layers=layers, first=first, last=last, cache=cache,
                             segments=segments)  # fmt: skip


def _apply_with_aux(
    cfg: Config,
    moe_cfg: MoEConfig,
    params: Mapping[str, Any],
    tokens: torch.Tensor,  # (B, T) int
    *,
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int
    cache: Any = None,
    segments: torch.Tensor | None = None,  # (B, T) int document ids of packed rows (None: one document a row)
    logits: bool = True,
) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor]]:  # (B, T, V) | (B, T, D); cache; aux
    h, stats, cache = _stage(cfg, moe_cfg, params, tokens, layers=range(cfg.n_layers), first=True, last=True,
                             positions=positions, cache=cache, segments=segments)  # fmt: skip
    head = decoder.output_head(cfg, params)
    out = decoder.logits_of(h, head, invariant=moe_cfg.batch_invariant, kernels=cfg.kernels) if logits else h
    return out, cache, expert.moe_aux(list(stats.values()), moe_cfg)  # router statistics of the global batch


def model(cfg: Config) -> Model:
    """The Qwen3-MoE ``Model`` for ``cfg``: ``apply_with_aux`` also returns the router aux dict."""
    specs = param_specs(cfg)

    apply_with_aux = functools.partial(_apply_with_aux, cfg, cfg.moe)
    return Model(
        config=cfg,
        init=functools.partial(nn.init, specs),  # (key, *, dtype, device) -> params
        apply=base.drop_aux(apply_with_aux),
        head=functools.partial(decoder.output_head, cfg),
        param_axes=nn.axes(specs),
        flops_per_token=functools.partial(flops_per_token, cfg),
        apply_with_aux=apply_with_aux,
        stage=functools.partial(_stage, cfg, cfg.moe),
    )


# ---------------------------------------------------------------- HF checkpoints


def _expert_weights(cfg: Config, i: int) -> list[hf.WeightMap]:
    d, fe, experts = cfg.dim, cfg.expert_dim, f"model.layers.{i}.mlp.experts"
    maps = [hf.WeightMap(path=f"layers.{i}.moe.router", names=(f"model.layers.{i}.mlp.gate.weight",))]
    for leaf, proj, shape in (("w1", "gate_proj", (fe, d)), ("w2", "down_proj", (d, fe)), ("w3", "up_proj", (fe, d))):
        path = f"layers.{i}.moe.experts.{leaf}"
        names = tuple(f"{experts}.{e}.{proj}.weight" for e in range(cfg.n_experts))
        maps.append(hf.stacked(path, names, shape))
    return maps


def hf_weights(cfg: Config) -> list[hf.WeightMap]:
    """ftitan path <-> HF ``Qwen3MoeForCausalLM`` checkpoint names (hub layout: one tensor per expert)."""
    maps = [*decoder.hf_outer_weights(cfg), *hf.per_layer(cfg.n_layers, {**decoder.HF_ATTENTION, **decoder.HF_QK_NORM})]
    for i in range(cfg.n_layers):
        if i in cfg.dense_layers:
            maps += [hf.WeightMap(path=p.format(i=i), names=(n.format(i=i),)) for p, n in decoder.HF_MLP.items()]
        else:
            maps += _expert_weights(cfg, i)
    return maps


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """``Qwen3MoeConfig`` fields (transformers 5 ``rope_parameters`` format); dense layers as ``mlp_only_layers``."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **qwen3.hf_common_to_hf(cfg),
        "intermediate_size": cfg.ffn_dim,
        "moe_intermediate_size": cfg.expert_dim,
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(cfg.dense_layers),
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": False,
    }


def config_from_hf(d: Mapping[str, Any]) -> Config:
    """A ``Config`` from an HF ``Qwen3MoeConfig`` dict; refuses features this model does not have.

    HF makes layer ``i`` dense when it is in ``mlp_only_layers`` or when
    ``(i + 1) % decoder_sparse_step != 0``; those become ``dense_layers``.
    """
    required = ("intermediate_size", "moe_intermediate_size", "num_experts_per_tok")
    if absent := [k for k in required if k not in d]:
        raise ValueError(f"qwen3_moe: HF config lacks {absent}")
    common = qwen3.hf_common_from_hf(d, "qwen3_moe")
    n_experts = d.get("num_experts", d.get("num_local_experts", 0))
    if not n_experts:
        raise ValueError("qwen3_moe: HF config has num_experts=0 (every layer dense); load it as a qwen3 model")
    step = d.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"qwen3_moe: HF config decoder_sparse_step={step!r} must be an int >= 1")
    only = set(d.get("mlp_only_layers") or ())
    dense = [i for i in range(common["n_layers"]) if i in only or (i + 1) % step]
    return Config(
        **common,
        n_experts=n_experts,
        top_k=d["num_experts_per_tok"],
        expert_dim=d["moe_intermediate_size"],
        ffn_dim=d["intermediate_size"],
        dense_layers=tuple(dense),
        norm_topk=bool(d.get("norm_topk_prob", False)),  # HF's default is False; the published models set True
        aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
    )


hf.register_family(
    hf.Family(
        name="qwen3_moe",
        config_type=Config,
        model_type="qwen3_moe",
        model=model,
        weights=hf_weights,
        config_to_hf=config_to_hf,
        config_from_hf=config_from_hf,
        ignored=decoder.hf_ignored,
    )
)
