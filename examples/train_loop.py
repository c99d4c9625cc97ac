"""The training loop as function composition: a byte-level Llama on real text.

    python examples/train_loop.py [--steps 200] [--optimizer adamw|muon] [--no-compile] [--kernels triton]
                                  [--gemm-library auto|aten|onednn|onednn-matmul] [--float8 tensorwise|rowwise]
                                  [--attn-impl gemm] [--fuse-projections]

Trains ``llama.Config.debug()`` (vocab 256: one token per byte) on the source
of ``torch/__init__.py``; loss falls from ln(256) ~ 5.5 in a few dozen steps.
``--kernels triton``: the model's kernels by ``ftitan.kernels`` (Triton on CUDA; on the CPU the linear
layers' and the gemm attention's GEMMs in MKL or oneDNN, the fastest per shape, or the one ``--gemm-library`` names:
``ftitan.kernels.onednn.pin``; the picks are printed at the end), differentiated on the autograd path they
need (``gradient_path`` of the model config's ``step_options``, as ``ftitan train`` picks it).
``--float8 rowwise``: the blocks' projections in float8 by that torchao recipe (float8 GEMMs on an H100-class
GPU, torchao's emulation elsewhere; ``ftitan.nn.float8``), on the autograd path too.
``--attn-impl gemm``: causal attention as GEMMs over 64-query blocks on the CPU (``ftitan.nn.attention``;
faster there than SDPA's flash kernel for rows of a few hundred tokens; SDPA elsewhere).
``--fuse-projections``: the params hold q/k/v and gate/up stacked (``wqkv``, ``w13``: one GEMM each, the
same model and the same AdamW run to float32 rounding; ``ftitan.models.fused``). Not with Muon, which
orthogonalizes each matrix.
"""

import argparse
import pathlib

import attrs
import torch

import ftitan as ft
from ftitan.kernels import onednn
from ftitan.models import llama
from ftitan.train.runtime import gradient_path, step_options

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
parser.add_argument("--no-compile", action="store_true")
parser.add_argument("--kernels", choices=["torch", "triton"], default="torch")
parser.add_argument("--gemm-library", choices=["auto", *onednn.LIBRARIES], default="auto")
parser.add_argument("--float8", choices=["", "tensorwise", "rowwise"], default="")
parser.add_argument("--attn-impl", choices=["sdpa", "gemm", "math", "flex", "auto"], default="sdpa")
parser.add_argument("--fuse-projections", action="store_true")
args = parser.parse_args()
if args.fuse_projections and args.optimizer == "muon":
    parser.error("--fuse-projections: Muon orthogonalizes each matrix, and wqkv / w13 are several; use adamw")

onednn.pin(None if args.gemm_library == "auto" else args.gemm_library)  # the CPU GEMMs' library (--kernels triton)
data = torch.tensor(list(pathlib.Path(torch.__file__).read_bytes()), dtype=torch.long)
model = llama.model(attrs.evolve(llama.Config.debug(), vocab_size=256, kernels=args.kernels, float8=args.float8,
                                 attn_impl=args.attn_impl, fuse_projections=args.fuse_projections))
params = model.init(ft.random.key(0))
lr = ft.optim.warmup_cosine(3e-3, warmup=args.steps // 10, total=args.steps)
if args.optimizer == "muon":  # Muon on hidden matrices, AdamW on embeddings/head/norms
    inner = ft.optim.muon_with_adamw(params, lr=lr, shape_scaling="match_rms_adamw")
else:
    inner = ft.optim.adamw(lr, weight_decay=0.1)
opt = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), inner)
# donate: each step writes the new params and optimizer state into the old state's buffers (in place)
step = ft.train.make_train_step(ft.train.next_token_loss(model), opt, donate=True,
                                grad_impl=gradient_path(**step_options(model.config)))
if not args.no_compile:
    step = torch.compile(step, fullgraph=True)
state = ft.train.init_state(params, opt)
ft.train.retain_freed_memory()  # the CPU heap keeps what a step frees for the next (docs/compile-and-memory.md)
gen = torch.Generator().manual_seed(0)
for i in range(args.steps):
    starts = torch.randint(0, len(data) - 129, (8,), generator=gen)
    rows = torch.stack([data[s : s + 129] for s in starts.tolist()])  # (8, 129)
    state, metrics = step(state, {"inputs": rows[:, :-1], "targets": rows[:, 1:]})
    if i % 10 == 0 or i == args.steps - 1:
        print(f"step {i:4d}  loss {float(metrics['loss']):.4f}  lr {float(metrics['lr']):.2e}", flush=True)
if args.kernels != "torch":
    print(f"gemm libraries {onednn.choices()}")  # {"nt 1024x256x768": "onednn", ...}: each GEMM kind and shape's
