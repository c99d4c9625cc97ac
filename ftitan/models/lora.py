"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") as a model transform.

``lora(model, rank=, alpha=) -> Model``: the same family with each targeted
``(out, in)`` projection ``W`` replaced by ``W + (alpha / rank) * B @ A``,
``A`` ``(rank, in)`` drawn uniform in ``±1/sqrt(in)`` (PEFT's default
Kaiming-uniform) and ``B`` ``(out, rank)`` zeros, so the model at init
computes exactly what the base model does. ``apply`` merges the adapters
into the weights and calls the base model's ``apply``: no model code is
duplicated and the step compiles to one graph. (The merged weight's
gradient ``(out, in)`` is formed on the way to ``A``/``B``'s; the cost is a
full-rank weight gradient per target, not its optimizer state.)

Params tree::

    {"base": <the base model's params>,
     "lora": {"layers": {"0": {"attn": {"wq": {"A": (r, in), "B": (out, r)}, ...}, ...}, ...}}}

Train only the adapters with ``make_train_step(..., trainable=TRAINABLE)``
and ``init_state(params, opt, trainable=TRAINABLE)``: the base leaves get no
gradient, no optimizer state and stay the same tensors. ``merge(params,
scale=lm.config.scale)`` gives base-shaped params for export or generation.

>>> import torch, ftitan as ft
>>> from ftitan.models import llama, lora
>>> base = llama.model(llama.Config.debug())
>>> lm = lora.lora(base, rank=8, alpha=16.0)
>>> params = lm.init(ft.random.key(0))
>>> sorted(params)
['base', 'lora']
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ftitan import random, tree
from ftitan.models.base import Model

__all__ = ["DEFAULT_TARGETS", "TRAINABLE", "Config", "add_adapters", "load_peft", "lora", "merge", "merged_model",
           "save_peft"]  # fmt: skip

# attention and dense-MLP projections of every family: Llama / Qwen3 wq wk wv wo, w1 w2 w3; DeepSeek-V3's
# MLA wq (or wq_a, wq_b), wkv_a, wkv_b, wo. Only 2-D leaves are taken (norms are 1-D); routed experts
# (layers.*.moe.experts, 3-D) and shared experts are left out unless named in ``targets``
DEFAULT_TARGETS = ("layers.*.attn.*", "layers.*.mlp.*")
TRAINABLE = "lora.**"  # the adapters: make_train_step(..., trainable=TRAINABLE)


@attrs.frozen(kw_only=True)
class Config:
    """A LoRA model: the base config and the adapters' shape."""

    base: Any  # the base model's config
    rank: int  # r: rows of A, columns of B
    alpha: float  # the update is scaled by alpha / rank
    targets: tuple[str, ...] = DEFAULT_TARGETS  # globs over dotted param paths; only 2-D leaves qualify
    paths: tuple[str, ...] = ()  # the targeted leaves, resolved from targets (filled in by ``lora``)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def vocab_size(self) -> int:  # the base's sizes that generation and the trainer read
        return self.base.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.base.max_seq_len


def _targets(model: Model, targets: Sequence[str], explicit: bool) -> tuple[str, ...]:
    meta = model.init(random.key(0), device="meta")
    ps, ls, _ = tree.flatten_with_paths(meta)
    chosen = []
    for p, x in zip(ps, ls, strict=True):
        if any(tree.match(p, g) for g in targets):
            if x.dim() == 2:
                chosen.append(p)
            elif explicit and x.dim() > 2:  # 1-D norms / biases under a broad glob are skipped
                raise ValueError(
                    f"lora: {p} has shape {tuple(x.shape)}; LoRA adapts 2-D (out, in) projections only, "
                    f"narrow targets={tuple(targets)} to leave it out"
                )
    if not chosen:
        raise ValueError(f"lora: targets={tuple(targets)} select no 2-D param; paths look like {ps[:4]}")
    return tuple(chosen)


def _lookup(t: Any, path: str) -> Any:
    for k in path.split("."):
        t = t[k]
    return t


def add_adapters(cfg: Config, base_params: tree.Tree, key: torch.Tensor, *,
                 device: torch.device | str | None = None) -> dict[str, Any]:  # fmt: skip
    """LoRA params around ``base_params`` (e.g. a pretrained checkpoint): ``A`` at ``lora.<path>.A``
    drawn from ``random.fold_in(key, "lora.<path>.A")``, ``B`` zeros, in each weight's dtype and device
    (``device``: there instead, e.g. adapters drawn whole around a ``"meta"`` base, to shard after)."""
    adapters = {}
    for p in cfg.paths:
        w = _lookup(base_params, p)  # (out, in)
        out_dim, in_dim = w.shape
        where = w.device if device is None else device
        bound = 1.0 / math.sqrt(in_dim)
        a = random.uniform(random.fold_in(key, f"lora.{p}.A"), (cfg.rank, in_dim), low=-bound, high=bound,
                           dtype=w.dtype, device=where)  # fmt: skip
        b = torch.zeros(out_dim, cfg.rank, dtype=w.dtype, device=where)
        adapters[p] = {"A": a, "B": b}
    return {"base": base_params, "lora": tree.from_paths(adapters)}


def _tp_summed(x: torch.Tensor, logical: str | None) -> torch.Tensor:
    """``x`` whose gradient is summed over the tensor-parallel axes of ``logical`` (a no-op without a layout)."""
    from ftitan.parallel import activations  # ftitan.parallel imports the model families

    return x if logical is None else activations.tp_shared(x, logical)


def _is_adapter(node: Any) -> bool:
    return isinstance(node, Mapping) and isinstance(node.get("A"), torch.Tensor)


def _merged(base: Any, adapters: Mapping[str, Any], scale: float) -> Any:
    # plain dict recursion (compiles without graph breaks); a subtree the base lacks is skipped
    out = dict(base)
    for k, node in adapters.items():
        if k not in out:
            continue
        if _is_adapter(node):
            w = out[k]  # (out, in)
            out[k] = w + (scale * (node["B"] @ node["A"])).to(w.dtype)
        else:
            out[k] = _merged(out[k], node, scale)
    return out


def merge(params: Mapping[str, Any], *, scale: float) -> Any:
    """Base-shaped params ``W + scale * B @ A`` for every adapted ``W`` (``scale = lm.config.scale``),
    for export (``save_hf``) or generation with the base model."""
    return _merged(params["base"], params["lora"], scale)


def merged_model(lm: Model, params: Mapping[str, Any]) -> tuple[Model, Any]:
    """``(base model, merged params)`` of a LoRA model: what generation runs (the adapters folded
    into the weights once, instead of at every ``apply``)."""
    from ftitan.models import registry  # the family tables import every family

    return registry.model_for(lm.config.base), merge(params, scale=lm.config.scale)


def lora(model: Model, *, rank: int, alpha: float, targets: Sequence[str] | None = None) -> Model:
    """``model`` with LoRA adapters of rank ``rank`` on the leaves ``targets`` selects (default
    :data:`DEFAULT_TARGETS`), update scaled by ``alpha / rank``. See the module docstring."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"lora: rank={rank!r} must be a positive int")
    if not 0 < alpha < math.inf:
        raise ValueError(f"lora: alpha={alpha!r} must be a finite number > 0")
    globs = DEFAULT_TARGETS if targets is None else (targets,) if isinstance(targets, str) else tuple(targets)
    paths = _targets(model, globs, explicit=targets is not None)
    cfg = Config(base=model.config, rank=rank, alpha=float(alpha), targets=globs, paths=paths)
    scale = cfg.scale
    axes_of = {p: _lookup(model.param_axes, p) for p in paths}  # (out axis, in axis) of each W
    lora_axes = tree.from_paths({p: {"A": (None, ax[1]), "B": (ax[0], None)} for p, ax in axes_of.items()})

    def init(key: torch.Tensor, *, dtype: torch.dtype = torch.float32, device: Any = None) -> tree.Tree:
        return add_adapters(cfg, model.init(key, dtype=dtype, device=device), key)

    def summed(adapters: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        # under tensor parallelism a factor replicated over tp meets the other's tp-split dim: each rank's
        # W shard sees a part of its cotangent, so its gradient is summed over tp (as for QK-norm scales)
        out = {}
        for k, node in adapters.items():
            if _is_adapter(node):
                w_out, w_in = axes_of[prefix + k]
                out[k] = {"A": _tp_summed(node["A"], w_out), "B": _tp_summed(node["B"], w_in)}
            else:
                out[k] = summed(node, f"{prefix}{k}.")
        return out

    def apply(params: Mapping[str, Any], tokens: torch.Tensor, **kwargs: Any) -> Any:
        return model.apply(_merged(params["base"], summed(params["lora"]), scale), tokens, **kwargs)

    def head(params: Mapping[str, Any]) -> torch.Tensor:
        # only a top-level adapter (an adapted "head" / tied "embed") can change the head
        top = {k: v for k, v in params["lora"].items() if _is_adapter(v)}
        return model.head(_merged(params["base"], summed(top), scale))

    apply_with_aux = None
    if model.apply_with_aux is not None:
        base_aux = model.apply_with_aux

        def apply_with_aux(params: Mapping[str, Any], tokens: torch.Tensor, **kwargs: Any) -> Any:
            return base_aux(_merged(params["base"], summed(params["lora"]), scale), tokens, **kwargs)

    update_buffers = None
    if model.update_buffers is not None:
        base_update = model.update_buffers

        def update_buffers(params: Mapping[str, Any], metrics: dict[str, torch.Tensor]) -> Any:
            return {**params, "base": base_update(params["base"], metrics)}

    return Model(
        config=cfg,
        init=init,
        apply=apply,
        head=head,
        param_axes={"base": model.param_axes, "lora": lora_axes},
        flops_per_token=model.flops_per_token,  # the adapters' matmuls are O(rank / dim) of it
        apply_with_aux=apply_with_aux,
        frozen=tuple(f"base.{g}" for g in model.frozen),
        update_buffers=update_buffers,
        stage=None,  # pipeline stages slice the base layout; LoRA with pp > 1 is not supported yet
        logit_softcap=model.logit_softcap,
    )


# ---------------------------------------------------------------- PEFT adapter files

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> the transformers model


def _peft_names(cfg: Config) -> dict[str, str]:
    """ftitan target path -> the HF module name PEFT adapts (``model.layers.0.self_attn.q_proj``)."""
    from ftitan.models import hf  # the family tables import every family; loaded only for PEFT files

    maps = {m.path: m for m in hf.family_of(cfg.base).weights(cfg.base)}
    out = {}
    for p in cfg.paths:
        m = maps.get(p)
        if m is None or m.to_hf is not None or len(m.names) != 1 or not m.names[0].endswith(".weight"):
            raise ValueError(f"lora PEFT files: {p} is not a renamed HF linear weight; leave it out of targets")
        out[p] = m.names[0].removesuffix(".weight")
    return out


def _target_modules(cfg: Config) -> list[str] | str:
    """PEFT's ``target_modules``: the adapted modules' last names (``["q_proj", "v_proj"]``, what vLLM reads),
    or for MoE families, whose experts hold parameters of the same names (``mlp.experts.down_proj``) that
    PEFT would wrap too, a regex PEFT full-matches against exactly the adapted modules."""
    names = sorted(_peft_names(cfg).values())
    if getattr(cfg.base, "n_experts", 0):
        return "|".join(re.escape(n) for n in names)
    return sorted({n.rsplit(".", 1)[-1] for n in names})


def save_peft(params: Mapping[str, Any], cfg: Config, directory: str | os.PathLike[str]) -> Path:
    """Write the adapters as PEFT does (``adapter_config.json`` + ``adapter_model.safetensors``, keys
    ``base_model.model.<module>.lora_A.weight`` / ``lora_B``): loadable by ``PeftModel.from_pretrained``
    over the transformers model of ``cfg.base``."""
    import safetensors.torch

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for p, name in _peft_names(cfg).items():
        node = _lookup(params["lora"], p)
        for ab in ("A", "B"):
            state[f"{_PEFT_PREFIX}{name}.lora_{ab}.weight"] = node[ab].detach().to("cpu").contiguous()
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
        "target_modules": _target_modules(cfg),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": None,
    }  # fmt: skip
    safetensors.torch.save_file(state, str(out / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    (out / PEFT_CONFIG_FILE).write_text(json.dumps(peft_config, indent=2, sort_keys=True) + "\n")
    return out


def load_peft(
    directory: str | os.PathLike[str], model: Model, base_params: tree.Tree
) -> tuple[Model, dict[str, Any]]:
    """``(lora model, params)`` from a PEFT LoRA directory over ``model`` / ``base_params``. Targets are
    the modules the file holds (every one must map to a renamed HF linear weight of the family)."""
    import safetensors.torch

    d = Path(directory)
    peft_config = json.loads((d / PEFT_CONFIG_FILE).read_text())
    if peft_config.get("peft_type", "LORA") != "LORA" or peft_config.get("use_rslora") or peft_config.get("use_dora"):
        raise ValueError(f"load_peft: {d / PEFT_CONFIG_FILE}: only plain LoRA (no rsLoRA, no DoRA) is supported")
    state = safetensors.torch.load_file(str(d / PEFT_WEIGHTS_FILE))
    modules = sorted({k.removeprefix(_PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in state})
    rank, alpha = int(peft_config["r"]), float(peft_config["lora_alpha"])
    candidates = Config(base=model.config, rank=rank, alpha=alpha, paths=_all_linear(model))
    by_name = {v: k for k, v in _peft_names(candidates).items()}
    unknown = [m for m in modules if m not in by_name]
    if unknown:
        raise ValueError(f"load_peft: {unknown[:4]} are not LoRA-able weights of {type(model.config).__module__}")
    lm = lora(model, rank=rank, alpha=alpha, targets=[by_name[m] for m in modules])
    adapters = {}
    for m in modules:
        like = _lookup(base_params, by_name[m])
        adapters[by_name[m]] = {
            ab: state[f"{_PEFT_PREFIX}{m}.lora_{ab}.weight"].to(dtype=like.dtype, device=like.device) for ab in "AB"
        }
    return lm, {"base": base_params, "lora": tree.from_paths(adapters)}


def _all_linear(model: Model) -> tuple[str, ...]:
    """Every renamed 2-D weight of the model's HF table (the candidates a PEFT file may adapt)."""
    from ftitan.models import hf

    meta = dict(zip(*tree.flatten_with_paths(model.init(random.key(0), device="meta"))[:2], strict=True))
    return tuple(
        m.path for m in hf.family_of(model.config).weights(model.config)
        if m.to_hf is None and len(m.names) == 1 and m.path in meta and meta[m.path].dim() == 2
    )  # fmt: skip
