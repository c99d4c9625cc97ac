"""A training step over FlexShard state, written as function composition, on CPU ranks (gloo).

    torchrun --standalone --nproc-per-node 4 examples/flexshard_train.py
    torchrun --standalone --nproc-per-node 4 examples/flexshard_train.py --quantize fp8 --steps 40

The state is a plain tree of this rank's parts (``plan.shard``); a step gathers the params
(one all-gather per bucket, int8 blockwise-quantized by default), runs the single-process
loss on this rank's rows, differentiates back to the parts (one reduce-scatter per bucket,
full precision), and updates the parts with distributed Muon: each rank orthogonalizes
only the matrices it owns and the attention heads it holds. Rank 0 prints the loss of
the global batch and where a few leaves live.
"""

import argparse
import pathlib

import attrs
import torch
import torch.distributed as dist

import ftitan as ft
from ftitan import flexshard as fs
from ftitan import parallel
from ftitan.models import llama

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--quantize", choices=["int8", "fp8", "none"], default="int8")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
group = parallel.mesh(dp_shard=dist.get_world_size())["dp_shard"]
main = dist.get_rank() == 0

cfg = attrs.evolve(llama.Config.debug(), vocab_size=256, n_layers=2)  # dim 256, 8 heads of 32, 2 kv heads
model = llama.model(cfg)
params = model.init(ft.random.key(0))
head_dim = cfg.dim // cfg.n_heads
quantize = None if args.quantize == "none" else args.quantize
buckets = [
    fs.Bucket(["layers.*.attn.wq", "layers.*.attn.wk", "layers.*.attn.wv"], fs.BlockShard(0, head_dim), name="heads"),
    fs.Bucket(["layers.*.attn.wo", "layers.*.mlp.*"], fs.Owned(), quantize=quantize, name="matrices"),
    fs.Bucket("**.*norm*", fs.Replicate(), name="norms"),
    fs.Bucket("**", fs.Shard(0), quantize=quantize, name="rest"),  # embed, head: AdamW, rows split
]
plan = fs.plan(params, buckets, group)
blocks = {f"layers.*.attn.{w}": (0, head_dim) for w in ("wq", "wk", "wv")}  # per-head Muon, where the heads are
opt = fs.muon_with_adamw(plan, params, lr=0.02, adamw_lr=3e-3, blocks=blocks)
loss_fn = ft.train.next_token_loss(model)


def train_step(local, opt_state, rows):
    """(parts, optimizer state, this rank's rows) -> (parts, optimizer state, loss of the global batch, grad norm)."""
    local = ft.tree.map(lambda x: x.detach().requires_grad_(), local)
    loss = loss_fn(plan.gather_all(local), rows)[0] / plan.world  # this rank's share of the global mean
    grads = ft.tree.unflatten(ft.tree.structure(local), torch.autograd.grad(loss, ft.tree.leaves(local)))
    updates, opt_state = opt.update(grads, opt_state, local)
    local = ft.optim.apply_updates(ft.tree.map(torch.Tensor.detach, local), updates)
    return local, opt_state, parallel.collectives.all_reduce_value(loss.detach(), group), plan.global_norm(grads)


local = plan.shard(params)
opt_state = opt.init(local)
data = torch.tensor(list(pathlib.Path(torch.__file__).read_bytes()), dtype=torch.long)
gen = torch.Generator().manual_seed(0)  # every rank draws the same global batch, then keeps its rows
for i in range(args.steps):
    starts = torch.randint(0, len(data) - 129, (8,), generator=gen)
    batch = torch.stack([data[s : s + 129] for s in starts.tolist()])
    mine = batch.chunk(plan.world)[plan.rank]
    local, opt_state, loss, norm = train_step(local, opt_state, {"inputs": mine[:, :-1], "targets": mine[:, 1:]})
    if main and (i % 10 == 0 or i == args.steps - 1):
        print(f"step {i:4d}  loss {float(loss):.4f}  grad_norm {float(norm):.3f}", flush=True)
if main:
    print(plan)
    for path in ("embed", "layers.0.attn.wq", "layers.0.mlp.w1", "layers.0.attn_norm"):
        lp = plan.leaves[path]
        where = f"owner rank {lp.owner}" if lp.owner is not None else f"rows {[hi - lo for lo, hi in lp.rows]}"
        print(f"{path:20s} {type(lp.placement).__name__:10s} {where}")
parallel.end_rank()  # shutdown, then exit without finalization (ftitan.parallel.end_rank)
