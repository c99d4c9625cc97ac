"""Hugging Face checkpoints: name tables, import/export, ``save_hf``/``load_hf``.

Each model family registers a :class:`Family`: its config class, HF
``model_type``/architecture, config converters, and ``weights(cfg)``, a list
of :class:`WeightMap` that ties every ftitan leaf path to one or more
checkpoint tensors. A plain rename is ``WeightMap(path, (name,))``; a leaf
that HF stores split (per-expert MoE weights, fused projections) gives
``to_hf``/``from_hf`` functions that split and join. Everything else here is
generic: name checks with clear errors, shape checks against the family's
meta-initialized params, safetensors I/O and atomic writes.

Two layouts of the same tensors: ``"checkpoint"``, the hub's files (what
``save_pretrained`` writes and ``from_pretrained`` / vLLM read: one tensor per
MoE expert, a tied head stored once), and ``"module"``, what a live
transformers 5 model's ``state_dict()`` holds (experts fused into
``experts.gate_up_proj`` (E, 2F, D) and ``experts.down_proj`` (E, D, F), the
tied ``lm_head.weight`` repeated). ``from_hf`` reads either;
``to_hf(..., layout="module")`` gives what ``hf_model.load_state_dict`` takes.

>>> from ftitan.models import llama, hf
>>> cfg = llama.Config.debug()
>>> state = hf.to_hf(params, cfg)                      # doctest: +SKIP
>>> hf.save_hf(params, cfg, "out/")                    # doctest: +SKIP
>>> cfg2, params2 = hf.load_hf("out/")                 # doctest: +SKIP
>>> cfg2, mine = hf.load_hf_sharded("out/", layout)    # doctest: +SKIP  (this rank's blocks only)
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import safetensors.torch
import torch

from ftitan import random, tree
from ftitan.models.base import Model

__all__ = [
    "Family",
    "Layout",
    "WeightMap",
    "cast_params",
    "check_names",
    "config_from_hf",
    "config_to_hf",
    "export_name",
    "families",
    "family_of",
    "from_hf",
    "load_hf",
    "load_hf_sharded",
    "per_layer",
    "permuted",
    "stacked",
    "register_family",
    "text_decoder",
    "unregister_family",
    "save_hf",
    "to_hf",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
HEAD_NAME = "lm_head.weight"  # the output projection of every HF *ForCausalLM

Layout = Literal["checkpoint", "module"]
LAYOUTS: tuple[str, ...] = ("checkpoint", "module")


@attrs.frozen(kw_only=True)
class WeightMap:
    """One ftitan leaf and the checkpoint tensor(s) it corresponds to."""

    path: str  # ftitan dotted leaf path, e.g. "layers.3.attn.wq"
    # checkpoint name(s), e.g. ("model.layers.3.self_attn.q_proj.weight",)
    names: tuple[str, ...] = attrs.field(converter=tuple)
    # leaf -> one tensor per name (split); None: the leaf itself
    to_hf: Callable[[torch.Tensor], Sequence[torch.Tensor]] | None = None
    # one tensor per name -> leaf (join); None: the single tensor itself
    from_hf: Callable[[Sequence[torch.Tensor]], torch.Tensor] | None = None
    # the leaf is the stack of its names' tensors of this shape (per-expert MoE weights, see
    # ``stacked``): a streaming load copies each into its row of the leaf; None: another join
    stack: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    # the leaf is these rows of its one checkpoint tensor, in this order (a row permutation, see ``permuted``):
    # a streaming load reads only the rows of its block; None: another join
    rows: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))


def per_layer(n_layers: int, table: Mapping[str, str]) -> list[WeightMap]:
    """Renames ``{path_template: name_template}`` with ``{i}`` expanded for each layer."""
    return [
        WeightMap(path=p.format(i=i), names=(n.format(i=i),)) for i in range(n_layers) for p, n in table.items()
    ]


def stacked(path: str, names: Sequence[str], shape: tuple[int, ...]) -> WeightMap:
    """A stacked ``(E, *shape)`` leaf (MoE experts) stored as ``E`` checkpoint tensors, one per name.

    Export hands out views of the leaf's rows (disjoint, so safetensors writes
    them without a copy); import checks each tensor's shape, naming it, then stacks.
    """
    names = tuple(names)

    def join(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        for name, t in zip(names, tensors, strict=True):
            if tuple(t.shape) != tuple(shape):
                raise ValueError(
                    f"{path} (from {name}): checkpoint shape {tuple(t.shape)}, config expects {tuple(shape)} per expert"
                )
        return torch.stack(tuple(tensors))

    return WeightMap(path=path, names=names, to_hf=lambda x: x.unbind(0), from_hf=join, stack=tuple(shape))


def permuted(path: str, name: str, rows: Sequence[int], *, hf_row: Sequence[int] | None = None) -> WeightMap:
    """A leaf whose row ``i`` is row ``rows[i]`` of checkpoint tensor ``name`` (``rows`` a permutation): e.g. the
    channels of a fused projection regrouped per head, so that a contiguous split keeps whole heads.
    ``hf_row``: the checkpoint's shape of one row where it differs from the leaf's flat rows (a Conv1d
    weight's ``(1, K)`` rows, held as ``(C, K)``)."""
    rows = tuple(int(r) for r in rows)
    if sorted(rows) != list(range(len(rows))):
        raise ValueError(f"permuted({path}): rows must be a permutation of range({len(rows)})")
    index = torch.tensor(rows)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(len(rows))

    def join(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        (t,) = tensors
        if t.shape[0] != len(rows) or (hf_row is not None and tuple(t.shape[1:]) != tuple(hf_row)):
            raise ValueError(f"{path} (from {name}): checkpoint shape {tuple(t.shape)}, config expects "
                             f"{(len(rows), *(hf_row or ('...',)))}")  # fmt: skip
        out = t[index.to(t.device)]
        return out if hf_row is None else out.reshape(len(rows), -1)

    def split(x: torch.Tensor) -> tuple[torch.Tensor]:
        out = x[inverse.to(x.device)]
        return (out if hf_row is None else out.reshape(len(rows), *hf_row),)

    return WeightMap(path=path, names=(name,), to_hf=split, from_hf=join, rows=rows)


@attrs.frozen(kw_only=True)
class Family:
    """What import/export needs to know about one model family."""

    name: str  # ftitan module name, e.g. "llama"
    config_type: type  # the family's Config class
    model_type: str  # HF config.json "model_type"
    model: Callable[[Any], Model]  # cfg -> Model
    weights: Callable[[Any], list[WeightMap]]  # cfg -> name table covering every param leaf
    config_to_hf: Callable[[Any], dict[str, Any]]  # cfg -> HF config.json dict (with model_type, architectures)
    config_from_hf: Callable[[Mapping[str, Any]], Any]  # HF config dict -> cfg
    ignored: Callable[[Any], tuple[str, ...]] = lambda _cfg: ()  # checkpoint name globs skipped on import
    # HF tensors of zero size with no ftitan leaf (DeepSeek-V3's shared experts when n_shared_experts=0):
    # name -> shape; to_hf writes them, from_hf accepts them when empty
    empty: Callable[[Any], dict[str, tuple[int, ...]]] = lambda _cfg: {}
    # what export writes in place of the table's leading "model." (MULTIMODAL_TEXT: a *ForConditionalGeneration's
    # text decoder, for families whose HF class is only multimodal; import reads either, see text_decoder);
    # None: the table's names as they are
    export_prefix: str | None = None


_BY_CONFIG: dict[type, Family] = {}
_BY_MODEL_TYPE: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Make a family known to ``to_hf``/``from_hf``/``load_hf`` (by config class and model_type)."""
    _BY_CONFIG[family.config_type] = family
    _BY_MODEL_TYPE[family.model_type] = family
    return family


def unregister_family(family: Family) -> None:
    """Undo :func:`register_family` (a family registered for a while, e.g. by a test)."""
    if _BY_CONFIG.get(family.config_type) is family:
        del _BY_CONFIG[family.config_type]
    if _BY_MODEL_TYPE.get(family.model_type) is family:
        del _BY_MODEL_TYPE[family.model_type]


def families() -> list[Family]:
    """Every registered family (one per config class)."""
    return list(_BY_CONFIG.values())


def family_of(cfg_or_model_type: Any) -> Family:
    """The registered family of a config instance, or of an HF ``model_type`` string."""
    if isinstance(cfg_or_model_type, str):
        fam = _BY_MODEL_TYPE.get(cfg_or_model_type)
        known = sorted(_BY_MODEL_TYPE)
    else:
        fam = _BY_CONFIG.get(type(cfg_or_model_type))
        known = sorted(t.__module__ + "." + t.__qualname__ for t in _BY_CONFIG)
    if fam is None:
        raise ValueError(f"no HF family registered for {cfg_or_model_type!r}; known: {known}")
    return fam


def config_to_hf(cfg: Any) -> dict[str, Any]:
    """HF ``config.json`` contents for a ftitan config."""
    return family_of(cfg).config_to_hf(cfg)


def config_from_hf(hf_config: Mapping[str, Any]) -> Any:
    """A ftitan config from an HF ``config.json`` dict (family chosen by ``model_type``)."""
    if "model_type" not in hf_config:
        raise ValueError("HF config has no 'model_type'; cannot tell which model family it is")
    return family_of(hf_config["model_type"]).config_from_hf(hf_config)


def _glob_match(name: str, patterns: Sequence[str]) -> bool:
    return any(tree.match(name, p) for p in patterns)


def _listing(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _table(family: Family, cfg: Any, param_paths: Sequence[str]) -> list[WeightMap]:
    maps = family.weights(cfg)
    covered = [m.path for m in maps]
    missing = sorted(set(param_paths) - set(covered))
    extra = sorted(set(covered) - set(param_paths))
    if missing or extra or len(covered) != len(set(covered)):
        raise ValueError(
            f"{family.name} HF name table does not match the params: no entry for [{_listing(missing)}], "
            f"entries for unknown leaves [{_listing(extra)}]; fix {family.name}'s weights(cfg)"
        )
    return maps


def export_name(family: Family, name: str) -> str:
    """The checkpoint name export writes for the name table's ``name``: ``model.X`` ->
    ``{family.export_prefix}X`` when the family has one (``lm_head.weight`` and others unchanged)."""
    if family.export_prefix is None or not name.startswith("model."):
        return name
    return family.export_prefix + name[len("model.") :]


def to_hf(params: tree.Tree, cfg: Any, *, layout: Layout = "checkpoint") -> dict[str, torch.Tensor]:
    """HF-named tensors for a params tree, in ``layout`` (see the module docstring): ``"checkpoint"``
    (hub files: per-expert tensors, tied weights once) or ``"module"`` (a live transformers 5 model's
    ``state_dict()``: fused experts, the tied head repeated; for ``hf_model.load_state_dict``). Names
    are the family's table's, moved under ``Family.export_prefix`` where it has one (:func:`export_name`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"to_hf: layout={layout!r}; expected one of {LAYOUTS}")
    family = family_of(cfg)
    paths, leaves, _ = tree.flatten_with_paths(params)
    flat = dict(zip(paths, leaves, strict=True))
    out: dict[str, torch.Tensor] = {}
    for m in _table(family, cfg, paths):
        tensors = tuple(m.to_hf(flat[m.path])) if m.to_hf else (flat[m.path],)
        if len(tensors) != len(m.names):
            raise ValueError(f"{m.path}: to_hf gave {len(tensors)} tensors for {len(m.names)} names {m.names}")
        out.update(zip(m.names, tensors, strict=True))
    like = flat[paths[0]]
    out.update({n: like.new_zeros(shape) for n, shape in family.empty(cfg).items()})
    if family.export_prefix is not None:
        out = {export_name(family, n): t for n, t in out.items()}
    if layout == "checkpoint":
        return out
    if HEAD_NAME not in out:  # tied: the live module holds the embedding under the head's name too
        out[HEAD_NAME] = family.model(cfg).head(params)
    return _fuse_experts(out)


# transformers 5 keeps a MoE layer's experts as two 3-D parameters, the hub files one tensor per expert
_EXPERT = re.compile(r"(?P<pre>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(?P<pre>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)")


def _fuse_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``{pre}.{e}.{gate,up,down}_proj.weight`` -> ``{pre}.gate_up_proj`` (E, 2F, D), gate
    rows first, and ``{pre}.down_proj`` (E, D, F), as transformers 5 holds them in memory."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in state.items():
        if m := _EXPERT.fullmatch(name):
            experts.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["e"])] = t
        else:
            out[name] = t
    for pre, projs in experts.items():
        n = len(projs["down_proj"])
        rows = {p: [projs[p][e] for e in range(n)] for p in ("gate_proj", "up_proj", "down_proj")}
        out[f"{pre}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(rows["gate_proj"], rows["up_proj"])])
        out[f"{pre}.down_proj"] = torch.stack(rows["down_proj"])
    return out


def _unfuse_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_fuse_experts` (views, no copies); other names pass through."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _FUSED.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        if t.dim() != 3 or (m["proj"] == "gate_up_proj" and t.shape[1] % 2):
            raise ValueError(
                f"{name}: shape {tuple(t.shape)}; transformers 5 fused experts are (E, 2F, D) gate_up_proj and "
                f"(E, D, F) down_proj tensors"
            )
        if m["proj"] == "gate_up_proj":  # gate rows first, as transformers' forward chunks them
            gate, up = t.chunk(2, dim=1)
            parts = {"gate_proj": gate, "up_proj": up}
        else:
            parts = {"down_proj": t}
        for proj, stacked in parts.items():
            out.update({f"{m['pre']}.{e}.{proj}.weight": w for e, w in enumerate(stacked.unbind(0))})
    return out


MULTIMODAL_TEXT = "model.language_model."  # transformers 5 *ForConditionalGeneration: the text decoder's tensors


def text_decoder(state: Mapping[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's text decoder under the ``*ForCausalLM`` names (``model.language_model.X`` ->
    ``model.X``, the other towers such as ``model.visual.*`` left out); any other checkpoint unchanged."""
    if not any(n.startswith(MULTIMODAL_TEXT) for n in state):
        return dict(state)
    out = {}
    for name, t in state.items():
        if name.startswith(MULTIMODAL_TEXT):
            out["model." + name[len(MULTIMODAL_TEXT) :]] = t
        elif not name.startswith("model."):  # lm_head, MTP heads
            out[name] = t
    return out


def from_hf(
    state_dict: Mapping[str, torch.Tensor],
    cfg: Any,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tree.Tree:
    """A params tree from HF-named tensors in either layout (hub files, or a live transformers 5
    model's ``state_dict()`` with fused experts); errors name every missing, unexpected or misshapen
    tensor.

    ``dtype`` (default: as stored) converts floating-point leaves to what ``init(dtype=dtype)``
    would give (leaves a family keeps in float32, such as DeepSeek-V3's routing bias, stay float32);
    ``device`` (default: as stored) moves every leaf.
    """
    family = family_of(cfg)
    expected = family.model(cfg).init(random.key(0), dtype=dtype or torch.float32, device="meta")
    paths, meta_leaves, treedef = tree.flatten_with_paths(expected)
    maps = _table(family, cfg, paths)
    state = text_decoder(_unfuse_experts(state_dict))
    check_names(family, cfg, maps, {n: tuple(t.shape) for n, t in state.items()})
    by_path = {}
    for m in maps:
        tensors = tuple(state[n] for n in m.names)
        by_path[m.path] = m.from_hf(tensors) if m.from_hf else tensors[0]
    leaves = []
    for path, meta in zip(paths, meta_leaves, strict=True):
        x = by_path[path]
        if tuple(x.shape) != tuple(meta.shape):
            names = next(m.names for m in maps if m.path == path)
            raise ValueError(
                f"{path} (from {', '.join(names)}): checkpoint shape {tuple(x.shape)}, "
                f"config expects {tuple(meta.shape)}"
            )
        leaves.append(_cast_leaf(x, meta, dtype, device))
    return tree.unflatten(treedef, leaves)


def _cast_leaf(x: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None, device: Any) -> torch.Tensor:
    # a floating leaf takes the dtype init(dtype=dtype) gives it (``like``), so float32-kept leaves stay float32
    return x.to(dtype=like.dtype if dtype is not None and x.is_floating_point() else None, device=device)


def cast_params(
    model: Model, params: tree.Tree, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tree.Tree:
    """``params`` in the dtypes ``model.init(dtype=dtype)`` gives (unchanged without ``dtype``), on
    ``device``: the conversion :func:`from_hf` applies, for params from elsewhere (a run's checkpoint)."""
    if dtype is None and device is None:
        return params
    like = model.init(random.key(0), dtype=dtype or torch.float32, device="meta")
    return tree.map(lambda x, m: _cast_leaf(x, m, dtype, device), params, like)


def check_names(family: Family, cfg: Any, maps: Sequence[WeightMap], shapes: Mapping[str, Sequence[int]]) -> None:
    """Raise naming every missing or unexpected checkpoint tensor (``shapes``: name -> shape, in the
    hub's per-expert names), and any of the family's zero-size tensors that is not empty."""
    for name, shape in family.empty(cfg).items():
        if name in shapes and math.prod(shapes[name]):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(shapes[name])}, the config expects an empty {shape} "
                f"tensor; is the config the checkpoint's own?"
            )
    known = {n for m in maps for n in m.names} | set(family.empty(cfg))
    ignored = family.ignored(cfg)
    missing = [n for m in maps for n in m.names if n not in shapes]
    unexpected = sorted(n for n in shapes if n not in known and not _glob_match(n, ignored))
    if missing or unexpected:
        raise KeyError(
            f"checkpoint does not match {family.name} config: missing [{_listing(missing)}]; "
            f"unexpected [{_listing(unexpected)}]. Is it the same architecture "
            f"(n_layers, tie_embeddings) as the config?"
        )


def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
    # a unique hidden name in the same directory (same filesystem, so the rename is atomic);
    # created by `write` itself so the file gets the usual permissions, not mkstemp's 0600
    tmp = str(path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"))
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _dtype_name(params: tree.Tree) -> str | None:
    floats = [x for x in tree.leaves(params) if tree.is_tensor(x) and x.is_floating_point()]
    return str(floats[0].dtype).removeprefix("torch.") if floats else None


def save_hf(params: tree.Tree, cfg: Any, directory: str | os.PathLike[str]) -> Path:
    """Write ``model.safetensors`` and ``config.json`` loadable by ``transformers.from_pretrained``.

    Each file is written to a temporary name and renamed into place; the
    config is written last, so a directory with a config has its weights.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {n: t.detach().to("cpu").contiguous() for n, t in to_hf(params, cfg).items()}
    if any(t.device.type == "meta" for t in state.values()):
        raise ValueError("save_hf: params are on the meta device (shapes only); initialize or load them first")
    hf_config = dict(config_to_hf(cfg))
    if (dtype := _dtype_name(params)) is not None:
        hf_config["dtype"] = dtype
    _atomic_write(out / WEIGHTS_FILE, lambda p: safetensors.torch.save_file(state, p, metadata={"format": "pt"}))
    config_text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    _atomic_write(out / CONFIG_FILE, lambda p: Path(p).write_text(config_text))
    return out


def _read_weights(directory: Path, device: torch.device | str | None) -> dict[str, torch.Tensor]:
    dev = str(device) if device is not None else "cpu"
    single, index = directory / WEIGHTS_FILE, directory / WEIGHTS_INDEX_FILE
    if single.exists():
        return safetensors.torch.load_file(single, device=dev)
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(safetensors.torch.load_file(directory / shard, device=dev))
        return state
    raise FileNotFoundError(f"{directory}: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE} found")


def load_hf(
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[Any, tree.Tree]:
    """``(cfg, params)`` from an HF model directory (``config.json`` + safetensors, single or sharded)."""
    d = Path(directory)
    config_path = d / CONFIG_FILE
    if not config_path.exists():
        raise FileNotFoundError(f"{d}: no {CONFIG_FILE}; is this an HF model directory?")
    cfg = config_from_hf(json.loads(config_path.read_text()))
    return cfg, from_hf(_read_weights(d, device), cfg, dtype=dtype, device=device)


def load_hf_sharded(
    directory: str | os.PathLike[str],
    layout: Any = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[Any, tree.Tree]:
    """``(cfg, params)`` from an HF model directory, each leaf read by block (``safe_open().get_slice``).

    Without ``layout``: the same params as :func:`load_hf` (equal values and dtypes, on ``device``,
    default the CPU), each leaf allocated once in its final dtype; a stacked MoE leaf is filled expert
    by expert (hub per-expert tensors or transformers 5's fused ``experts.gate_up_proj`` /
    ``experts.down_proj``), never holding the experts twice. With a ``parallel.Layout`` (or a
    ``DeviceMesh``, placed by the default rules): this rank's DTensors, as
    ``shard_params(stage_params(load_hf(...)))`` places them (its pipeline stage only under
    ``pp > 1``), reading only the blocks it holds, on ``device`` (default: the layout's).
    ``dtype`` converts as :func:`from_hf` does (DeepSeek-V3's routing bias stays float32). See
    :mod:`ftitan.models.hf_stream`.
    """
    from ftitan.models import hf_stream  # it builds on this module's tables

    return hf_stream.load_sharded(directory, layout, dtype=dtype, device=device)
