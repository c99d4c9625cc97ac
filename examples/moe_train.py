"""Training a mixture-of-experts model as function composition, watching expert load.

    python examples/moe_train.py [--family deepseek_v3|qwen3_moe] [--steps 200] [--no-compile]

DeepSeek-V3 keeps experts balanced without an auxiliary loss: a per-expert
bias, used only to choose experts, is nudged after every step towards the
under-loaded ones. That bias is state, not a weight: ``optim.freeze`` keeps
the optimizer off it and the model's ``update_buffers`` moves it, inside the
same pure (and compilable) step. Qwen3-MoE balances with the Switch loss
instead, which ``next_token_loss`` adds for any model that returns one.
``moe.max_load`` is the busiest expert's share over the mean (1.0 = even).
"""

import argparse
import pathlib

import attrs
import torch

import ftitan as ft
from ftitan.models import deepseek_v3, qwen3_moe

parser = argparse.ArgumentParser()
parser.add_argument("--family", choices=["deepseek_v3", "qwen3_moe"], default="deepseek_v3")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--no-compile", action="store_true")
args = parser.parse_args()

family = {"deepseek_v3": deepseek_v3, "qwen3_moe": qwen3_moe}[args.family]
model = family.model(attrs.evolve(family.Config.debug(), vocab_size=256, n_layers=2))  # one token per byte
params = model.init(ft.random.key(0))
lr = ft.optim.warmup_cosine(3e-3, warmup=args.steps // 10, total=args.steps)
opt = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(lr), ft.optim.freeze(model.frozen))
step = ft.train.make_train_step(ft.train.next_token_loss(model), opt, update_buffers=model.update_buffers)
if not args.no_compile:
    step = torch.compile(step, fullgraph=True)
state = ft.train.init_state(params, opt)

data = torch.tensor(list(pathlib.Path(torch.__file__).read_bytes()), dtype=torch.long)
gen = torch.Generator().manual_seed(0)
for i in range(args.steps):
    starts = torch.randint(0, len(data) - 129, (8,), generator=gen)
    rows = torch.stack([data[s : s + 129] for s in starts.tolist()])  # (8, 129)
    state, metrics = step(state, {"inputs": rows[:, :-1], "targets": rows[:, 1:]})
    if i % 10 == 0 or i == args.steps - 1:
        load = metrics["moe.tokens_per_expert"][-1].int().tolist()  # last MoE layer, tokens per expert
        print(f"step {i:4d}  loss {float(metrics['ce_loss'] if 'ce_loss' in metrics else metrics['loss']):.4f}  "
              f"max_load {float(metrics['moe.max_load']):.2f}  load {load}", flush=True)
