"""``python -m hetpilot.agents.torchrun ARGS...``: torchrun (``torch.distributed.run``,
same arguments) whose c10d rendezvous loads nothing but a rendezvous state. The agent
starts launches with it (:mod:`hetpilot.agents.launchcmd`).

torchrun keeps its rendezvous state as a pickle under ``torch.rendezvous.<run id>`` in
the c10d store, which has no authentication, and loads it again every few seconds
(its keep-alive). Anyone who reaches the store's port (another owner's rank on the
host, or on any host that reaches the rendezvous port range) and knows the run id
(the launch id, on torchrun's public command line) could write a pickle there that
runs code as the job's owner (bench/rank_attacks.py did). Here torchrun loads the
state with an unpickler that knows only the classes a rendezvous state is made of
(the Python docs' "restricting globals"); anything else is torch's own error, "the
rendezvous state is corrupt", and ends the launch. The store itself stays open: who
reaches it can still disturb the rendezvous (docs/operating.md, "Security").

torch is imported when this runs, never when the agent imports it."""

from __future__ import annotations

import io
import pickle
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["STATE_CLASSES", "guard_rendezvous", "load_state", "main"]

_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
STATE_CLASSES = frozenset({(_RDZV, "_RendezvousState"), (_RDZV, "_NodeDesc"),
                           ("datetime", "datetime"), ("datetime", "timedelta"),
                           ("datetime", "timezone")})
"""The globals a pickled rendezvous state may name (torch 2.x's dynamic rendezvous)."""


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in STATE_CLASSES:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a rendezvous "
                                         "state: refused (written by someone else?)")
        return super().find_class(module, name)


def load_state(data: bytes) -> Any:
    """A rendezvous state from its pickle; :class:`pickle.UnpicklingError` for a pickle
    naming any other global."""
    return _StateUnpickler(io.BytesIO(data)).load()


def guard_rendezvous() -> None:
    """Make torch's dynamic rendezvous load its state with :func:`load_state`."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.pickle = types.SimpleNamespace(  # type: ignore[assignment]
        dumps=pickle.dumps, loads=load_state, PickleError=pickle.PickleError)


def main(argv: Sequence[str]) -> None:
    guard_rendezvous()
    from torch.distributed.run import main as torchrun

    sys.argv = ["torchrun", *argv]
    torchrun(list(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
