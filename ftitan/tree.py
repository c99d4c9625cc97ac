"""Pytree helpers: one optree namespace for the whole project.

Parameter trees are nested ``dict[str, Tensor | dict]``; their flattened
paths are dotted names (``layers.3.attn.wq``) that map 1:1 onto checkpoint
names. Every tree operation in ftitan goes through this module so that the
namespace, the ``None`` convention and path formatting stay in one place.

``None`` is an empty subtree (not a leaf), which is what ``partition`` uses to
mark the leaves it did not select, as in equinox.

Custom nodes are registered with :func:`register_node`, which registers them
with optree (under :data:`NAMESPACE`) *and* with ``torch.utils._pytree``:
``torch.func`` only sees the latter, and dynamo traces both.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

NAMESPACE = "ftitan"

Tree = Any
PathPredicate = Callable[[str, Any], bool]

__all__ = [
    "NAMESPACE",
    "NotPartitionable",
    "as_part_of",
    "cast",
    "combine",
    "flatten",
    "flatten_with_paths",
    "from_paths",
    "global_norm",
    "norm_across",
    "norm_is_combined",
    "is_tensor",
    "leaves",
    "map",
    "map_with_path",
    "match",
    "nbytes",
    "norm_dtype",
    "partition",
    "paths",
    "register_node",
    "size",
    "squares",
    "stack",
    "structure",
    "unflatten",
    "unstack",
    "whole_of",
    "zeros_like",
]


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _path_str(path: Sequence[Any]) -> str:
    return ".".join(str(k) for k in path)


def flatten(tree: Tree) -> tuple[list[Any], Any]:
    """``(leaves, treedef)``; ``None`` counts as an empty subtree."""
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def unflatten(treedef: Any, leaves: Iterable[Any]) -> Tree:
    return optree.tree_unflatten(treedef, list(leaves))


def leaves(tree: Tree) -> list[Any]:
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def structure(tree: Tree) -> Any:
    return optree.tree_structure(tree, namespace=NAMESPACE)


def flatten_with_paths(tree: Tree) -> tuple[list[str], list[Any], Any]:
    """``(paths, leaves, treedef)`` with dotted paths such as ``layers.0.attn.wq``."""
    raw, leaves_, treedef = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return [_path_str(p) for p in raw], leaves_, treedef


def paths(tree: Tree) -> list[str]:
    return flatten_with_paths(tree)[0]


def from_paths(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dicts from ``{dotted path: leaf}``: ``{"a.b": x}`` -> ``{"a": {"b": x}}`` (the inverse of
    ``dict(zip(*flatten_with_paths(tree)[:2]))`` for a tree of dicts)."""
    out: dict[str, Any] = {}
    for path, x in flat.items():
        *parents, last = path.split(".")
        node = out
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = x
    return out


def map(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:  # noqa: A001 - mirrors jax.tree.map
    """``fn`` applied leafwise over ``tree`` and trees of the same structure."""
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def map_with_path(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """Like :func:`map` but ``fn(path, leaf, *others)`` also gets the dotted path."""
    # flatten + unflatten rather than optree.tree_map_with_path: dynamo's
    # polyfill of the latter calls fn on None subtrees
    ps, ls, treedef = flatten_with_paths(tree)
    others = [treedef.flatten_up_to(r) for r in rest]
    return unflatten(treedef, [fn(p, *xs) for p, *xs in zip(ps, ls, *others, strict=True)])


def _compile_pattern(pattern: str) -> re.Pattern[str]:
    # glob over dotted paths: "*" stays within one component, "**" spans several; "**." (at the
    # start or after a ".") spans zero or more whole components, so "**.b" matches "b" and "a.b"
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**.", i) and (i == 0 or pattern[i - 1] == "."):
            out.append(r"(?:.*\.)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append(r"[^.]*")
            i += 1
        else:
            out.append(re.escape(pattern[i]) if pattern[i] != "?" else r"[^.]")
            i += 1
    return re.compile("".join(out) + r"\Z")


def match(path: str, pattern: str) -> bool:
    """Whether a dotted path matches a glob: ``*`` is one component, ``**`` any number.

    ``**.`` also matches zero components: ``**.b`` selects ``b`` at the top and at any depth,
    ``layers.**.wq`` selects ``layers.wq`` too.

    >>> match("layers.3.attn.wq", "layers.*.attn.w?")
    True
    >>> match("layers.3.attn.wq", "**.wq")
    True
    """
    return _compile_pattern(pattern).match(path) is not None


def _as_predicate(where: PathPredicate | str | Sequence[str]) -> PathPredicate:
    if isinstance(where, str):
        where = [where]
    if isinstance(where, (list, tuple)):
        compiled = [_compile_pattern(p) for p in where]
        return lambda path, _leaf: any(c.match(path) for c in compiled)
    if callable(where):
        return where
    raise TypeError(
        f"where={where!r}: expected a predicate (path, leaf) -> bool, a glob pattern, "
        "or a list of glob patterns"
    )


def partition(tree: Tree, where: PathPredicate | str | Sequence[str]) -> tuple[Tree, Tree]:
    """Split ``tree`` into ``(selected, rest)``; unselected leaves become ``None``.

    ``where`` is a predicate ``(path, leaf) -> bool`` or glob pattern(s) over
    dotted paths. ``combine(selected, rest)`` gives ``tree`` back.

    Use it at boundaries (around a compiled step, not inside it): dynamo's
    optree polyfill cannot unflatten ``None`` placeholders. Inside compiled
    code, select leaves by path into a flat ``{path: leaf}`` dict instead,
    as ``ftitan.optim.multi_transform`` does.
    """
    pred = _as_predicate(where)
    ps, ls, treedef = flatten_with_paths(tree)
    keep = [bool(pred(p, x)) for p, x in zip(ps, ls, strict=True)]
    selected = unflatten(treedef, [x if k else None for x, k in zip(ls, keep, strict=True)])
    rest = unflatten(treedef, [None if k else x for x, k in zip(ls, keep, strict=True)])
    return selected, rest


def combine(*trees: Tree) -> Tree:
    """Inverse of :func:`partition`: leafwise, the first non-``None`` value wins."""
    if not trees:
        raise ValueError("combine() needs at least one tree")

    def first(*xs: Any) -> Any:
        for x in xs:
            if x is not None:
                return x
        return None

    # None must be a leaf here so the trees line up position by position
    return optree.tree_map(first, *trees, none_is_leaf=True, namespace=NAMESPACE)


def cast(tree: Tree, dtype: torch.dtype, *, where: PathPredicate | str | Sequence[str] | None = None) -> Tree:
    """Floating-point tensors (optionally only those ``where`` selects) cast to ``dtype``."""
    pred = _as_predicate(where) if where is not None else (lambda _p, _x: True)

    def one(path: str, x: Any) -> Any:
        if is_tensor(x) and x.is_floating_point() and pred(path, x):
            return x.to(dtype)
        return x

    return map_with_path(one, tree)


def size(tree: Tree) -> int:
    """Total number of elements over tensor leaves (works on meta tensors)."""
    return sum(x.numel() for x in leaves(tree) if is_tensor(x))


def nbytes(tree: Tree) -> int:
    """Total bytes over tensor leaves (works on meta tensors)."""
    return sum(x.numel() * x.element_size() for x in leaves(tree) if is_tensor(x))


def global_norm(tree: Tree) -> torch.Tensor:
    """L2 norm over all tensor leaves, accumulated in float32 (float64 stays float64).

    Inside :func:`norm_across`, the sum of squares is first combined with the
    other processes' (a tree split across pipeline stages has one norm).
    Inside :func:`as_part_of`, the part's gradients give the whole tree's norm.
    """
    whole = whole_of(tree, "sum_squares")
    if whole is not None:
        return torch.sqrt(whole)
    xs = [x for x in leaves(tree) if is_tensor(x)]
    if not xs:
        return torch.zeros(())
    total = torch.stack(squares(xs, norm_dtype(xs))).sum()
    for combine_ in _NORM_ACROSS:
        total = combine_(total)
    return torch.sqrt(total)


def norm_dtype(xs: Sequence[torch.Tensor]) -> torch.dtype:
    """What :func:`global_norm` accumulates ``xs`` in: float32, float64 if any is float64."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def squares(xs: Sequence[torch.Tensor], acc: torch.dtype) -> list[torch.Tensor]:
    """Each tensor's sum of squares in ``acc``: the terms :func:`global_norm` adds (also computed part by part,
    ``ftitan.train.step``'s update by layers, which must give the same bits)."""
    return [torch.sum(torch.square(x.to(acc))) for x in xs]


_NORM_ACROSS: list[Callable[[torch.Tensor], torch.Tensor]] = []


@contextlib.contextmanager
def norm_across(combine_squares: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Make :func:`global_norm` (and so ``optim.clip_by_global_norm``) apply ``combine_squares`` to its
    sum of squares inside the block: e.g. an all-reduce over pipeline stages, each holding part of the tree."""
    _NORM_ACROSS.append(combine_squares)
    try:
        yield
    finally:
        _NORM_ACROSS.pop()


def norm_is_combined() -> bool:
    """Whether :func:`global_norm` combines with other processes here (inside :func:`norm_across`):
    then the tree at hand is only this process's part of the whole."""
    return bool(_NORM_ACROSS)


class NotPartitionable(RuntimeError):
    """A whole-tree statistic was asked of a part's tree other than the gradients :func:`as_part_of` knows."""


_PARTS: list[tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = []


@contextlib.contextmanager
def as_part_of(grads: Tree, **whole: torch.Tensor) -> Iterator[None]:
    """Inside, ``grads`` (one part of a gradient tree, e.g. one layer's) stands for the whole tree in the
    statistics that span it: ``global_norm(grads)`` is ``sqrt(whole["sum_squares"])`` and
    ``optim.nonfinite_leaves(grads)`` is ``whole["nonfinite"]`` (the whole tree's flags, in its leaf order).

    An optimizer update that reads the whole only through those two (``Transform.leafwise``) then gives,
    run on each part in turn, the whole update (``ftitan.train.regional``: the update compiled once per
    layer). Another tree of the part's structure (e.g. the norm of an Adam direction) has no whole value
    here: asking raises :class:`NotPartitionable`; trees of other structures (a 0-d marker) are their own.
    Traceable by dynamo (a compiled part's update sets it inside the compiled function)."""
    _PARTS.append((leaves(grads), whole))
    try:
        yield
    finally:
        _PARTS.pop()


def whole_of(tree: Tree, stat: str) -> torch.Tensor | None:
    """Inside :func:`as_part_of`, the whole tree's ``stat`` when ``tree`` is the part's gradients; ``None``
    outside, or for a tree of another structure; raises :class:`NotPartitionable` for another tree of the
    part's structure."""
    if not _PARTS:
        return None
    grads, whole = _PARTS[-1]
    xs = leaves(tree)
    if len(xs) == len(grads) and all(a is b for a, b in zip(xs, grads, strict=True)):
        return whole[stat]
    # the part's structure, told by its leaves' shapes (traceable by dynamo, unlike comparing optree specs)
    if len(xs) == len(grads) and all(is_tensor(a) and a.shape == b.shape for a, b in zip(xs, grads, strict=True)):
        raise NotPartitionable(
            f"a whole-tree {stat} of a part's tree other than its gradients; this optimizer cannot run by parts "
            "(mark the transform leafwise=False)"
        )
    return None


def zeros_like(tree: Tree, *, dtype: torch.dtype | None = None) -> Tree:
    return map(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def stack(trees: Sequence[Tree], *, dim: int = 0) -> Tree:
    """Trees of one structure -> one tree whose leaves are stacked along ``dim`` (``jnp.stack`` per leaf).

    For ensembles: ``torch.func.vmap(model.apply, in_dims=(0, None))(stack(params_list), tokens)``
    runs every member on the same tokens.
    """
    if not trees:
        raise ValueError("tree.stack: needs at least one tree")
    first = structure(trees[0])
    for i, t in enumerate(trees[1:], 1):
        if structure(t) != first:
            raise ValueError(
                f"tree.stack: tree {i} has a different structure than tree 0:\n{structure(t)}\nvs\n{first}"
            )

    def one(path: str, *xs: Any) -> torch.Tensor:
        if not all(is_tensor(x) for x in xs) or len({tuple(x.shape) for x in xs}) != 1:
            raise ValueError(
                f"tree.stack: leaf {path!r} must be a tensor of one shape in every tree, got "
                f"{[tuple(x.shape) if is_tensor(x) else type(x).__name__ for x in xs]}"
            )
        return torch.stack(xs, dim)

    return map_with_path(one, trees[0], *trees[1:])


def unstack(tree: Tree, *, dim: int = 0) -> list[Tree]:
    """Inverse of :func:`stack`: one tree per index along ``dim`` of every leaf."""
    ps, ls, treedef = flatten_with_paths(tree)
    sizes = {p: x.shape[dim] if is_tensor(x) and x.dim() > dim else None for p, x in zip(ps, ls, strict=True)}
    if not ls or len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(f"tree.unstack: every leaf needs one common size along dim {dim}; got {sizes}")
    columns = [x.unbind(dim) for x in ls]
    return [unflatten(treedef, [c[i] for c in columns]) for i in range(ls[0].shape[dim])]


def register_node(
    cls: type,
    flatten_fn: Callable[[Any], tuple[Sequence[Any], Any]],
    unflatten_fn: Callable[[Any, Sequence[Any]], Any],
    *,
    keys: Callable[[Any], Sequence[Any]] | None = None,
) -> type:
    """Register ``cls`` as a pytree node with optree (ftitan namespace) and torch.

    ``flatten_fn(obj) -> (children, aux)``, ``unflatten_fn(aux, children) -> obj``;
    ``keys(aux)`` names the children for paths (default: their index). Both
    registries are needed: ``torch.func`` sees only ``torch.utils._pytree``,
    dynamo handles either. Returns ``cls`` so it can be used as a decorator helper.
    """

    def optree_flatten(obj: Any) -> tuple[Sequence[Any], Any, Sequence[Any] | None]:
        children, aux = flatten_fn(obj)
        return children, aux, (keys(aux) if keys else None)

    with warnings.catch_warnings():
        # overriding optree's positional NamedTuple handling is the point when keys name fields
        warnings.filterwarnings("ignore", message=".*already registered in the global namespace")
        optree.register_pytree_node(cls, optree_flatten, unflatten_fn, namespace=NAMESPACE)

    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        # torch's pytree already flattens every NamedTuple in field order; a
        # second registration there only warns (torch.utils._cxx_pytree)
        return cls

    def torch_flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        children, aux = flatten_fn(obj)
        names = keys(aux) if keys else range(len(children))
        return [(torch_pytree.MappingKey(k), c) for k, c in zip(names, children, strict=True)], aux

    torch_pytree.register_pytree_node(
        cls,
        lambda obj: (list(flatten_fn(obj)[0]), flatten_fn(obj)[1]),
        lambda children, aux: unflatten_fn(aux, children),
        flatten_with_keys_fn=torch_flatten_with_keys,
    )
    return cls
