"""Round trips: bit-exact for every dtype, NamedTuples, TrainState, views and tied storage."""

import os
import tempfile
from typing import NamedTuple

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import ftitan.checkpoint as ckpt
from ftitan import tree
from ftitan.optim import muon_with_adamw
from ftitan.train.state import init_state


class Inner(NamedTuple):
    count: torch.Tensor
    moments: dict


class Outer(NamedTuple):
    params: dict
    inner: Inner
    rng: torch.Tensor


def _nested() -> Outer:
    g = torch.Generator().manual_seed(0)
    return Outer(
        params={
            "emb": torch.randn(7, 3, generator=g).to(torch.bfloat16),
            "layers": {"0": {"w": torch.randn(3, 3, generator=g, dtype=torch.float64)}},
            "mask": torch.tensor([True, False, True]),
            "codes": torch.randint(0, 255, (4,), generator=g, dtype=torch.uint8),
            "half": torch.randn(2, 2, generator=g).half(),
        },
        inner=Inner(
            count=torch.tensor(2**62 + 3, dtype=torch.int64),  # beyond float precision
            moments={"mu": {"a": torch.randn(5, generator=g)}, "lr": torch.tensor(float("nan"))},
        ),
        rng=torch.tensor(-(2**63), dtype=torch.int64),
    )


def _bits(x: torch.Tensor) -> list[int]:
    return x.reshape(-1).contiguous().view(torch.uint8).tolist()


def assert_bit_exact(a, b):
    pa, la, ta = tree.flatten_with_paths(a)
    pb, lb, tb = tree.flatten_with_paths(b)
    assert ta == tb and pa == pb
    for p, x, y in zip(pa, la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, p
        # compare raw bits so NaN payloads and -0.0 count too
        assert _bits(x) == _bits(y), p


def test_nested_namedtuple_round_trip_is_bit_exact(tmp_path):
    state = _nested()
    path = ckpt.save(tmp_path, 12, state, extra={"config": {"lr": 1e-3, "name": "tiny"}, "loader": [3, 4]})
    assert path == tmp_path / "step_00000012"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "rank00000.safetensors"]

    restored, manifest = ckpt.load(path, tree.zeros_like(state))
    assert_bit_exact(state, restored)
    assert isinstance(restored, Outer) and isinstance(restored.inner, Inner)
    assert manifest.step == 12
    assert manifest.extra == {"config": {"lr": 1e-3, "name": "tiny"}, "loader": [3, 4]}
    assert [s.path for s in manifest.leaves] == tree.paths(state)
    assert ckpt.read_manifest(path).leaves[0].shape == state.params["codes"].shape  # sorted: codes first


def test_train_state_round_trip_after_a_step(tmp_path):
    params = {"emb": torch.randn(6, 4), "layers": {"0": {"wq": torch.randn(4, 4)}}, "norm": torch.ones(4)}
    opt = muon_with_adamw(params, lr=1e-2)
    state = init_state(params, opt)
    grads = tree.map(torch.ones_like, params)
    updates, opt_state = opt.update(grads, state.opt_state, params)
    state = state._replace(step=state.step + 1, opt_state=opt_state)

    ckpt.save(tmp_path, int(state.step), state)
    restored, manifest = ckpt.load(tmp_path, init_state(params, opt))  # a directory: loads the latest
    assert manifest.step == 1
    assert_bit_exact(state, restored)


def test_load_into_meta_like_tree(tmp_path):
    state = _nested()
    ckpt.save(tmp_path, 0, state)
    like = tree.map(lambda x: torch.empty_like(x, device="meta"), state)
    restored, _ = ckpt.load(tmp_path, like)
    assert_bit_exact(state, restored)
    assert all(x.device.type == "cpu" for x in tree.leaves(restored))


def test_load_into_writes_the_like_trees_own_tensors(tmp_path):
    state = _nested()
    ckpt.save(tmp_path, 0, state)
    like = tree.map(torch.zeros_like, state)
    restored, _ = ckpt.load(tmp_path, like, into=True)
    assert_bit_exact(state, restored)
    # no second copy of the state: the very tensors of like_tree now hold the checkpoint
    assert all(a is b for a, b in zip(tree.leaves(restored), tree.leaves(like), strict=True))
    assert_bit_exact(state, like)


def test_views_and_tied_weights_are_stored_as_copies(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    state = {"t": base.t(), "row": base[1], "tied_a": base, "tied_b": base, "empty": torch.empty(0)}
    ckpt.save(tmp_path, 1, state)
    restored, _ = ckpt.load(tmp_path, state)
    assert_bit_exact(state, restored)
    assert restored["tied_a"].data_ptr() != restored["tied_b"].data_ptr()


def test_requires_grad_follows_like_tree(tmp_path):
    ckpt.save(tmp_path, 1, {"w": torch.ones(2)})
    restored, _ = ckpt.load(tmp_path, {"w": torch.zeros(2, requires_grad=True)})
    assert restored["w"].requires_grad


def test_saving_the_same_step_again_replaces_it(tmp_path):
    ckpt.save(tmp_path, 5, {"w": torch.zeros(2)})
    ckpt.save(tmp_path, 5, {"w": torch.ones(2)})
    restored, _ = ckpt.load(tmp_path / "step_00000005", {"w": torch.empty(2)})
    assert restored["w"].tolist() == [1.0, 1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000005"]  # nothing left aside


def test_step_may_be_a_0d_int_tensor(tmp_path):
    assert ckpt.save(tmp_path, torch.tensor(7), {"w": torch.ones(1)}).name == "step_00000007"


@pytest.mark.parametrize(
    ("kwargs", "tree_", "match"),
    [
        ({}, {"w": torch.ones(1), "lr": 0.1}, r"lr: leaf is a float, not a tensor.*extra="),
        ({"extra": {"cfg": {"dtype": torch.float32}}}, {"w": torch.ones(1)}, r"extra\['cfg'\]\['dtype'\].*JSON"),
        ({"extra": {"loss": float("inf")}}, {"w": torch.ones(1)}, r"extra\['loss'\].*not valid JSON"),
        ({"keep": 0}, {"w": torch.ones(1)}, r"keep=0"),
    ],
)
def test_bad_save_arguments_name_the_culprit(tmp_path, kwargs, tree_, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ckpt.save(tmp_path, 1, tree_, **kwargs)
    assert list(tmp_path.iterdir()) == []  # validated before anything is written


def test_negative_step_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"step=-1"):
        ckpt.save(tmp_path, -1, {"w": torch.ones(1)})


def test_checkpoint_permissions_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = ckpt.save(tmp_path, 1, {"w": torch.ones(1)})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o755  # readable by others, unlike a mkdtemp directory


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]


def _random_bits(shape: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaN payloads, subnormals included) of any dtype."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, [*shape, size], generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw[..., 0] & 1).bool()
    return raw.view(dtype).reshape(shape)


@settings(max_examples=25, deadline=None)
@given(
    specs=st.dictionaries(
        st.from_regex(r"[a-z]{1,4}(\.[0-9]{1,2})?", fullmatch=True),  # dots become nested dicts below
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 3), max_size=3), st.integers(0, 2**31)),
        max_size=6,
    )
)
def test_round_trip_property(specs):
    state: dict = {}
    for name, (dtype, shape, seed) in specs.items():
        head, _, tail = name.partition(".")
        leaf = _random_bits(shape, dtype, seed)
        if tail:
            if not isinstance(state.get(head, {}), dict):
                continue
            state.setdefault(head, {})[tail] = leaf
        elif head not in state:
            state[head] = leaf
    with tempfile.TemporaryDirectory() as d:
        ckpt.save(d, 3, state)
        restored, _ = ckpt.load(d, tree.zeros_like(state))
    assert_bit_exact(state, restored)
