"""Laws of ftitan.tree: round trips, map/partition/combine, paths, under compile."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ftitan.tree as T

names = st.text(alphabet="abcdefgh", min_size=1, max_size=3)
shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2)
leaf = shapes.map(lambda s: torch.randn(tuple(s), dtype=torch.float64))
trees = st.recursive(
    leaf,
    lambda children: st.dictionaries(names, children, min_size=1, max_size=3),
    max_leaves=8,
)


def assert_tree_equal(a, b):
    pa, la, _ = T.flatten_with_paths(a)
    pb, lb, _ = T.flatten_with_paths(b)
    assert pa == pb
    for x, y in zip(la, lb, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert T.structure(a) == T.structure(b)


@given(trees)
@settings(max_examples=60, deadline=None)
def test_flatten_unflatten_round_trip(tree):
    leaves, treedef = T.flatten(tree)
    assert_tree_equal(T.unflatten(treedef, leaves), tree)


@given(trees)
@settings(max_examples=60, deadline=None)
def test_map_identity_and_composition(tree):
    assert_tree_equal(T.map(lambda x: x, tree), tree)
    f, g = (lambda x: x * 2 + 1), (lambda x: x.exp())
    assert_tree_equal(T.map(f, T.map(g, tree)), T.map(lambda x: f(g(x)), tree))


@given(trees)
@settings(max_examples=60, deadline=None)
def test_paths_are_unique_and_dotted(tree):
    ps = T.paths(tree)
    assert len(ps) == len(set(ps)) == len(T.leaves(tree))
    seen = T.map_with_path(lambda p, x: p, tree)
    assert T.leaves(seen) == ps


@given(trees, st.sampled_from(["a*", "**.b", "*", "c.**", "**"]))
@settings(max_examples=80, deadline=None)
def test_partition_combine_is_identity_and_disjoint(tree, pattern):
    sel, rest = T.partition(tree, pattern)
    assert_tree_equal(T.combine(sel, rest), tree)
    assert_tree_equal(T.combine(rest, sel), tree)
    n_sel = sum(1 for x in T.leaves(sel) if x is not None)
    n_rest = sum(1 for x in T.leaves(rest) if x is not None)
    assert n_sel + n_rest == len(T.leaves(tree))
    # selected leaves are exactly those whose path matches
    for p in T.paths(tree):
        assert (p in T.paths(sel)) == T.match(p, pattern)


@given(trees)
@settings(max_examples=40, deadline=None)
def test_size_bytes_norm(tree):
    ls = T.leaves(tree)
    assert T.size(tree) == sum(x.numel() for x in ls)
    assert T.nbytes(tree) == 8 * T.size(tree)
    flat = torch.cat([x.reshape(-1) for x in ls])
    torch.testing.assert_close(T.global_norm(tree), flat.norm(), rtol=1e-12, atol=1e-12)


def test_match_globs():
    assert T.match("layers.3.attn.wq", "layers.*.attn.wq")
    assert not T.match("layers.3.attn.wq", "layers.*.wq")
    assert T.match("layers.3.attn.wq", "layers.**.wq")
    assert T.match("layers.3.attn.wq", "**.w?")
    assert not T.match("layers.3.attn.wqq", "**.w?")
    # "**." spans zero or more whole components
    assert T.match("b", "**.b") and T.match("a.b", "**.b") and T.match("a.c.b", "**.b")
    assert not T.match("ab", "**.b")
    assert T.match("layers.wq", "layers.**.wq") and not T.match("layerswq", "layers.**.wq")


def test_partition_by_predicate_and_bad_where():
    tree = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    mats, vecs = T.partition(tree, lambda p, x: x.ndim == 2)
    assert mats["b"] is None and vecs["w"] is None
    with pytest.raises(TypeError, match="predicate"):
        T.partition(tree, 3)


def test_cast_only_floating_and_where():
    tree = {"w": torch.ones(2), "i": torch.ones(2, dtype=torch.int64), "n": {"g": torch.ones(2)}}
    out = T.cast(tree, torch.bfloat16, where="n.*")
    assert out["w"].dtype == torch.float32
    assert out["i"].dtype == torch.int64
    assert out["n"]["g"].dtype == torch.bfloat16
    assert T.cast(tree, torch.float16)["i"].dtype == torch.int64


def test_meta_size_without_allocation():
    tree = {"big": torch.empty(100_000, 100_000, device="meta")}
    assert T.size(tree) == 10**10 and T.nbytes(tree) == 4 * 10**10


class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b


T.register_node(Pair, lambda p: ((p.a, p.b), None), lambda _aux, ch: Pair(*ch), keys=lambda _aux: ("a", "b"))


def test_custom_node_in_optree_torch_func_and_dynamo():
    tree = {"p": Pair(torch.ones(3), torch.full((2,), 2.0))}
    assert T.paths(tree) == ["p.a", "p.b"]

    def loss(t):
        return (t["p"].a.sum() + (t["p"].b ** 2).sum()) * 1.0

    grads = torch.func.grad(loss)(tree)  # torch.func sees torch.utils._pytree registrations
    assert isinstance(grads["p"], Pair)
    torch.testing.assert_close(grads["p"].b, torch.full((2,), 4.0))

    f = torch.compile(lambda t: T.map(lambda x: x * 3, t), fullgraph=True, backend="eager")
    out = f(tree)
    assert isinstance(out["p"], Pair)
    torch.testing.assert_close(out["p"].a, torch.full((3,), 3.0))


def test_map_with_path_and_norm_compile_fullgraph():
    tree = {"a": {"x": torch.ones(3), "skip": None}, "b": torch.ones(2)}
    f = torch.compile(
        lambda t: (T.map_with_path(lambda p, x: x * len(p), t), T.global_norm(t)),
        fullgraph=True,
        backend="eager",
    )
    out, norm = f(tree)
    torch.testing.assert_close(out["a"]["x"], torch.full((3,), 3.0))
    torch.testing.assert_close(norm, torch.tensor(5.0).sqrt())


def test_combine_needs_a_tree():
    with pytest.raises(ValueError):
        T.combine()


def test_stack_and_unstack_round_trip():
    trees = [{"a": torch.full((2,), float(i)), "b": {"c": torch.full((3, 1), -float(i))}} for i in range(4)]
    stacked = T.stack(trees)
    assert stacked["a"].shape == (4, 2) and stacked["b"]["c"].shape == (4, 3, 1)
    for got, want in zip(T.unstack(stacked), trees, strict=True):
        torch.testing.assert_close(got, want)


def test_stack_names_the_mismatched_leaf():
    with pytest.raises(ValueError, match="'b.c'"):
        T.stack([{"a": torch.zeros(2), "b": {"c": torch.zeros(3)}}, {"a": torch.zeros(2), "b": {"c": torch.zeros(4)}}])
    with pytest.raises(ValueError, match="structure"):
        T.stack([{"a": torch.zeros(2)}, {"b": torch.zeros(2)}])


def test_filter_grad_over_partition_output_equals_grad_of_the_whole_tree():
    # torch.func.grad refuses None placeholders; filter_grad differentiates the trainable half only
    import ftitan as ft

    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(3, 3, generator=g),
        "frozen": {"b": torch.randn(3, generator=g)},
        "v": torch.randn(3, generator=g),
    }
    x = torch.randn(3, generator=g)

    def loss(p, x_):
        return ((p["w"] @ x_ + p["frozen"]["b"]) * p["v"]).square().sum()

    frozen, trainable = T.partition(params, "frozen.**")
    assert trainable["frozen"]["b"] is None and frozen["w"] is None
    with pytest.raises(ValueError, match="must be Tensor"):
        torch.func.grad(lambda t: loss(T.combine(t, frozen), x))(trainable)
    grads = ft.train.filter_grad(lambda t, x_: loss(T.combine(t, frozen), x_))(trainable, x)
    full = torch.func.grad(loss)(params, x)
    assert grads["frozen"]["b"] is None
    torch.testing.assert_close(grads["w"], full["w"])
    torch.testing.assert_close(grads["v"], full["v"])


def test_from_paths_inverts_flatten_with_paths_on_dicts():
    import torch

    from ftitan import tree as T

    nested = {"layers": {"0": {"attn": {"wq": torch.ones(2)}, "norm": torch.zeros(1)}}, "head": torch.ones(3)}
    paths, leaves, _ = T.flatten_with_paths(nested)
    back = T.from_paths(dict(zip(paths, leaves, strict=True)))
    assert T.paths(back) == paths and all(a is b for a, b in zip(T.leaves(back), leaves, strict=True))
