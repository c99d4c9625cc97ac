"""``parallel.end_rank``: a launched rank leaves its process group and exits with its code, its output
flushed, without the interpreter's finalization (no ``atexit`` handler runs)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import torch.distributed as dist
    from ftitan import parallel

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
    atexit.register(lambda: print("finalized", flush=True))
    print("trained", end="")  # unflushed: end_rank must flush it
    sys.stderr.write("warned")
    parallel.end_rank(3)
    print("unreachable")
""")


def test_end_rank_shuts_down_flushes_and_skips_finalization():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(port)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 3, out.stderr[-2000:]
    assert out.stdout == "trained", out.stdout  # flushed; neither the atexit handler nor the next line ran
    assert out.stderr.endswith("warned"), out.stderr[-2000:]
