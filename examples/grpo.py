"""GRPO as function composition: rollout -> rewards -> group advantages -> make_train_step.

    python examples/grpo.py [--sft-steps 70] [--rl-steps 60] [--group-size 8] [--no-compile]

A tiny Llama first learns the chat format of a synthetic task (sort 3-5 digits) by a short SFT on the
environment's demonstrations, packed; then GRPO (Shao et al. 2024) raises the reward of its samples:
G samples per prompt from the same pure model (``ft.rl.rollout``), exact-match rewards from the
environment, group-normalized advantages, and the clipped policy loss (``ft.rl.grpo_loss_fn``) in an
ordinary ``make_train_step``. No second model definition, no trainer class: every line is a function.
``ftitan rl --recipe grpo-arith`` is this loop with checkpoints, metrics and async rollouts.
"""

import argparse

import attrs
import torch

import ftitan as ft
from ftitan.models import llama

parser = argparse.ArgumentParser()
parser.add_argument("--sft-steps", type=int, default=70)
parser.add_argument("--rl-steps", type=int, default=60)
parser.add_argument("--group-size", type=int, default=8)
parser.add_argument("--prompts", type=int, default=8)
parser.add_argument("--no-compile", action="store_true")
args = parser.parse_args()
G, P = args.group_size, args.prompts

env = ft.rl.ENVS["sort"]  # prompts + a verifiable reward (exact match of "The answer is 2 7 9.")
template = ft.data.load_chat_template(None)  # the built-in chat template
demos = ft.rl.demonstrations(env, 4000, seed=0)  # solved conversations of the train split
tok = ft.data.train_tokenizer((template.render(list(d)) for d in demos), vocab_size=300)
cfg = attrs.evolve(llama.Config.debug(), vocab_size=300, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384,
                   max_seq_len=128)  # fmt: skip
model = llama.model(cfg)


def compiled(step):
    return step if args.no_compile else torch.compile(step, fullgraph=True)


# --- SFT: the format, and some of the answers (the loss on the assistant's tokens, conversations packed)
docs = [(e.ids, e.mask) for e in (ft.data.encode_chat(d, template, tok, seq_len=65) for d in demos)]
rows = ft.data.pack_documents(docs, seq_len=64).batch
opt = ft.optim.adamw(ft.optim.warmup_cosine(3e-3, warmup=5, total=args.sft_steps), weight_decay=0.1)
sft_step = compiled(ft.train.make_train_step(ft.train.next_token_loss(model), opt))
state = ft.train.init_state(model.init(ft.random.key(0)), opt)
order = torch.randperm(rows["inputs"].shape[0], generator=torch.Generator().manual_seed(0))
for i in range(args.sft_steps):
    pick = order[(i * 16) % len(order):][:16]
    state, m = sft_step(state, {k: v[pick] for k, v in rows.items()})
print(f"sft: {args.sft_steps} steps, loss {float(m['loss']):.3f}", flush=True)

# --- GRPO: each step samples from the current policy, scores, and updates it once
opt = ft.optim.adamw(3e-4, weight_decay=0.0)
rl_step = compiled(ft.train.make_train_step(ft.rl.grpo_loss_fn(model, clip_high=0.28, tis_cap=2.0), opt))
state = ft.train.init_state(state.params, opt)
for i in range(args.rl_steps):
    prompts = env.prompts(P, seed=1000 + i, split="train")
    ro = ft.rl.rollout(model, state.params, prompts, reward=env.reward, tokenizer=tok, template=template,
                       group_size=G, max_new_tokens=16, key=ft.random.key(i))  # fmt: skip
    batch = {**ro.batch, "advantages": ft.rl.group_advantages(ro.rewards, G)}  # one update: old_logp = logp
    state, m = rl_step(state, batch)
    print(f"rl step {i:3d}  reward {float(ro.rewards.mean()):.3f}  entropy {float(m['entropy']):.3f}  "
          f"clip {float(m['clip_fraction']):.3f}  mismatch_kl {float(m['mismatch_kl']):.1e}", flush=True)
