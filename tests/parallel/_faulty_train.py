"""``python -m ftitan train ...`` in which one rank dies on cue: the fault-recovery scenarios' torchrun script.

    torchrun ... tests/parallel/_faulty_train.py train --recipe ... [flags]

``FTITAN_TEST_KILL`` says who dies and when (SIGKILL: no cleanup, no message):
- ``"R:step:N"``: rank R, just before it runs step N (its peers then wait in that step's collectives);
- ``"R:stop:N"``: the same, but SIGSTOP: a hung rank, alive and silent (torchrun's SIGKILL ends it);
- ``"R:commit:N"``: rank R (0 commits), just before the checkpoint of step N is renamed into place,
  i.e. mid-save: every file written, the commit not done;
- ``"R:slow-commit:N"``: rank R waits 3 s before that rename, then commits (a slow file system).
Several, comma-separated: ``"1:step:5,0:slow-commit:4"``.
``FTITAN_TEST_KILL_ATTEMPT`` (default 0): only in that torchrun attempt (``TORCHELASTIC_RESTART_COUNT``),
so a ``--max-restarts`` relaunch runs clean.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(rank: int, where: str, step: int) -> None:
    if where in ("step", "stop"):
        from ftitan.train import runtime

        make_step = runtime.Runtime.make_step

        def dying_make_step(self, *args, **kwargs):
            step_fn = make_step(self, *args, **kwargs)

            def run(state, batch):
                if int(state.step) + 1 == step:  # the step about to run (a resumed state counts on)
                    os.kill(os.getpid(), signal.SIGKILL if where == "step" else signal.SIGSTOP)
                return step_fn(state, batch)

            return run

        runtime.Runtime.make_step = dying_make_step
    elif where in ("commit", "slow-commit"):
        final = f"step_{step:08d}"
        for name in ("rename", "replace"):
            original = getattr(os, name)

            def dying(src, dst, *args, _original=original, **kwargs):
                if Path(dst).name == final and where == "commit":
                    _die()
                elif Path(dst).name == final:
                    time.sleep(3.0)  # slow-commit
                return _original(src, dst, *args, **kwargs)

            setattr(os, name, dying)
    else:
        raise ValueError(f"FTITAN_TEST_KILL: unknown place {where!r}; use step, stop, commit or slow-commit")


def main() -> int:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack: where a rank hangs
    spec = os.environ.get("FTITAN_TEST_KILL", "")
    attempt = os.environ.get("FTITAN_TEST_KILL_ATTEMPT", "0")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == attempt:
        for one in spec.split(","):
            rank, where, step = one.split(":")
            if int(os.environ["RANK"]) == int(rank):
                _arm(int(rank), where, int(step))
    from ftitan.__main__ import main as ftitan_main

    return ftitan_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
