"""One model, two inference engines: ftitan's native generate and vLLM, running the same pure functions.

    python examples/vllm_generate.py [--run runs/llama3-debug] [--max-new-tokens 16]

Builds a tiny byte-level Llama (or loads the newest checkpoint of an ``ftitan train`` run), generates
greedily with ``ft.infer.generate`` and with a vLLM engine on the same params, checks that the tokens
are identical, then pushes perturbed weights into the running engine (as an RL loop does after each
optimizer step) and checks again. Needs vLLM (``make install``); about 15 s on 2 CPU cores.
"""

import argparse
import os
import time

import attrs

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs each engine's whole config at INFO; read at import

import ftitan as ft
import ftitan.vllm  # before vllm: points vLLM's caches at the repo's .cache/, in-process engines
from ftitan.models import llama
from ftitan.train.trainer import load_run
from vllm import SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--run", default=None, help="an ftitan run directory (default: a random byte-level Llama)")
parser.add_argument("--max-new-tokens", type=int, default=16)
args = parser.parse_args()

if args.run:
    _, model, params, tok, _ = load_run(args.run)
    encode = tok.encode
else:  # byte-level: token i is byte i; head_dim 256 // 8 = 32, a size vLLM's CPU attention supports
    model = llama.model(attrs.evolve(llama.Config.debug(), vocab_size=256, init_std=0.1))
    params = model.init(ft.random.key(0))
    encode = lambda s: list(s.encode())  # noqa: E731
texts = ["def fibonacci(n):", "import torch\n", "The quick brown fox"]
prompts = [encode(s) for s in texts]  # ragged lengths


def both(params: dict) -> list[list[int]]:
    """Greedy continuations from native generation and from vLLM; they must be the same tokens."""
    native = ft.infer.generate(model, params, prompts, max_new_tokens=args.max_new_tokens)
    greedy = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0)
    served = [c.tokens for c in ft.vllm.complete(llm, prompts, greedy)]
    assert served == native, f"vLLM {served} != native {native}"
    return served


start = time.perf_counter()
llm = ft.vllm.engine((model, params), dtype="float32", kv_cache_bytes=128 << 20)  # exports, then loads
print(f"engine up in {time.perf_counter() - start:.1f} s")
before = both(params)
for text, out in zip(texts, before):
    print(f"{text!r} -> {out[:8]} ...")

# new weights, e.g. after a training step: copied into the running engine, prefix cache reset
new = ft.tree.map(lambda x: x * (1 + 0.1 * ft.random.normal(ft.random.key(1), x.shape)), params)
start = time.perf_counter()
ft.vllm.push_weights(llm, new)
print(f"push_weights in {1e3 * (time.perf_counter() - start):.1f} ms")
after = both(new)
print(f"after push: {sum(a != b for a, b in zip(after, before))}/{len(prompts)} completions changed")
print("native == vllm: True")
ft.vllm.close(llm)
