"""Local multi-rank launching for checks, tests and benchmarks (gloo on 127.0.0.1).

Production jobs use ``torchrun``; this starts N real subprocesses on a free
port with a hard deadline, so nothing that calls it can hang (forked from a
server that imported torch once: :mod:`hetpilot.trainer.forkserver`).
``backend="nccl"`` puts rank r on GPU r (NCCL takes one rank per GPU), as
``hetpilot train`` under torchrun puts LOCAL_RANK r there.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .forkserver import start_method

__all__ = ["free_port", "init_local", "spawn"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


BACKENDS = ("gloo", "nccl")


def init_local(rank: int, world: int, port: int, timeout_s: float = 60.0,
               backend: str = "gloo") -> None:
    """One thread per rank (the machines here are small) and a process group on 127.0.0.1:
    gloo, or NCCL with rank r on GPU r."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from datetime import timedelta

    device = None
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)  # object collectives and barriers use the current GPU
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        device_id=device,
    )


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...],
           environ: dict[str, str], backend: str) -> None:
    # The fork server's environment is the caller's when it started; the rank gets the
    # caller's now, as a spawned one would.
    os.environ.clear()
    os.environ.update(environ)
    init_local(rank, world, port, backend=backend)
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


GRACE_S = 3.0
"""After a rank fails, how long the others have to fail by themselves (and say why)."""

COLLATERAL = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Connection refused", "Timed out waiting", "Socket Timeout")
"""gloo's words for a peer that went away: what the other ranks raise when one fails."""


def _root_cause(ctx: Any, failed: int) -> mp.ProcessRaisedException | None:
    """The error to report when several ranks raised: the first written of those that are
    not gloo's reaction to a peer gone (a rank hitting the job's error takes the others'
    sockets down with it, and whichever rank the parent saw first was reported, often
    with only "Connection reset by peer"); None: the one ``join`` raised is it."""
    errors: dict[int, tuple[float, str]] = {}
    for rank, path in enumerate(ctx.error_files):
        try:
            with open(path, "rb") as fh:
                errors[rank] = (os.path.getmtime(path), pickle.load(fh))
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
    real = {r: e for r, e in errors.items() if not any(c in e[1] for c in COLLATERAL)}
    if not real or failed in real:
        return None
    rank = min(real, key=lambda r: real[r][0])
    return mp.ProcessRaisedException(
        f"\n\n-- Process {rank} terminated with the following error (the other ranks' "
        f"errors, rank {failed}'s first, came from losing it):\n{real[rank][1]}",
        rank, ctx.processes[rank].pid)


def spawn(fn: Callable[..., None], world: int, args: tuple[Any, ...], timeout_s: float,
          backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; raise if any fails or time
    runs out. ``backend``: their process group's (:func:`init_local`)."""
    port = free_port()
    method = start_method()
    ctx = mp.start_processes(
        _entry, args=(fn, world, port, args, dict(os.environ), backend), nprocs=world, join=False,
        start_method=method,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.2, grace_period=GRACE_S):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {timeout_s:g} s")
    except mp.ProcessRaisedException as exc:
        root = _root_cause(ctx, exc.error_index)
        if root is None:
            raise
        raise root from None
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
