"""On a CUDA machine: ``ftitan train`` on the GPU in bf16, with CUDA's sync debug mode watching every step, then
compiled generation from the trained params on the GPU.

Prints one ``RESULT {...}`` JSON line: the run's losses, and every synchronizing CUDA call seen outside
record / evaluation / checkpoint steps (there must be none). Run from the repository root:
``python .ci/gpu_train_check.py [steps]``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings

import attrs
import torch

from ftitan.config import get_recipe
from ftitan.config.schema import MixedPrecisionConfig
from ftitan.train import runtime, trainer

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
LOG_EVERY = 20
WARMUP = 3  # the first calls compile (autotuning synchronizes)


def main() -> None:
    cfg = attrs.evolve(get_recipe("llama3-debug"), steps=STEPS, log_every=LOG_EVERY, eval_every=0, ckpt_every=0,
                       device="cuda", mixed_precision=MixedPrecisionConfig(compute="bf16"),
                       run_dir=tempfile.mkdtemp(prefix="ftitan-gpu-"))  # fmt: skip
    current = {"step": 0}
    syncs: list[tuple[int, str]] = []
    make_step = runtime.Runtime.make_step

    def watched_make_step(self, *args, **kwargs):
        step_fn = make_step(self, *args, **kwargs)

        def step(state, batch):
            current["step"] += 1
            k = current["step"]
            torch.cuda.set_sync_debug_mode("warn" if k > WARMUP else "default")
            out = step_fn(state, batch)
            if k % LOG_EVERY == 0 or k == STEPS:  # the loop reads metrics back after this step
                torch.cuda.set_sync_debug_mode("default")
            return out

        return step

    runtime.Runtime.make_step = watched_make_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = trainer.train(cfg, progress=False)
        syncs = [(0, str(w.message)[:200]) for w in caught if "synchroniz" in str(w.message)]
    torch.cuda.set_sync_debug_mode("default")
    from ftitan import infer, random

    tok = out["tokenizer"]
    sample = infer.generate(out["model"], out["params"], [tok.encode("def ")], max_new_tokens=16, compile=True,
                            key=random.key(0), sampling=infer.Sampling(temperature=0.8))  # fmt: skip
    losses = [(r["step"], r["loss"], r.get("tokens_per_s")) for r in out["records"] if "loss" in r]
    dtypes = sorted({f"{x.dtype}@{x.device.type}" for x in torch.utils._pytree.tree_leaves(out["params"])})
    print("RESULT " + json.dumps({"check": "gpu_train", "losses": losses, "eval_loss": out["eval_loss"],
                                  "unexpected_syncs": syncs, "param_dtypes": dtypes,
                                  "sample": tok.decode(tok.encode("def ") + sample[0]),
                                  "device": str(torch.cuda.get_device_name())}))  # fmt: skip


if __name__ == "__main__":
    main()
