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

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ftitan import tree
from ftitan.optim.transform import Params, State, Transform, Updates
from ftitan.optim.weight_decay import Mask, _mask_fn

__all__ = ["MaskedState", "check_mask_matches", "masked", "select"]


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


def select(mask: Mask, params: Params) -> tuple[list[str], list[bool], Callable[[str, Any], bool]]:
    """``(paths, selected flags, predicate)`` over the leaves of ``params`` (static: paths and shapes)."""
    pred = _mask_fn(mask)
    paths, leaves_, _ = tree.flatten_with_paths(params)
    return paths, [bool(pred(p, x)) for p, x in zip(paths, leaves_, strict=True)], pred


def _subset(t: Any, keep: Sequence[bool], paths: Sequence[str]) -> dict[str, Any]:
    return {p: x for p, x, k in zip(paths, tree.leaves(t), keep, strict=True) if k}


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
        paths, keep, _ = select(mask, params)
        return MaskedState(inner.init(_subset(params, keep, paths)))

    def update(grads: Updates, state: MaskedState, params: Params | None = None) -> tuple[Updates, MaskedState]:
        paths, keep, _ = select(mask, grads)
        sub_params = None if params is None else _subset(params, keep, paths)
        sub_updates, inner_state = inner.update(_subset(grads, keep, paths), state.inner_state, sub_params)
        leaves_, treedef = tree.flatten(grads)
        out = [sub_updates[p] if k else g for p, g, k in zip(paths, leaves_, keep, strict=True)]
        return tree.unflatten(treedef, out), MaskedState(inner_state)

    return Transform(init, update)
