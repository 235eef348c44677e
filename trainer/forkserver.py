"""The fork server local ranks start from (:func:`hetpilot.trainer.launch.spawn`).

Why: a rank that imports torch itself spends about 2.5 s of CPU on it here, and its
first optimizer another 1.9 s (``torch.optim`` imports ``torch._dynamo`` on first use).
Forked from a server that imported both once, it starts at once: a 3-rank train-check
of the built-in job went from 11.3 to 7.6 s wall here (tests and train-check start
ranks many times). The server has run no torch op, so forking it is safe (no thread
pool yet).

No torch here: :func:`start_early` is called before the caller imports torch, so the
server's imports run beside the caller's own on a second core.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

__all__ = ["PRELOAD", "start_early", "start_method"]

PRELOAD = ["torch", "torch._dynamo", "hetpilot.trainer.runtime"]
"""What the fork server imports once, so that each rank starts without importing it."""


def start_method() -> str:
    """``forkserver`` where there is one (Linux), with :data:`PRELOAD` preloaded;
    elsewhere ``spawn``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)
    return "forkserver"


def start_early() -> None:
    """Start the fork server now (it is started on first use otherwise), for a caller
    that will spawn ranks after a long set-up of its own."""
    if start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()
