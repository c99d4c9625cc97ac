"""SFT, LoRA and DPO as function composition: one model, three train steps, packed chat data.

    python examples/sft_lora.py [--sft-steps 150] [--lora-steps 40] [--dpo-steps 30]

1. Full SFT of a tiny Llama, from scratch, on a synthetic chat task (reverse 3-5 letters), the
   conversations packed several to a row with no attention between them; greedy exact match on
   held-out questions before and after.
2. LoRA on top: the SFT weights frozen as the base, rank-8 adapters the only trained leaves.
3. DPO with the same adapters: the SFT model is its own reference (the base, adapters off).
The command line does the same: ``ftitan train --recipe sft-debug`` and ``--recipe dpo-debug``.
"""

import argparse

import attrs
import torch

import ftitan as ft
from ftitan.data import tasks
from ftitan.models import llama, lora
from ftitan.train.dpo import dpo_loss_fn, with_reference
from ftitan.train.exact_match import exact_match_eval

parser = argparse.ArgumentParser()
parser.add_argument("--sft-steps", type=int, default=150)
parser.add_argument("--lora-steps", type=int, default=40)
parser.add_argument("--dpo-steps", type=int, default=30)
args = parser.parse_args()
torch.manual_seed(0)

# --- data: conversations -> (ids, assistant mask) -> packed rows {inputs, targets, positions, segments}
template = ft.data.load_chat_template(None)  # the built-in template (a checkpoint's own: load_chat_template(dir))
train_items = tasks.task_items(2000, seed=0, split="train")
held_out = tasks.task_items(100, seed=0, split="eval")
tok = ft.data.train_tokenizer((template.render(it["messages"]) for it in train_items), vocab_size=316)
examples = [ft.data.encode_chat(it["messages"], template, tok, seq_len=129) for it in train_items]
rows = ft.data.pack_documents([(ex.ids, ex.mask) for ex in examples], seq_len=128).batch
print(f"{len(examples)} conversations packed into {rows['inputs'].shape[0]} rows of 128 tokens")


def batches(fields: dict[str, torch.Tensor], size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        pick = torch.randint(0, next(iter(fields.values())).shape[0], (size,), generator=g)
        yield {k: v[pick] for k, v in fields.items()}


def train(step, state, data, steps: int, label: str):
    for i in range(steps):
        state, m = step(state, next(data))
        if i % 20 == 0 or i == steps - 1:
            extra = f"  reward accuracy {float(m['rewards/accuracy']):.2f}" if "rewards/accuracy" in m else ""
            print(f"{label} step {i:3d}  loss {float(m['loss']):.4f}{extra}", flush=True)
    return state


def score(model, params) -> str:
    s = exact_match_eval(model, params, tok, template, held_out, max_new_tokens=16, batch_size=50)
    return f"exact match {s['exact_match']:.2f}, parse rate {s['parse_rate']:.2f}"


# --- 1. full SFT: the loss is the mean over assistant tokens, whatever row a conversation landed in
cfg = attrs.evolve(llama.Config.debug(), vocab_size=tok.vocab_size, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                   ffn_dim=384, max_seq_len=128)  # fmt: skip
model = llama.model(cfg)
params = model.init(ft.random.key(0))
print(f"untrained: {score(model, params)}")
opt = ft.optim.adamw(ft.optim.warmup_cosine(3e-3, warmup=min(10, args.sft_steps // 2), total=args.sft_steps), weight_decay=0.0)
step = ft.train.make_train_step(ft.train.next_token_loss(model), opt)
state = train(step, ft.train.init_state(params, opt), batches(rows, 16, seed=1), args.sft_steps, "sft")
print(f"after SFT: {score(model, state.params)}")

# --- 2. LoRA: the SFT weights are the frozen base; only lora.** is differentiated and has optimizer state
lm = lora.lora(model, rank=8, alpha=16.0)
lparams = lora.add_adapters(lm.config, state.params, ft.random.key(1))
opt = ft.optim.adamw(1e-3, weight_decay=0.0)
step = ft.train.make_train_step(ft.train.next_token_loss(lm), opt, trainable=lora.TRAINABLE)
lstate = train(step, ft.train.init_state(lparams, opt, trainable=lora.TRAINABLE), batches(rows, 16, seed=2),
               args.lora_steps, "lora")  # fmt: skip
merged_model, merged = lora.merged_model(lm, lstate.params)  # base-shaped: ft.models.save_hf, vLLM
print(f"after LoRA: {score(merged_model, merged)}")

# --- 3. DPO on the adapters: prefer the house style; the reference is the base (adapters off)
records = list(ft.data.parse_preferences(ft.data.synthetic_preferences(512, seed=0, kind="format"), "synthetic"))
pairs = ft.data.collate_preferences(list(ft.data.encode_preferences(records, template, tok, seq_len=48)))
reference = lambda batch: with_reference(model, state.params, batch)  # noqa: E731  (frozen SFT weights)
opt = ft.optim.adamw(1e-3, weight_decay=0.0)
step = ft.train.make_train_step(dpo_loss_fn(lm, beta=0.1), opt, trainable=lora.TRAINABLE)
dstate = ft.train.init_state(lstate.params, opt, trainable=lora.TRAINABLE)
dstate = train(step, dstate, map(reference, batches(pairs, 16, seed=3)), args.dpo_steps, "dpo")
