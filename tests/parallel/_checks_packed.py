"""Post-training under data, tensor and context parallelism (merged into ``_parity.py``'s launch): the
loss and gradients of a batch of packed documents (block-diagonal attention, per-document positions)
against the single-process loss of the same documents one a row, unpacked; and a LoRA model's, its
adapters sharded by their logical axes, against the single-process LoRA model.

Under cp the positions and document ids are split into head-tail chunks with the tokens
(``shard_batch``), and each rank's queries see the all-gathered keys of their own document only.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py packed_tp2_cp2``.
"""

from __future__ import annotations

import torch

import ftitan as ft
from ftitan.data import pack_documents
from ftitan.models import llama, lora
from ftitan.train.losses import IGNORE_INDEX
from _parity import max_diff, parallel_grads, tiny_llama  # torchrun puts this folder on sys.path

SEQ = 24


def _documents(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    lengths = [7, 11, 4, 9, 13, 6, 15, 3, 8, 10, 5, 12]
    return [(torch.randint(1, vocab, (n,), generator=g), (torch.rand(n, generator=g) < 0.7).long()) for n in lengths]


def _unpacked(docs) -> dict[str, torch.Tensor]:
    batch = {"inputs": torch.zeros(len(docs), SEQ, dtype=torch.int64), "targets": torch.full((len(docs), SEQ), IGNORE_INDEX)}
    for i, (ids, mask) in enumerate(docs):
        n = ids.shape[0] - 1
        batch["inputs"][i, :n] = ids[:-1]
        batch["targets"][i, :n] = torch.where(mask[1:].bool(), ids[1:], IGNORE_INDEX)
    return batch


def packed_check(name: str, degrees: dict[str, int], impl: str = "sdpa") -> dict:
    model = llama.model(tiny_llama(attn_impl=impl))
    params = model.init(ft.random.key(0))
    docs = _documents(model.config.vocab_size)
    packed = pack_documents(docs, seq_len=SEQ).batch
    rows = packed["inputs"].shape[0]
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    ref_g, (ref_l, _) = ft.train.value_and_grad(loss_fn)(params, _unpacked(docs))
    total, full, _, _, _ = parallel_grads(model, params, loss_fn, packed, degrees)
    return {"check": name, "rows": rows, "docs": len(docs), "loss_diff": abs(float(total) - float(ref_l)),
            "grad_diff": max_diff(full, ref_g),
            "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g))}  # fmt: skip


def lora_check(name: str, degrees: dict[str, int]) -> dict:
    lm = lora.lora(llama.model(tiny_llama()), rank=4, alpha=8.0)
    params = lm.init(ft.random.key(0))
    g = torch.Generator().manual_seed(5)  # non-zero adapters: B's gradient alone would hide A's
    params["lora"] = ft.tree.map(lambda x: torch.randn(x.shape, generator=g) * 0.05, params["lora"])
    tokens = torch.randint(0, lm.config.vocab_size, (4, 17), generator=g)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss_fn = ft.train.next_token_loss(lm, chunk_size=24)
    ref_g, (ref_l, _) = ft.train.value_and_grad(loss_fn)(params, batch)
    total, full, _, _, sharded = parallel_grads(lm, params, loss_fn, batch, degrees)
    placements = {p: str(x.placements) for p, x in zip(*ft.tree.flatten_with_paths(sharded)[:2], strict=True)
                  if p.startswith("lora.layers.0.attn.wq")}  # fmt: skip
    return {"check": name, "loss_diff": abs(float(total) - float(ref_l)),
            "grad_diff": max_diff(full["lora"], ref_g["lora"]), "placements": placements,
            "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g["lora"]))}  # fmt: skip


CHECKS = {
    "lora_dp_shard2_tp2": lambda: lora_check("lora_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
    "packed_dp_shard2_tp2": lambda: packed_check("packed_dp_shard2_tp2", {"dp_shard": 2, "tp": 2}),
    "packed_tp2_cp2": lambda: packed_check("packed_tp2_cp2", {"tp": 2, "cp": 2}, impl="math"),
}
