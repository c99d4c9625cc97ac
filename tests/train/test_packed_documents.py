"""Packed rows of several documents: no token attends across a document boundary.

The reference for every check is the unpacked computation: each document run alone (its own row,
positions from 0, plain causal attention), and the loss of a batch holding one document a row.
"""

from __future__ import annotations

import attrs
import pytest
import torch

import ftitan as ft
from ftitan.data import pack_documents
from ftitan.infer.cache import init_cache
from ftitan.models import deepseek_v3, llama, qwen3, qwen3_moe
from ftitan.train.losses import IGNORE_INDEX, next_token_loss

V = 96
FAMILIES = {
    "llama": llama.model(llama.Config(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                                      max_seq_len=64)),
    "qwen3": qwen3.model(qwen3.Config(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                      ffn_dim=48, max_seq_len=64)),
    "qwen3_moe": qwen3_moe.model(qwen3_moe.Config(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                                  head_dim=16, n_experts=4, top_k=2, expert_dim=24, ffn_dim=40,
                                                  max_seq_len=64)),
    "deepseek_v3": deepseek_v3.model(deepseek_v3.Config(
        vocab_size=V, dim=32, n_layers=2, n_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, ffn_dim=48, n_dense_layers=1, n_experts=8, top_k=2, moe_ffn_dim=16,
        n_groups=4, topk_groups=2, max_seq_len=64)),
}  # fmt: skip


def documents(seed: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        ids = torch.randint(1, V, (n,), generator=g)
        mask = (torch.rand(n, generator=g) < 0.6).long()
        docs.append((ids, mask))
    return docs


def perturbed(params, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ft.tree.map(lambda x: x + 0.05 * torch.randn(x.shape, generator=g) if x.is_floating_point() else x, params)


def test_pack_documents_layout():
    docs = documents(0, [5, 9, 3, 7, 2, 17])
    rows = pack_documents(docs, seq_len=16)
    b = rows.batch
    # first fit, in order (n tokens take n - 1 slots): 4 + 8 + 2 + 1 in row 0 (15 of 16), 6 in row 1,
    # 16 alone in row 2
    assert rows.placement == [(0, 0), (0, 4), (0, 12), (1, 0), (0, 14), (2, 0)]
    assert b["inputs"].shape == (3, 16)
    for i, (ids, mask) in enumerate(docs):
        r, s = rows.placement[i]
        n = ids.shape[0] - 1
        assert torch.equal(b["inputs"][r, s : s + n], ids[:-1])
        assert torch.equal(b["targets"][r, s : s + n], torch.where(mask[1:].bool(), ids[1:], IGNORE_INDEX))
        assert torch.equal(b["positions"][r, s : s + n], torch.arange(n))
        assert (b["segments"][r, s : s + n] == b["segments"][r, s]).all()
    # padding carries no loss and its own document id; documents of a row have distinct ids
    assert (b["targets"][1, 6:] == IGNORE_INDEX).all() and b["segments"][1, 6] not in b["segments"][1, :6]
    assert len(set(b["segments"][0, :15].tolist())) == 4
    assert rows.fill == pytest.approx((15 + 6 + 16) / 48)
    # the targets kept are exactly the masked ones: nothing silently dropped
    assert int((b["targets"] != IGNORE_INDEX).sum()) == sum(int(m[1:].sum()) for _, m in docs)
    with pytest.raises(ValueError, match="document 0 has 18 tokens, more than seq_len \\+ 1 = 17"):
        pack_documents(documents(1, [18]), seq_len=16)


def test_document_positions_restart():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 7, 7], [5, 5, 5, 5, 5, 5, 5, 5]])
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])
    assert torch.equal(ft.nn.document_positions(seg), want)
    m = ft.nn.document_mask(seg)
    assert m[0, 4].tolist() == [False, False, False, True, True, False, False, False]
    assert torch.equal(m[1], torch.ones(8, 8).tril().bool())


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logits_equal_each_document_alone(family, impl):
    cfg = attrs.evolve(FAMILIES[family].config, attn_impl=impl)
    model = {"llama": llama, "qwen3": qwen3, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}[family].model(cfg)
    params = perturbed(model.init(ft.random.key(0)), seed=1)
    docs = documents(2, [7, 11, 4, 9, 13, 6])
    rows = pack_documents(docs, seq_len=24)
    b = rows.batch
    assert b["inputs"].shape[0] < len(docs)  # several documents share a row
    packed, _ = model.apply(params, b["inputs"], positions=b["positions"], segments=b["segments"])
    # the default positions restart with each document too
    default, _ = model.apply(params, b["inputs"], segments=b["segments"])
    torch.testing.assert_close(default, packed, rtol=0, atol=0)
    for (ids, _), (r, s) in zip(docs, rows.placement, strict=True):
        alone, _ = model.apply(params, ids[None, :-1])
        n = ids.shape[0] - 1
        assert (packed[r, s : s + n] - alone[0]).abs().max() <= 1e-5
    # without segments the same row attends across documents: the check above can fail
    crossed, _ = model.apply(params, b["inputs"], positions=b["positions"])
    assert (crossed - packed).abs().max() > 1e-3


def test_packed_loss_and_accumulated_grads_equal_unpacked_batch():
    model = FAMILIES["llama"]
    params = perturbed(model.init(ft.random.key(0)), seed=3)
    docs = documents(4, [7, 11, 4, 9, 13, 6, 15, 3, 8, 10])
    seq_len = 24
    packed = pack_documents(docs, seq_len=seq_len).batch
    if packed["inputs"].shape[0] % 2:  # two micro-batches
        packed = {k: torch.cat([v, v[-1:] * 0 + (IGNORE_INDEX if k == "targets" else 0)]) for k, v in packed.items()}
    # the reference: one document a row, right-padded, plain causal attention
    unpacked = {"inputs": torch.zeros(len(docs), seq_len, dtype=torch.int64),
                "targets": torch.full((len(docs), seq_len), IGNORE_INDEX)}  # fmt: skip
    for i, (ids, mask) in enumerate(docs):
        n = ids.shape[0] - 1
        unpacked["inputs"][i, :n] = ids[:-1]
        unpacked["targets"][i, :n] = torch.where(mask[1:].bool(), ids[1:], IGNORE_INDEX)
    loss_fn = next_token_loss(model)
    grads_ref, (loss_ref, aux_ref) = ft.train.value_and_grad(loss_fn)(params, unpacked)
    grads_p, (loss_p, aux_p) = ft.train.value_and_grad(loss_fn)(params, packed)
    assert int(aux_p["n_tokens"]) == int(aux_ref["n_tokens"])
    torch.testing.assert_close(loss_p, loss_ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(ft.tree.leaves(grads_p), ft.tree.leaves(grads_ref), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # two micro-batches of packed rows, with different target counts: the token-weighted mean is the batch's
    opt = ft.optim.sgd(1.0)
    states = []
    for accum, batch in ((1, unpacked), (2, packed)):
        step = ft.train.make_train_step(loss_fn, opt, accum_steps=accum)
        state, m = step(ft.train.init_state(params, opt), batch)
        torch.testing.assert_close(m["loss"], loss_ref, rtol=1e-6, atol=1e-6)
        states.append(state.params)
    for a, b in zip(ft.tree.leaves(states[0]), ft.tree.leaves(states[1]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_segments_with_a_kv_cache_are_refused():
    model = FAMILIES["llama"]
    params = model.init(ft.random.key(0))
    cache = init_cache(model, params, batch=1, slots=8)
    with pytest.raises(ValueError, match="segments .* with a KV cache"):
        model.apply(params, torch.ones(1, 4, dtype=torch.int64), cache=cache, segments=torch.zeros(1, 4, dtype=torch.int64))
