"""Routing parameters to different transforms by label (optax's ``multi_transform``).

Every leaf gets a string label, resolved in Python from its dotted path and
shape (static under ``torch.compile``); each label's transform sees a flat
``{dotted path: leaf}`` dict of just its leaves. Flat dicts rather than
``partition``'s ``None`` placeholders: dynamo cannot unflatten those.

>>> import torch, ftitan.optim as fo
>>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
>>> opt = fo.multi_transform(
...     {"matrix": fo.sgd(0.1), "vector": fo.sgd(0.0)},
...     lambda path, x: "matrix" if x.ndim == 2 else "vector",
... )
>>> updates, _ = opt.update({"w": torch.ones(2, 2), "b": torch.ones(2)}, opt.init(params), params)
>>> updates["b"], updates["w"][0]
(tensor([-0., -0.]), tensor([-0.1000, -0.1000]))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import torch

from ftitan import tree
from ftitan.optim.transform import Params, State, Transform, Updates

__all__ = ["Labels", "MultiTransformState", "multi_transform", "resolve_labels"]

Labels = Callable[[str, torch.Tensor], str] | Callable[[Params], Any] | Any
"""``(params) -> tree of str``, ``(path, leaf) -> str``, or a tree of str."""


class MultiTransformState(NamedTuple):
    inner_states: dict[str, State]  # label -> that transform's state over its flat dict


def _positional_arity(fn: Callable[..., Any]) -> int | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in sig.parameters.values() if p.kind in kinds and p.default is p.empty]
    return len(required)


def _is_per_leaf(labels: Labels) -> bool:
    return callable(labels) and _positional_arity(labels) == 2


def resolve_labels(labels: Labels, params: Params, *, per_leaf: bool | None = None) -> list[tuple[str, str]]:
    """``[(path, label), ...]`` over the leaves of ``params`` in tree order.

    A ``(path, leaf) -> str`` function is called leaf by leaf, building no
    tree: under dynamo, unflattening a tree of str leaves fails.
    """
    paths, leaves_, _ = tree.flatten_with_paths(params)
    if per_leaf is None:
        per_leaf = _is_per_leaf(labels)
    if per_leaf:
        per_leaf_fn = cast(Callable[[str, Any], str], labels)
        found = [per_leaf_fn(p, x) for p, x in zip(paths, leaves_, strict=True)]
    else:
        label_tree = cast(Callable[[Params], Any], labels)(params) if callable(labels) else labels
        if torch.compiler.is_compiling():
            # dynamo cannot flatten a tree of str with paths; the eager init checked them
            found = tree.leaves(label_tree)
            if len(found) != len(paths):
                raise ValueError(f"labels: {len(found)} labels for {len(paths)} params")
            return list(zip(paths, found, strict=True))
        label_paths, found, _ = tree.flatten_with_paths(label_tree)
        if label_paths != paths:
            missing = sorted(set(paths) - set(label_paths))
            extra = sorted(set(label_paths) - set(paths))
            raise ValueError(
                f"labels do not match the params tree: unlabelled paths {missing[:5]}, "
                f"labels for absent paths {extra[:5]}; the labels tree must have the params' structure"
            )
    for path, label in zip(paths, found, strict=True):
        if not isinstance(label, str):
            raise ValueError(f"{path}: label {label!r} is a {type(label).__name__}; labels must be str")
    return list(zip(paths, found, strict=True))


def _label_lookup(label_tree: Any) -> Callable[[str, Any], str]:
    """A labels tree as a ``(path, leaf) -> str`` lookup, flattened now, outside any
    compiled code (dynamo cannot flatten a captured constant dict of str)."""
    label_paths, found, _ = tree.flatten_with_paths(label_tree)
    by_path = dict(zip(label_paths, found, strict=True))

    def lookup(path: str, leaf: Any) -> str:
        del leaf
        if path not in by_path:
            raise ValueError(
                f"{path}: not in the labels tree (it labels {sorted(by_path)[:8]}); "
                "the labels tree must have the params' structure"
            )
        return by_path[path]

    return lookup


def multi_transform(transforms: Mapping[str, Transform], labels: Labels) -> Transform:
    """Applies ``transforms[label]`` to the leaves with that label.

    ``labels`` is ``(path, leaf) -> str``, ``(params) -> tree of str``, or a
    tree of str with the params' structure; all three work inside a compiled
    step as long as building the labels does (a callable that builds its tree
    with ``tree.map_with_path`` does not: dynamo cannot unflatten str leaves,
    so prefer the per-leaf form). A label missing from ``transforms`` raises
    a ValueError naming the path; labels without leaves are allowed (their
    transform sees an empty dict).
    """
    transforms = dict(transforms)
    if not callable(labels):
        labels = _label_lookup(labels)
    per_leaf = _is_per_leaf(labels)  # inspect here: dynamo need not trace inspect.signature
    for name, t in transforms.items():
        if not isinstance(t, Transform):
            raise TypeError(f"multi_transform: transforms[{name!r}] is a {type(t).__name__}, not a Transform")

    def groups(t: Any) -> tuple[list[tuple[str, str]], dict[str, dict[str, Any]]]:
        pairs = resolve_labels(labels, t, per_leaf=per_leaf)
        by_label: dict[str, dict[str, Any]] = {name: {} for name in transforms}
        leaves_ = tree.leaves(t)
        for (path, label), leaf in zip(pairs, leaves_, strict=True):
            if label not in transforms:
                raise ValueError(
                    f"{path}: label {label!r} has no transform; known labels are "
                    f"{sorted(transforms)}. Add a transform for it or change the labels."
                )
            by_label[label][path] = leaf
        return pairs, by_label

    def init(params: Params) -> MultiTransformState:
        _, by_label = groups(params)
        return MultiTransformState({name: t.init(by_label[name]) for name, t in transforms.items()})

    def update(
        grads: Updates, state: MultiTransformState, params: Params | None = None
    ) -> tuple[Updates, MultiTransformState]:
        pairs, grads_by_label = groups(grads)
        treedef = tree.structure(grads)
        params_by_label = None if params is None else groups(params)[1]
        new_states: dict[str, State] = {}
        flat_updates: dict[str, Any] = {}
        for name, t in transforms.items():
            sub_params = None if params_by_label is None else params_by_label[name]
            sub_updates, new_states[name] = t.update(grads_by_label[name], state.inner_states[name], sub_params)
            flat_updates.update(sub_updates)
        return tree.unflatten(treedef, [flat_updates[path] for path, _ in pairs]), MultiTransformState(new_states)

    return Transform(init, update)
