"""FlexShard plans on one process: every rank's layout computed (``plan(..., world=, rank=)``), the collectives
simulated by stacking (all-gather) or summing (reduce-scatter) the ranks' packed buffers
(``ftitan.flexshard.packed``: what its one collective sends and receives); the gathered
leaves equal the full params bit for bit, the reduced gradients equal each rank's part of the sum."""

from __future__ import annotations

import pytest
import torch

import ftitan as ft
from ftitan import flexshard as fs
from ftitan.flexshard import packed
from ftitan.models import llama

CFG = llama.Config(vocab_size=250, dim=48, n_layers=2, n_heads=3, n_kv_heads=1, ffn_dim=80, max_seq_len=32)
PARAMS = llama.model(CFG).init(ft.random.key(0))  # head_dim 16: wq (48, 48) is 3 heads of 16 rows

POLICIES = {
    "shard0": lambda p: fs.per_layer(p, fs.Shard(0)),
    "shard1": lambda p: fs.per_layer(p, fs.Shard(-1)),
    "mixed": lambda p: [fs.Bucket(["layers.*.attn.wq", "layers.*.attn.wk"], fs.BlockShard(0, 16), name="heads"),
                        fs.Bucket("layers.*.mlp.*", fs.Owned(), name="owned"),
                        fs.Bucket("**.*norm*", fs.Replicate(), name="norms"),
                        fs.Bucket("**", fs.Shard(0), gather_dtype=torch.bfloat16, name="rest")],
    "per_leaf": lambda p: fs.per_leaf(p, fs.Shard(0)),
}  # fmt: skip


def _plans(policy: str, world: int) -> list[fs.Plan]:
    return [fs.plan(PARAMS, POLICIES[policy](PARAMS), world=world, rank=r) for r in range(world)]


def _flat(t) -> dict[str, torch.Tensor]:
    paths, xs, _ = ft.tree.flatten_with_paths(t)
    return dict(zip(paths, xs, strict=True))


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gathering_every_ranks_parts_gives_the_full_leaves(policy: str, world: int):
    plans = _plans(policy, world)
    locals_ = [p.shard(PARAMS) for p in plans]
    full = _flat(PARAMS)
    for name, bucket in plans[0].buckets.items():
        paths = [lp.path for lp in plans[0].members[name] if lp.packed]
        if not paths:
            continue
        shapes, dims = plans[0].part_shapes(name), [plans[0].leaves[p].dim for p in paths]
        dtype = bucket.gather_dtype or full[paths[0]].dtype
        bufs = [packed.pack([_flat(loc)[p] for p in paths], shapes, dtype) for loc in locals_]
        assert len({b.numel() for b in bufs}) == 1 and bufs[0].numel() == plans[0].padded[name]  # one all-gather
        leaves = packed.unpack(torch.stack(bufs), shapes, dims, dtype)  # every rank's buffer: an all-gather
        for path, x in zip(paths, leaves, strict=True):
            assert torch.equal(x, full[path].to(dtype)), (policy, world, path)
        # each rank's parts are exactly what it stores
        for r, loc in enumerate(locals_):
            mine = packed.unpack_own(bufs[r], shapes, r)
            assert all(torch.equal(m, _flat(loc)[p].to(dtype)) for p, m in zip(paths, mine, strict=True)), (r, name)
    # the parts add up to the whole, and a ragged dim is split as evenly as it goes
    sizes = [sum(x.numel() for x in ft.tree.leaves(loc)) for loc in locals_]
    replicated = sum(lp.numel(0) for lp in plans[0].leaves.values() if not lp.packed)
    assert sum(sizes) - (world - 1) * replicated == ft.tree.size(PARAMS)
    if policy == "shard0":
        rows = [plans[r].leaves["embed"].local_shape(r)[0] for r in range(world)]
        assert max(rows) - min(rows) <= 1 and sum(rows) == CFG.vocab_size


@pytest.mark.parametrize("world", [2, 4])
def test_reduced_gradients_are_each_ranks_part_of_the_sum(world: int):
    plans = _plans("mixed", world)
    g = torch.Generator().manual_seed(1)
    grads = [ft.tree.map(lambda x: torch.randn(x.shape, generator=g), PARAMS) for _ in range(world)]
    total = ft.tree.map(lambda *xs: sum(xs[1:], xs[0]), *grads)
    for name in plans[0].buckets:
        paths = [lp.path for lp in plans[0].members[name] if lp.packed]
        if not paths:
            continue
        shapes, dims = plans[0].part_shapes(name), [plans[0].leaves[p].dim for p in paths]
        # a reduce-scatter's input: every rank's packed gradients, summed
        summed = sum(packed.pack_grads([_flat(gr)[p] for p in paths], shapes, dims, torch.float32) for gr in grads)
        n = plans[0].padded[name]
        for r in range(world):
            mine = packed.unpack_own(summed[r * n : (r + 1) * n], shapes, r)
            want = fs.plan(PARAMS, POLICIES["mixed"](PARAMS), world=world, rank=r).shard(total)
            for path, x in zip(paths, mine, strict=True):
                torch.testing.assert_close(x, _flat(want)[path], rtol=1e-6, atol=1e-6)


def test_block_shard_keeps_whole_heads_and_owned_leaves_are_balanced():
    plans = _plans("mixed", 2)
    wq = plans[0].leaves["layers.0.attn.wq"]
    assert [wq.local_shape(r)[0] for r in range(2)] == [32, 16]  # 3 heads of 16 rows: 2 + 1
    owned = [lp for lp in plans[0].leaves.values() if isinstance(lp.placement, fs.Owned)]
    assert all(lp.owner == plans[1].leaves[lp.path].owner for lp in owned)  # every rank agrees
    loads = [sum(fs.newton_schulz_cost(lp.shape) for lp in owned if lp.owner == r) for r in range(2)]
    assert abs(loads[0] - loads[1]) <= max(fs.newton_schulz_cost(lp.shape) for lp in owned)
    for lp in owned:  # the owner holds it whole, the others nothing
        assert lp.local_shape(lp.owner) == lp.shape and lp.numel(1 - lp.owner) == 0


def test_gather_is_differentiable_on_one_rank():
    plan = fs.plan(PARAMS, fs.per_layer(PARAMS), world=1, rank=0)
    local = ft.tree.map(lambda x: x.clone().requires_grad_(), plan.shard(PARAMS))
    full = plan.gather_all(local)
    loss = sum((x.float() ** 2).sum() for x in ft.tree.leaves(full))
    loss.backward()
    for x in ft.tree.leaves(local):
        torch.testing.assert_close(x.grad, 2 * x.detach())


def test_bad_plans_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="matches no bucket's patterns; add a catch-all"):
        fs.plan(PARAMS, [fs.Bucket("layers.**")])
    with pytest.raises(ValueError, match="not whole blocks of BlockShard"):
        fs.plan(PARAMS, [fs.Bucket("**", fs.BlockShard(0, 7))])
    with pytest.raises(ValueError, match="bucket names repeat"):
        fs.plan(PARAMS, [fs.Bucket("embed"), fs.Bucket("embed"), fs.Bucket("**")])
    remote = fs.plan(PARAMS, fs.per_layer(PARAMS), world=2, rank=1)
    with pytest.raises(ValueError, match="its collectives need one"):
        remote.gather(remote.shard(PARAMS), "rest")


def test_parts_place_every_part_and_state_leaf_in_its_full_tensor():
    from ftitan.checkpoint import Part

    plan = fs.plan(PARAMS, POLICIES["mixed"](PARAMS), world=3, rank=1)
    local = plan.shard(PARAMS)
    opt = ft.optim.adamw(1e-3)
    state = {"params": local, "opt": opt.init(local), "step": torch.tensor(4)}
    parts = plan.parts(state)
    flat = _flat(parts)
    assert isinstance(flat["step"], torch.Tensor)  # not a part: a plain leaf
    wq = plan.leaves["layers.0.attn.wq"]  # 3 heads of 16 rows on 3 ranks: rank 1 holds rows 16..31
    for path in ("params.layers.0.attn.wq", *[p for p in flat if p.endswith("mu.layers.0.attn.wq")]):
        part = flat[path]
        assert isinstance(part, Part) and part.offsets == (16, 0) and part.shape == wq.shape and part.write
    norm = next(v for p, v in flat.items() if p.endswith("params.layers.0.attn_norm"))
    assert isinstance(norm, Part) and not norm.write  # replicated: written by rank 0 alone
    owned = [v for p, v in flat.items() if p.startswith("params.") and isinstance(v, Part)
             and isinstance(plan.leaves[p[len("params."):]].placement, fs.Owned)]  # fmt: skip
    assert owned and all((v.local.numel() > 0) == (plan.leaves[p].owner == 1) for p, v in
                         ((p[len("params."):], v) for p, v in flat.items() if v in owned))  # fmt: skip
    back = plan.from_parts(parts)
    assert all(a is b for a, b in zip(ft.tree.leaves(back), ft.tree.leaves(state), strict=True))


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("grad", ["no_grad", "no_requires_grad", "requires_grad"])
def test_gathers_compile_fullgraph_with_or_without_a_gradient(quantize, grad):
    """``packed_gather`` and ``replicated`` (one rank: no collective) compiled with fullgraph give the eager
    leaves, also where no gradient is wanted (a compiled evaluation or generation of a sharded model):
    torch 2.13's dynamo passed the Functions' forwards a context object first there (``packed._apply``), and
    the trace failed."""
    g = torch.Generator().manual_seed(0)
    a, b, scale = (torch.randn(4, 64, generator=g), torch.randn(2, 64, generator=g), torch.randn(64, generator=g))

    def f(a, b, scale):
        return (*packed.packed_gather([a, b], None, [0, 0], None, quantize=quantize), *packed.replicated([scale], ()))

    want = f(a, b, scale)
    inputs = [x.clone().requires_grad_(grad == "requires_grad") for x in (a, b, scale)]
    with torch.set_grad_enabled(grad != "no_grad"):
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(*inputs)
    assert len(got) == 3 and all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert all(x.requires_grad == (grad == "requires_grad") for x in got)
