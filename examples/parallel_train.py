"""The same training loop on a mesh: FSDP x TP x CP by flags, on CPU ranks (gloo).

    torchrun --standalone --nproc-per-node 4 examples/parallel_train.py --dp-shard 2 --tp 2
    torchrun --standalone --nproc-per-node 4 examples/parallel_train.py --tp 2 --cp 2 --steps 20

The model, loss and optimizer are the single-process ones (examples/train_loop.py);
what changes is data about trees: a mesh, the rules table, params placed by it,
and each rank's part of the batch. Rank 0 prints the loss of the global batch,
then the placement of a few leaves.
"""

import argparse
import pathlib

import attrs
import torch
import torch.distributed as dist

import ftitan as ft
from ftitan import parallel
from ftitan.models import llama

parser = argparse.ArgumentParser()
for axis in ("dp_replicate", "dp_shard", "cp", "tp"):
    parser.add_argument(f"--{axis.replace('_', '-')}", type=int, default=1)
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
layout = parallel.Layout(parallel.mesh(dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, cp=args.cp, tp=args.tp))
main = dist.get_rank() == 0

data = torch.tensor(list(pathlib.Path(torch.__file__).read_bytes()), dtype=torch.long)
model = llama.model(attrs.evolve(llama.Config.debug(), vocab_size=256, n_layers=2))
params = parallel.shard_params(model.init(ft.random.key(0)), model.param_axes, layout.rules, layout)
opt = ft.optim.chain(ft.optim.clip_by_global_norm(1.0),
                     ft.optim.adamw(ft.optim.warmup_cosine(3e-3, warmup=4, total=args.steps), weight_decay=0.1))
step = parallel.make_train_step(ft.train.next_token_loss(model), opt, layout)
state = ft.train.init_state(params, opt)
gen = torch.Generator().manual_seed(0)  # every rank draws the same global batch, then keeps its part
for i in range(args.steps):
    starts = torch.randint(0, len(data) - 129, (8,), generator=gen)
    rows = torch.stack([data[s : s + 129] for s in starts.tolist()])  # (8, 129)
    batch = parallel.shard_batch({"inputs": rows[:, :-1], "targets": rows[:, 1:]}, layout)
    state, metrics = step(state, batch)
    if main and (i % 10 == 0 or i == args.steps - 1):
        print(f"step {i:4d}  loss {float(metrics['loss']):.4f}  grad_norm {float(metrics['grad_norm']):.3f}", flush=True)
if main:
    print(layout)
    dump = parallel.dump(ft.tree.map(parallel.sharding_of, state.params))
    for path in ("embed", "layers.0.attn.wq", "layers.0.attn.wo", "layers.0.attn_norm"):
        print(f"{path:20s} {dump[path]}")
parallel.end_rank()  # shutdown, then exit without finalization (ftitan.parallel.end_rank)
