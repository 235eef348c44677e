"""Local multi-rank launching for checks, tests and benchmarks (gloo on 127.0.0.1).

Production jobs use ``torchrun``; this spawns N real subprocesses on a free
port with a hard deadline, so nothing that calls it can hang.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "init_local", "spawn"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_local(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """One thread per rank (the machines here are small) and a gloo group on 127.0.0.1."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from datetime import timedelta

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...]) -> None:
    init_local(rank, world, port)
    try:
        fn(rank, world, *args)
        dist.barrier()  # every rank done with the group before any tears it down
    finally:
        dist.destroy_process_group()
    # The work is done and the group destroyed. Skip the interpreter's teardown: in
    # about 1 run in 100 here a rank then aborted in a C++ static destructor
    # ("terminate called without an active exception", SIGABRT), which failed a
    # check whose results were already complete. (Errors above still propagate.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., None], world: int, args: tuple[Any, ...], timeout_s: float) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; raise if any fails or time runs out."""
    port = free_port()
    ctx = mp.start_processes(
        _entry, args=(fn, world, port, args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {timeout_s:g} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
