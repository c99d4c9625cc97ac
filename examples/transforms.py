"""torch.func over whole models: per-example gradients, an ensemble, a Hessian-vector product, a filtered grad.

A model is a pure function of its params tree, so JAX-style transforms apply
to the model and the loss as they are:

    python examples/transforms.py [--family qwen3_moe]

Each section prints one line and checks itself against a plain loop.
"""

from __future__ import annotations

import argparse

import attrs
import torch
from torch.func import grad, jvp, vmap

import ftitan as ft
from ftitan.models import hf


def tiny_model(family: str) -> ft.models.Model:
    """The family's debug config shrunk to 2 layers, dim 64 (fields it lacks are skipped)."""
    fam = next(f for f in hf.families() if f.name == family)
    cfg = fam.config_type.debug()
    small = {"vocab_size": 128, "dim": 64, "n_layers": 2, "ffn_dim": 128, "expert_dim": 32, "moe_ffn_dim": 32}
    names = {f.name for f in attrs.fields(type(cfg))}
    return fam.model(attrs.evolve(cfg, **{k: v for k, v in small.items() if k in names}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama", help="a registered model family")
    args = parser.parse_args()

    model = tiny_model(args.family)
    params = model.init(ft.random.key(0))
    loss_fn = ft.train.next_token_loss(model)
    tokens = torch.randint(0, model.config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}  # (B, T)

    # 1. per-example gradients: vmap(grad(loss)), each row seen as a batch of one
    grads, (losses, _aux) = ft.train.per_example_grads(loss_fn)(params, batch)
    norms = torch.stack([ft.tree.global_norm(ft.tree.map(lambda g, i=i: g[i], grads)) for i in range(4)])
    loop = grad(lambda p: loss_fn(p, {k: v[:1] for k, v in batch.items()})[0])(params)
    assert torch.allclose(norms[0], ft.tree.global_norm(loop), rtol=1e-4)
    rounded = [round(x, 3) for x in losses.tolist()]
    print(f"per-example grad norms {[round(x, 4) for x in norms.tolist()]}  losses {rounded}")

    # 2. an ensemble: four inits in one vmapped init (keys are tensors), one vmapped apply
    keys = ft.random.split(ft.random.key(1), 4)
    stacked = vmap(model.init)(keys)  # every leaf (4, ...): tree.stack of the four inits
    members = ft.tree.unstack(stacked)
    assert all(torch.equal(a, b) for a, b in zip(ft.tree.leaves(members[2]), ft.tree.leaves(model.init(keys[2]))))
    logits = vmap(lambda p: model.apply(p, batch["inputs"])[0])(stacked)  # (4, B, T, V)
    assert torch.allclose(logits[2], model.apply(members[2], batch["inputs"])[0], atol=1e-5)
    print(f"ensemble logits {tuple(logits.shape)}  member spread {logits.std(0).mean().item():.4f}")

    # 3. a Hessian-vector product: forward-over-reverse, jvp(grad(loss)); the fused cross-entropy
    #    and SDPA step aside by themselves (their gradients/kernels have no derivatives of their own)
    v = ft.tree.map(torch.randn_like, params)
    _, hvp = jvp(grad(lambda p: loss_fn(p, batch)[0]), (params,), (v,))
    vhv = sum((a * b).sum() for a, b in zip(ft.tree.leaves(v), ft.tree.leaves(hvp), strict=True))
    print(f"v^T H v = {vhv.item():.4f}  (curvature along a random direction)")

    # 4. the equinox filter idiom: grad over the trainable half of a partitioned tree
    trainable, frozen = ft.tree.partition(params, "layers.*.attn.*")
    attn_grads = ft.train.filter_grad(lambda t: loss_fn(ft.tree.combine(t, frozen), batch)[0])(trainable)
    n = sum(x.numel() for x in ft.tree.leaves(attn_grads))
    full = grad(lambda p: loss_fn(p, batch)[0])(params)
    for got, want in zip(ft.tree.leaves(attn_grads), ft.tree.leaves(ft.tree.partition(full, "layers.*.attn.*")[0])):
        assert torch.allclose(got, want, atol=1e-6)
    print(f"filtered grad: {n} attention weights of {ft.tree.size(params)} params differentiated")


if __name__ == "__main__":
    main()
