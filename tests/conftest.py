import os
from pathlib import Path

# keep compile caches inside the repo's ignored cache, never in the system temp dir
_CACHE = Path(__file__).resolve().parents[1] / ".cache"
os.environ.setdefault("FTITAN_CACHE_DIR", str(_CACHE))  # ftitan's cache root (ftitan._cache): vLLM's, inductor's
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", str(_CACHE / "triton"))
# the Triton kernels of ftitan.kernels run on CPU tensors in the interpreter (set before triton is imported)
os.environ.setdefault("TRITON_INTERPRET", "1")

# threads per test process: the cores shared among pytest-xdist's workers (make test runs two). Two workers of
# two threads each on two cores ran tests/models + tests/train in 7m37s against 4m23s with one thread each:
# oversubscribed OpenMP threads spin while they wait for each other. Subprocesses (CLI runs, vLLM) inherit it.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

import torch  # noqa: E402

torch.set_num_threads(_THREADS)


import json  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture()
def tiny_run_cfg(tmp_path):
    """A 2-step ``llama3-debug`` run (1 layer, dim 32, BPE of 300 on a small JSONL corpus) as the CLI parses it;
    ``cfg.run_dir`` is ``tmp_path / "run"``."""
    from ftitan.config import parse_train_args

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(200)))
    return parse_train_args([
        "--recipe", "llama3-debug", "--run-dir", str(tmp_path / "run"), "--data.corpus", str(corpus),
        "--data.vocab-size", "300", "--model.vocab-size", "300", "--model.n-layers", "1", "--model.dim", "32",
        "--model.n-heads", "2", "--model.n-kv-heads", "1", "--model.ffn-dim", "48", "--data.seq-len", "16",
        "--data.batch-size", "2", "--steps", "2", "--optim.warmup", "1", "--eval-every", "2", "--eval-batches", "1",
        "--ckpt-every", "2", "--log-every", "1", "--compile", "False",
    ])  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles as in a process of its own. ``make_train_step`` (and other step builders) return
    closures of one code object, and dynamo keeps per-code-object state across ``torch.compile`` calls: a
    test compiling a step after another test compiled one of other shapes got automatic dynamic shapes
    (measured: a DPO step's aot_eager compile took 38 s after a Qwen3-MoE test, 5 s on its own)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
