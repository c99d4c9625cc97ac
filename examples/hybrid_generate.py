"""A Gated DeltaNet hybrid (Qwen3.5) trained as function composition, then generating through its cache.

    python examples/hybrid_generate.py [--steps 150] [--no-compile]

Three of every four layers of Qwen3.5 / Qwen3-Next are linear attention (Gated DeltaNet): during
training they run the chunked delta rule over the whole row; when generating they keep a recurrent
state instead of keys and values. ``ft.infer.init_cache`` asks the model what each layer keeps (keys
and values for the attention layer, a conv window and a (heads, Dk, Dv) state for the others), and the
same ``generate`` call as for any family decodes from it, one token at a time, in constant memory per
linear layer. The last lines check that prefill + decode give the full forward's logits.
"""

import argparse
import pathlib

import attrs
import torch

import ftitan as ft
from ftitan.infer import init_cache
from ftitan.models import qwen3_5, qwen3_next

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--no-compile", action="store_true")
args = parser.parse_args()

cfg = attrs.evolve(qwen3_5.debug(), vocab_size=256, dim=128, ffn_dim=256)  # one token per byte
model = qwen3_next.model(cfg)
params = model.init(ft.random.key(0))
opt = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(ft.optim.warmup_cosine(3e-3, 10, args.steps)))
step = ft.train.make_train_step(ft.train.next_token_loss(model), opt)
if not args.no_compile:
    step = torch.compile(step, fullgraph=True)
state = ft.train.init_state(params, opt)

data = torch.tensor(list(pathlib.Path(torch.__file__).read_bytes()), dtype=torch.long)
gen = torch.Generator().manual_seed(0)
for i in range(args.steps):
    starts = torch.randint(0, len(data) - 129, (8,), generator=gen)
    rows = torch.stack([data[s : s + 129] for s in starts.tolist()])  # (8, 129)
    state, metrics = step(state, {"inputs": rows[:, :-1], "targets": rows[:, 1:]})
    if i % 25 == 0 or i == args.steps - 1:
        print(f"step {i:4d}  loss {float(metrics['loss']):.4f}", flush=True)

params = state.params
cache = init_cache(model, params, batch=1, slots=64)
for name, entry in sorted(cache.layers.items()):
    kind = "attention" if "k" in entry else "Gated DeltaNet"
    print(f"layer {name} ({kind}) keeps " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in entry.items()))

prompts = ["import torch\n", "def "]
out = ft.infer.generate(model, params, [list(p.encode()) for p in prompts], max_new_tokens=40)
for p, tokens in zip(prompts, out, strict=True):
    print(repr(p + bytes(tokens).decode(errors="replace")))

tokens = torch.tensor([list(b"import torch\nimport ftitan as ft\n")])
prefill, decode = ft.infer.make_prefill(model), ft.infer.make_decode_step(model)
logits, cache = prefill(params, tokens[:, :-4], init_cache(model, params, batch=1, slots=64))
for j in range(4, 0, -1):
    logits, cache = decode(params, tokens[:, -j], cache)
full, _ = model.apply(params, tokens)
print(f"cached vs full forward: max |logit diff| {float((logits[0] - full[0, -1]).abs().max()):.1e}")
