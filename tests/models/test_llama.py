"""Llama model: config checks, published sizes, init, apply, torch.func and torch.compile."""

import resource

import attrs
import pytest
import torch

from ftitan import random, tree
from ftitan.models import llama

TINY = llama.Config(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)


def perturbed(params, seed=0):
    # norms start at ones; perturb every leaf so a mix-up of any two leaves shows in the output
    g = torch.Generator().manual_seed(seed)
    return tree.map(lambda x: x + 0.05 * torch.randn(x.shape, generator=g), params)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"dim": 30}, "not divisible by n_heads"),
        ({"n_kv_heads": 3}, "not a multiple of n_kv_heads"),
        ({"dim": 36, "n_heads": 12, "n_kv_heads": 4}, "must be even"),
        ({"attn_impl": "flash"}, "attn_impl='flash'"),
        ({"n_layers": 0}, "n_layers=0"),
        ({"ffn_dim": 4.5}, "ffn_dim=4.5"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"rope_scaling": {"factor": 8}}, "rope_scaling"),
    ],
)
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        attrs.evolve(TINY, **change)


def test_config_is_frozen_and_hashable():
    cfg = llama.Config.llama3_1_8b()
    assert hash(cfg) == hash(llama.Config.llama3_1_8b()) and cfg.head_dim == 128
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.dim = 8  # type: ignore[misc]


PUBLISHED_PARAMS = {  # totals of the released checkpoints (HF safetensors metadata)
    "llama3_2_1b": 1_235_814_400,
    "llama3_2_3b": 3_212_749_824,
    "llama3_1_8b": 8_030_261_248,
    "llama3_1_70b": 70_553_706_496,
    "llama3_1_405b": 405_853_388_800,
}


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("flavor", list(PUBLISHED_PARAMS))
def test_meta_init_param_counts_match_published(flavor):
    # exact: the architecture, not an approximation of it (brief allowed 0.5%)
    cfg = llama.FLAVORS[flavor]()
    before = rss_bytes()
    params = llama.model(cfg).init(random.key(0), dtype=torch.bfloat16, device="meta")
    grown = rss_bytes() - before
    assert tree.size(params) == PUBLISHED_PARAMS[flavor]
    assert all(x.device.type == "meta" for x in tree.leaves(params))
    assert grown < 64 * 2**20, f"meta init grew RSS by {grown / 2**20:.0f} MiB"


def test_flavors_are_registered():
    assert set(llama.FLAVORS) == {"debug", *PUBLISHED_PARAMS}
    assert llama.Config.llama3_2_1b().tie_embeddings and not llama.Config.llama3_1_8b().tie_embeddings
    assert llama.Config.llama3_1_8b().rope_scaling == llama.Llama3RopeScaling(factor=8.0)
    assert llama.Config.llama3_2_3b().rope_scaling.factor == 32.0


@pytest.mark.parametrize("flavor", ["llama3_1_8b", "llama3_2_1b"])
def test_flops_per_token_counts_matmul_weights(flavor):
    # independent count: every 2-D param except the embedding lookup (the head is the embedding when tied)
    cfg = llama.FLAVORS[flavor]()
    m = llama.model(cfg)
    params = m.init(random.key(0), device="meta")
    n = sum(x.numel() for p, x in zip(*tree.flatten_with_paths(params)[:2]) if x.dim() == 2 and p != "embed")
    if cfg.tie_embeddings:
        n += params["embed"].numel()
    attn = 6 * cfg.n_layers * 4096 * cfg.n_heads * cfg.head_dim
    assert m.flops_per_token(4096) == 6 * n + attn
    if flavor == "llama3_1_8b":
        assert n == 7_504_658_432


def test_params_tree_layout_and_axes():
    m = llama.model(TINY)
    params = m.init(random.key(0))
    assert list(params) == ["embed", "layers", "norm", "head"]
    assert list(params["layers"]) == ["0", "1", "2"]
    assert set(params["layers"]["0"]) == {"attn_norm", "attn", "mlp_norm", "mlp"}
    assert tuple(params["layers"]["0"]["attn"]["wk"].shape) == (16, 32)
    axes = tree.structure(params).flatten_up_to(m.param_axes)  # one axes tuple per leaf
    for x, ax in zip(tree.leaves(params), axes, strict=True):
        assert isinstance(ax, tuple) and len(ax) == x.dim()
    assert m.param_axes["layers"]["1"]["attn"]["wo"] == ("embed", "heads")
    assert m.param_axes["head"] == ("vocab", "embed")
    tied = llama.model(attrs.evolve(TINY, tie_embeddings=True))
    assert "head" not in tied.init(random.key(0), device="meta")
    assert "head" not in tied.param_axes


def test_init_is_deterministic_and_leafwise():
    k = random.key(7)
    a, b = llama.model(TINY).init(k), llama.model(TINY).init(k)
    for x, y in zip(tree.leaves(a), tree.leaves(b), strict=True):
        assert torch.equal(x, y)
    # a leaf's value does not depend on the rest of the tree (more layers, other vocab)
    other = llama.model(attrs.evolve(TINY, n_layers=5, vocab_size=200)).init(k)
    assert torch.equal(other["layers"]["1"]["attn"]["wq"], a["layers"]["1"]["attn"]["wq"])
    assert not torch.equal(a["layers"]["0"]["attn"]["wq"], a["layers"]["1"]["attn"]["wq"])
    bf = llama.model(TINY).init(k, dtype=torch.bfloat16)
    assert all(x.dtype == torch.bfloat16 for x in tree.leaves(bf))
    assert torch.equal(bf["embed"], a["embed"].to(torch.bfloat16))


def test_apply_shapes_hidden_and_head():
    m = llama.model(TINY)
    params = perturbed(m.init(random.key(0)))
    tokens = torch.randint(0, 96, (2, 10))
    logits, cache = m.apply(params, tokens)
    hidden, _ = m.apply(params, tokens, logits=False)
    assert logits.shape == (2, 10, 96) and hidden.shape == (2, 10, 32) and cache is None
    torch.testing.assert_close(hidden @ m.head(params).T, logits, rtol=1e-6, atol=1e-6)


def test_positions_are_honoured():
    m = llama.model(TINY)
    params = perturbed(m.init(random.key(0)))
    tokens = torch.randint(0, 96, (2, 6))
    base, _ = m.apply(params, tokens)
    same, _ = m.apply(params, tokens, positions=torch.arange(6))
    torch.testing.assert_close(same, base, rtol=0, atol=0)
    # per-row positions (B, T) equal running each row with its own (T,) positions
    pos = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 1, 2, 30, 31, 32]])
    both, _ = m.apply(params, tokens, positions=pos)
    for r in range(2):
        row, _ = m.apply(params, tokens[r : r + 1], positions=pos[r])
        torch.testing.assert_close(both[r : r + 1], row, rtol=1e-6, atol=1e-6)
    # RoPE is relative: a uniform shift changes nothing, a gap does (after the gap only)
    torch.testing.assert_close(both[0], base[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1, :3], base[1, :3], rtol=0, atol=1e-6)
    assert not torch.allclose(both[1, 3:], base[1, 3:], atol=1e-4)


def test_sdpa_and_math_models_agree():
    params = perturbed(llama.model(TINY).init(random.key(0)))
    tokens = torch.randint(0, 96, (2, 12))
    a, _ = llama.model(TINY).apply(params, tokens)
    b, _ = llama.model(attrs.evolve(TINY, attn_impl="math")).apply(params, tokens)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def loss_fn(apply):
    def loss(params, tokens):
        logits, _ = apply(params, tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return loss


@pytest.mark.parametrize("tied", [False, True])
def test_func_grad_matches_autograd(tied):
    m = llama.model(attrs.evolve(TINY, tie_embeddings=tied))
    params = perturbed(m.init(random.key(0)))
    tokens = torch.randint(0, 96, (2, 9))
    grads, value = torch.func.grad_and_value(loss_fn(m.apply))(params, tokens)
    leaves = [x.clone().requires_grad_() for x in tree.leaves(params)]
    ref_value = loss_fn(m.apply)(tree.unflatten(tree.structure(params), leaves), tokens)
    ref_grads = torch.autograd.grad(ref_value, leaves)
    torch.testing.assert_close(value, ref_value.detach(), rtol=0, atol=0)
    for g, r in zip(tree.leaves(grads), ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_compiled_apply_and_grad_match_eager():
    # aot_eager runs the same aten ops as eager; 1e-6 allows decomposition reordering
    m = llama.model(attrs.evolve(TINY, n_layers=2))
    params = perturbed(m.init(random.key(0)))
    tokens = torch.randint(0, 96, (2, 8))
    eager, _ = m.apply(params, tokens)
    compiled, _ = torch.compile(m.apply, fullgraph=True, backend="aot_eager")(params, tokens)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)

    m_math = llama.model(attrs.evolve(m.config, attn_impl="math"))
    step = torch.func.grad_and_value(loss_fn(m_math.apply))
    g_eager, v_eager = step(params, tokens)
    g_comp, v_comp = torch.compile(step, fullgraph=True, backend="aot_eager")(params, tokens)
    torch.testing.assert_close(v_comp, v_eager, rtol=0, atol=1e-6)
    for a, b in zip(tree.leaves(g_comp), tree.leaves(g_eager), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
