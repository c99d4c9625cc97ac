import os
from pathlib import Path

# keep compile caches inside the repo's ignored cache, never in the system temp dir
_CACHE = Path(__file__).resolve().parents[1] / ".cache"
os.environ.setdefault("FTITAN_CACHE_DIR", str(_CACHE))  # ftitan's cache root (ftitan._cache): vLLM's, inductor's
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", str(_CACHE / "triton"))

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
