"""How a run fails: one line that names the cause and the way on, never a wall of tracebacks.

:class:`RunFailure` is the error a run raises for a cause the user acts on
(a peer that never joined or died, gradients that are not finite); ``ftitan
train`` prints its message as ``ftitan train: error: <message>`` and exits
with status 2.

:func:`reports_peer_failures` wraps a torchrun training function: a
collective that fails because another rank died or hung (gloo: "Connection
reset by peer", a timeout after ``--parallel.timeout-s``) and the SIGTERM
torchrun sends every rank when one of them fails both become a
:class:`RunFailure` naming the newest checkpoint to resume from.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["RunFailure", "is_peer_error", "peer_error_summary", "reports_peer_failures", "resume_hint"]

F = TypeVar("F", bound=Callable[..., Any])

# gloo raises plain RuntimeErrors when a peer is gone ("Connection reset by peer") or stuck ("Timed out
# waiting 60000ms for recv"), all from its transport's sources; NCCL and the c10d store raise DistErrors
_PEER_SIGNS = ("third_party/gloo", "Connection reset by peer", "Connection closed by peer")


class RunFailure(RuntimeError):
    """A run stopped for a reason its message names, with the fix; the CLI prints it as one line (status 2)."""


def is_peer_error(e: BaseException) -> bool:
    """Whether ``e`` comes from torch.distributed talking to another rank (not a bug in this rank's code)."""
    if isinstance(e, RunFailure):
        return False
    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and any(sign in str(e) for sign in _PEER_SIGNS)


def peer_error_summary(e: BaseException) -> str:
    """The useful part of a distributed error: gloo's source location and advice trimmed, one line."""
    text = " ".join(str(e).split())
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)  # "[.../pair.cc:537] "
    text = text.split(". This is typically caused")[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _newest_checkpoint(run_dir: Any) -> int | None:
    from ftitan.checkpoint._layout import list_checkpoints, step_of

    try:
        steps = [s for p in list_checkpoints(run_dir.checkpoints) if (s := step_of(p)) is not None]
    except OSError:
        return None
    return max(steps) if steps else None


def resume_hint(run_dir: Any) -> str:
    """How to continue after a failure: ``--resume`` from the newest checkpoint in ``run_dir`` (a ``RunDir``)."""
    step = _newest_checkpoint(run_dir) if run_dir is not None else None
    if step is None:
        return "rerun to start over (no checkpoint was written yet)"
    return f"rerun with --resume to continue from step {step}, the newest checkpoint in {run_dir.path}"


@contextmanager
def _sigterm_raises(run_dir: Any) -> Iterator[None]:
    """torchrun ends every rank with SIGTERM when one fails: say so in one line instead of dying silently."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise RunFailure(f"stopped by the launcher (SIGTERM; torchrun stops every rank when one "
                         f"fails); {resume_hint(run_dir)}")  # fmt: skip

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def reports_peer_failures(fn: F) -> F:
    """Decorate ``train(cfg, ...)``: under torchrun, a failed peer becomes one :class:`RunFailure` line.

    The line names what the collective saw (``peer_error_summary``) and the newest
    checkpoint of ``cfg``'s run directory (``rerun with --resume to continue from step N``); the CLI
    puts this rank in front. After any :class:`RunFailure` SIGTERM is ignored, so the line gets out
    while the process exits (torchrun kills what lingers). A single process (``WORLD_SIZE`` unset or
    1) runs ``fn`` as it is.
    """

    @functools.wraps(fn)
    def wrapper(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return fn(cfg, *args, **kwargs)
        from ftitan.checkpoint.run import RunDir

        run_dir = RunDir.of(cfg)
        try:
            with _sigterm_raises(run_dir):
                try:
                    return fn(cfg, *args, **kwargs)
                except Exception as e:
                    if not is_peer_error(e):
                        raise
                    raise RunFailure(f"a peer process died or stopped responding "
                                     f"({peer_error_summary(e)}); {resume_hint(run_dir)}") from e  # fmt: skip
        except RunFailure:
            # this rank is on its way out with its one line: torchrun's SIGTERM (sent to every rank once one
            # fails) must not cut the line off or print a traceback from an exit handler
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise

    return wrapper  # type: ignore[return-value]
