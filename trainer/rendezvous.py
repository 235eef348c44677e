"""Process-group start-up that survives torchrun's elastic restarts.

:func:`init_process_group` starts the job's process group under a key prefix that the
ranks of this round agree on and no earlier round used (:func:`round_prefix`), so that a
restarted round never connects to a dead round's ranks.

[Note: the agent's store keeps old keys]
With torch >= 2.5 and c10d rendezvous (the default), torchrun's agent runs the TCPStore
that the workers' ``init_process_group`` (``env://``) connects to
(``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_PORT`` names it), and keeps that one
store for the whole job: after a worker dies and the agent restarts the group, the new
workers find the old workers' keys under the same names (``default_pg/0//cpu/...``). Gloo
reads a peer's address from the store without waiting if the key is there, so a new rank
connects to a dead process's port ("connectFullMesh failed ... Connection refused") and
the round fails until the restarts run out or it hangs.
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it: worker rank 0 then hosts a fresh store
on a fresh port every round. A prefix per ``TORCHELASTIC_RESTART_COUNT`` is not enough:
that count is each agent's own (with several nodes a healthy node restarts for a failed
one without counting it, so counts differ between nodes), and restarts for membership
changes are not counted at all.

[Note: agreeing on a prefix]
The ranks agree on a fresh key prefix through the agent's store itself, with a handshake
that a previous round's keys cannot fake: every process draws a random token; each rank
k != 0 posts its token; rank 0 answers each posted token with its own; rank k takes rank
0's token only from an answer that carries its own fresh token, so an old answer (from a
rank 0 that died with the old round) is never taken. Rank 0 re-answers until every rank
has confirmed under the new prefix. Every key of the process group, and of the groups
made from it, then lives under ``hetpilot/<token>/``.
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

__all__ = ["init_process_group", "round_prefix", "uses_agent_store"]

_ROOT = "hetpilot/elastic/"


def uses_agent_store() -> bool:
    """Whether this worker runs under torchrun with the agent's store shared
    ([Note: the agent's store keeps old keys])."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def round_prefix(store: dist.Store, rank: int, world: int, timeout: timedelta,
                 poll_s: float = 0.02) -> str:
    """A key prefix that the ``world`` ranks of this round share and no earlier round used.

    Raises TimeoutError when not every rank has shown up within ``timeout``.
    """
    token = secrets.token_hex(16)
    deadline = time.monotonic() + timeout.total_seconds()

    def wait() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: not every one of {world} ranks joined the "
                               f"process group within {timeout.total_seconds():g} s")
        time.sleep(poll_s)

    if rank == 0:
        ready = f"{_ROOT}{token}/ready"
        answered: dict[int, bytes] = {}
        while store.add(ready, 0) < world - 1:
            for k in range(1, world):
                hello = f"{_ROOT}hello/{k}"
                if store.check([hello]):
                    posted = store.get(hello)
                    if answered.get(k) != posted:
                        store.set(f"{_ROOT}answer/{k}", f"{posted.decode()}:{token}")
                        answered[k] = posted
            wait()
        return f"{_ROOT}{token}/"
    store.set(f"{_ROOT}hello/{rank}", token)
    answer = f"{_ROOT}answer/{rank}"
    mine = token.encode() + b":"
    while True:
        if store.check([answer]):
            value = store.get(answer)
            if value.startswith(mine):
                leader = value[len(mine):].decode()
                store.add(f"{_ROOT}{leader}/ready", 1)
                return f"{_ROOT}{leader}/"
        wait()


def init_process_group(backend: str, timeout: timedelta | None = None) -> None:
    """``dist.init_process_group(backend)`` for a worker started by torchrun (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set), safe across elastic restarts.

    With the agent's store shared, the group's store is that store under this
    round's :func:`round_prefix`; otherwise (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
    or not under torchelastic) the store is a fresh one each run and ``env://``
    is used as it is.
    """
    if not uses_agent_store():
        dist.init_process_group(backend, timeout=timeout)
        return
    limit = timeout or default_pg_timeout
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=limit)
    store = dist.PrefixStore(round_prefix(agent, rank, world, limit), agent)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=limit)
