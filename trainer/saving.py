"""The ranks' collective save of a checkpoint, and the check of one to resume from.

The files and their crash safety are :mod:`hetpilot.trainer.checkpoint`'s; this module is
the ranks' side: rank 0 opens a fresh staging directory, each layer's owner in group 0
writes the layer (a tensor-parallel stage's first rank, with the full tensors gathered from
the stage's ranks: checkpoints do not depend on the plan) and each tie's first holder the
tie, rank 0 commits. Each phase ends with
every rank learning every rank's outcome, so that all raise (and none waits forever) when
one failed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from hetpilot.planner.types import Plan

from . import checkpoint as ckpt
from .handoff import Holdings
from .placement import Owners, tie_holders

__all__ = ["read_resume", "save"]


def save(root: Path, step: int, meta: dict[str, Any], keep: int, *, plan: Plan,
         holdings: Holdings, owners: Owners, rank: int, world: int,
         rank_of: Mapping[str, int]) -> None:
    """Collective: commit checkpoint ``step`` under ``root`` with ``meta`` (the position),
    keeping the newest ``keep`` commits; OSError on every rank if any rank failed."""
    staging = ckpt.staging_dir(root, step)

    def write() -> None:
        for stage in plan.groups[0].stages:
            ranks = [rank_of[d] for d in stage.devices]
            if rank in ranks:
                for layer in range(*stage.layers):
                    state = holdings.full_layer_state(layer)  # gathered where split
                    if rank == ranks[0]:
                        ckpt.write_file(staging, ckpt.layer_file(layer), state)
        for t, tie in enumerate(holdings.ties):
            if tie_holders(tie.layers, owners)[:1] == [rank]:
                ckpt.write_file(staging, ckpt.tied_file(t), holdings.tie_state(t))

    _phase(root, world, lambda: ckpt.begin_save(root, step) if rank == 0 else None)
    _phase(root, world, write)
    _phase(root, world, lambda: ckpt.commit(root, step, meta, keep) if rank == 0 else None)


def _phase(root: Path, world: int, work: Callable[[], Any]) -> None:
    """Run this rank's part of a save phase; then, as a barrier, learn every rank's
    outcome, so that all ranks raise (and none waits forever) if one failed."""
    error: str | None = None
    try:
        work()
    except Exception as exc:  # reported to every rank, raised below
        error = f"{type(exc).__name__}: {exc}"
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise OSError(f"checkpoint {str(root)!r} not saved: "
                      + "; ".join(f"rank {r}: {e}" for r, e in failed))


def read_resume(directory: str | Path, num_layers: int,
                global_batch: int) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to resume from in ``directory`` (its ``latest`` commit, or a legacy
    flat one: :func:`~hetpilot.trainer.checkpoint.resolve`) and its position; refused when
    it is of another model depth or batch."""
    path = ckpt.resolve(directory)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {str(directory)!r}")
    meta: dict[str, Any] = ckpt.read_meta(path)
    if meta["num_layers"] != num_layers or meta["global_batch"] != global_batch:
        raise ValueError(
            f"checkpoint {str(path)!r} is of {meta['num_layers']} layers and batch "
            f"{meta['global_batch']}, not {num_layers} and {global_batch}"
        )
    return path, meta
