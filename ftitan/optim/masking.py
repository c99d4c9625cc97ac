"""``masked``: apply a transform to the leaves a mask selects (optax's ``masked``).

Masks are glob pattern(s) over the params' dotted paths (``"layers.*.attn.w?"``;
``*`` is one path component, ``**`` any number) or a predicate
``(path, leaf) -> bool``. Paths are the full dotted paths from the root of
the params tree, inside a ``multi_transform`` label too (its transforms see
flat ``{dotted path: leaf}`` dicts), so a glob selects the same leaves
wherever it is used. A glob that selects no leaf raises at ``init``.

>>> import torch, ftitan.optim as fo
>>> params = {"layer": {"w": torch.ones(2), "b": torch.ones(2)}}
>>> opt = fo.masked(fo.adam(0.1), "layer.w")
>>> list(opt.init(params).inner_state[0].mu)  # Adam moments for the selected leaf only
['layer.w']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from ftitan import tree
from ftitan.optim.transform import Params, State, Transform, Updates
from ftitan.optim.weight_decay import Mask, _mask_fn

__all__ = ["MaskedState", "check_mask_matches", "masked", "merge", "subset"]


class MaskedState(NamedTuple):
    inner_state: State  # the inner transform's state over the selected leaves only ({path: leaf})


def check_mask_matches(mask: Mask, params: Params, who: str) -> None:
    """Raises if a glob in ``mask`` selects no leaf of ``params``, naming the glob and some paths."""
    if callable(mask) and not isinstance(mask, str):
        return
    globs = [mask] if isinstance(mask, str) else list(mask)
    paths = tree.paths(params)
    for glob in globs:
        if not any(tree.match(p, glob) for p in paths):
            shown = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
            raise ValueError(
                f"{who}: glob {glob!r} matches no parameter path (paths here: {shown or 'none'}). "
                "'*' is one path component and '**' any number ('**' or 'layer.*' for nested leaves); "
                "fix the glob or drop it"
            )


def _select(mask: Mask, params: Params) -> tuple[list[str], list[bool]]:
    """``(paths, selected flags)`` over the leaves of ``params`` (static: paths and shapes)."""
    pred = _mask_fn(mask)
    paths, leaves_, _ = tree.flatten_with_paths(params)
    return paths, [bool(pred(p, x)) for p, x in zip(paths, leaves_, strict=True)]


def subset(mask: Mask, t: Any) -> dict[str, Any]:
    """The leaves of ``t`` that ``mask`` selects, as a flat ``{dotted path: leaf}`` dict: what
    ``masked``'s inner transform and ``make_train_step(trainable=...)``'s optimizer see."""
    paths, keep = _select(mask, t)
    return {p: x for p, x, k in zip(paths, tree.leaves(t), keep, strict=True) if k}


def merge(t: Any, flat: Mapping[str, Any]) -> Any:
    """``t`` with the leaves at ``flat``'s dotted paths replaced by ``flat``'s values (the inverse of
    :func:`subset`: ``merge(t, subset(mask, t))`` is ``t``)."""
    paths, leaves_, treedef = tree.flatten_with_paths(t)
    return tree.unflatten(treedef, [flat[p] if p in flat else x for p, x in zip(paths, leaves_, strict=True)])


def masked(inner: Transform, mask: Mask) -> Transform:
    """Applies ``inner`` to the leaves ``mask`` selects; the others' updates pass unchanged.

    ``inner`` sees (and its state holds) a flat ``{dotted path: leaf}`` dict
    of the selected leaves only: masked-out leaves get no optimizer state.
    optax: ``optax.masked``.
    """
    if not isinstance(inner, Transform):
        raise TypeError(f"masked: inner is a {type(inner).__name__}, not a Transform")
    _mask_fn(mask)  # validates the mask's type now

    def init(params: Params) -> MaskedState:
        check_mask_matches(mask, params, "masked")
        return MaskedState(inner.init(subset(mask, params)))

    def update(grads: Updates, state: MaskedState, params: Params | None = None) -> tuple[Updates, MaskedState]:
        sub_params = None if params is None else subset(mask, params)
        sub_updates, inner_state = inner.update(subset(mask, grads), state.inner_state, sub_params)
        return merge(grads, sub_updates), MaskedState(inner_state)

    return Transform(init, update)
