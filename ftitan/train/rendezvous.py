"""Joining a torchrun world within a bounded time, naming the ranks that never came.

torch's own ``env://`` rendezvous waits 30 minutes (gloo's default) for a
missing process and then reports only how many clients joined. ``join``
meets the other ranks on the c10d store itself: every rank writes its key,
then waits for all of them up to ``--parallel.timeout-s``; on a timeout it
raises :class:`~ftitan.train.faults.RunFailure` listing the ranks whose keys
never appeared. The store it returns (its keys under this torchrun attempt's prefix) is the one
the process group is built on.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist

from ftitan.train.faults import RunFailure, peer_error_summary

__all__ = ["bound_group_timeouts", "join"]

_FLAG = "--parallel.timeout-s"


def _env(name: str, world: int) -> str:
    value = os.environ.get(name)
    if not value:
        raise RunFailure(f"WORLD_SIZE={world} but {name} is not set: launch the processes with torchrun "
                         f"(torchrun --nproc-per-node {world} -m ftitan train ...), which sets RANK, "
                         "MASTER_ADDR and MASTER_PORT")  # fmt: skip
    return value


def _wait_for_port(addr: str, port: int, deadline: float) -> bool:
    """Whether ``addr:port`` accepts a connection before ``deadline`` (polled here, so c10d does not log
    each failed attempt of its own)."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def _store(rank: int, world: int, timeout_s: float, deadline: float) -> dist.Store:
    addr, port = _env("MASTER_ADDR", world), int(_env("MASTER_PORT", world))
    timeout = datetime.timedelta(seconds=timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
    if not agent and rank != 0 and not _wait_for_port(addr, port, deadline):
        raise RunFailure(f"rank 0 never arrived within {timeout_s:g} s: nothing serves the rendezvous store at "
                         f"MASTER_ADDR:MASTER_PORT = {addr}:{port} (WORLD_SIZE={world}); start every process "
                         f"(torchrun --nproc-per-node ...), or raise {_FLAG} if they start slowly")  # fmt: skip
    try:
        if agent:
            return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
        # rank 0 serves it; not waiting for the clients here lets join() say which ranks are missing
        return dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
                             multi_tenant=True)  # fmt: skip
    except (dist.DistError, RuntimeError) as e:
        raise RunFailure(f"could not reach the rendezvous store at {addr}:{port} within {timeout_s:g} s "
                         f"({peer_error_summary(e)}); start every process (WORLD_SIZE={world}), or raise {_FLAG} "
                         "if they start slowly") from None  # fmt: skip


def join(world: int, timeout_s: float) -> tuple[dist.Store, int]:
    """``(store, rank)`` once all ``world`` ranks have arrived (every rank calls it, ``RANK`` from torchrun).

    Raises :class:`RunFailure` after ``timeout_s`` seconds naming the ranks that did not arrive.
    """
    rank = int(_env("RANK", world))
    deadline = time.monotonic() + timeout_s
    # torchrun's agent keeps one store across --max-restarts attempts: each attempt keeps to its own keys
    # (the process group's too: a stale address of a dead attempt's rank would be dialed otherwise)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"ftitan/attempt_{attempt}", _store(rank, world, timeout_s, deadline))
    keys = [f"join/{r}" for r in range(world)]
    try:
        store.set(keys[rank], str(os.getpid()))
        while not store.check(keys):  # polled: store.wait would log c10d warnings on a timeout
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if not store.check([keys[r]])]
                raise RunFailure(f"ranks {missing} never arrived within {timeout_s:g} s (WORLD_SIZE={world}); start "
                                 f"every process (torchrun --nproc-per-node ...), or raise {_FLAG} if they start "
                                 "slowly")  # fmt: skip
            time.sleep(0.05)
    except (dist.DistError, RuntimeError) as e:
        if isinstance(e, RunFailure):
            raise
        raise RunFailure(f"the rendezvous failed ({peer_error_summary(e)}): did rank 0, which serves its store, "
                         f"stop? Start every process again (WORLD_SIZE={world})") from None  # fmt: skip
    return store, rank


def bound_group_timeouts(groups: list[dist.ProcessGroup], timeout_s: float) -> None:
    """Give ``groups`` (a mesh's per-axis groups, which ``new_group`` creates with torch's 30-minute default)
    the run's collective timeout."""
    from torch.distributed.distributed_c10d import _set_pg_timeout  # torchtitan sets per-group timeouts so too

    for group in groups:
        _set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
