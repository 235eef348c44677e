"""Rank functions of the tensor-parallel tests: a live switch 2 -> 1 -> 2 with a checkpoint,
and the per-shard gradient sync of two groups that split the same layers 2 ways.

Two gloo ranks train :func:`~hetpilot.trainer.examples.gpt_tp` in float64: a plan whose
one stage splits every block two ways, then a two-stage pipeline without tensor
parallelism, then the split plan again; a checkpoint is saved under the split plan and
reloaded under it at the end. What the ranks hold is saved for the test to compare with
one process taking the same steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hetpilot.planner.serde import plan_from_dict

from ..examples import gpt_tp
from ..runtime import Trainer, TrainerConfig

TP_PLAN = {  # one stage, both ranks, every layer (blocks split two ways)
    "microbatch_size": 8, "schedule": "1f1b",
    "groups": [{"samples": 32, "stages": [{"devices": ["local:1", "local:0"],
                                           "layers": [0, 5]}]}],
}
PIPE_PLAN = {  # degree 1: a two-stage pipeline, cut inside the blocks
    "microbatch_size": 8, "schedule": "1f1b",
    "groups": [{"samples": 32, "stages": [{"device": "local:0", "layers": [0, 2]},
                                          {"device": "local:1", "layers": [2, 5],
                                           "recompute": True}]}],
}
STEPS = [(TP_PLAN, 2), (PIPE_PLAN, 1), (TP_PLAN, 1)]
"""(plan, iterations) in order; the checkpoint is saved after the first."""


EQUAL_PLAN = {  # two groups, each one stage splitting every block 2 ways: per-shard sync
    "microbatch_size": 4, "schedule": "1f1b",
    "groups": [{"samples": 20, "stages": [{"devices": ["local:1", "local:0"],
                                           "layers": [0, 5]}]},
               {"samples": 12, "stages": [{"devices": ["local:2", "local:3"],
                                           "layers": [0, 5]}]}],
}
UNEQUAL_PLAN = {  # 2 ways in one group, whole in a 2-stage pipeline in the other: full sync
    "microbatch_size": 4, "schedule": "1f1b",
    "groups": [{"samples": 16, "stages": [{"devices": ["local:0", "local:1"],
                                           "layers": [0, 5]}]},
               {"samples": 16, "stages": [{"device": "local:2", "layers": [0, 2]},
                                          {"device": "local:3", "layers": [2, 5]}]}],
}
SYNC_STEPS = [(EQUAL_PLAN, 2), (UNEQUAL_PLAN, 1)]


def fixed_heads() -> dict[str, Any]:
    """:func:`~hetpilot.trainer.examples.gpt` with a ``tp_plan`` its blocks cannot run
    split: a fused qkv viewed with a fixed head count (train-check refuses it)."""
    from ..examples import gpt

    return {**gpt(), "tp_plan": {"qkv": "colwise", "proj": "rowwise"}}


def tp_switch_rank(rank: int, world: int, out: str) -> None:
    spec = gpt_tp()
    trainer = Trainer(
        spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"],
        TrainerConfig(global_batch=spec["global_batch"], device_id=f"local:{rank}", seed=0,
                      dtype=torch.float64, tp_plan=spec["tp_plan"]),
    )
    where = Path(out)
    states: list[dict[int, dict[str, torch.Tensor]]] = []
    for i, (plan, iterations) in enumerate(STEPS):
        trainer.switch(plan_from_dict(plan), i + 1)
        for _ in range(iterations):
            trainer.train_step()
        if i == 0:
            trainer.save_checkpoint(where / "ckpt")
        states.append(trainer.holdings.full_states())
    trainer.load_checkpoint(where / "ckpt")  # under the split plan: reloaded, split again
    reloaded = trainer.holdings.full_states()
    trainer.train_step()
    after = trainer.holdings.full_states()
    split = sorted(trainer.holdings.sharded)
    result: dict[str, Any] = {"states": states, "reloaded": reloaded, "after": after,
                              "split": split}
    torch.save(result, where / f"rank{rank}.pt")


def scaler_rank(rank: int, world: int, out: str) -> None:
    """float16's loss scaler on split gradients (DTensor slices over the world's mesh): an
    overflow in one rank's slice skips the step on every rank; otherwise every slice is
    unscaled. Writes what it saw."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ..precision import LossScaler

    world_group = dist.group.WORLD
    assert world_group is not None
    mesh = DeviceMesh.from_group(world_group, "cpu")
    full = torch.arange(8, dtype=torch.float32).reshape(4, 2) * 4.0
    grad = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    scaler = LossScaler(init_scale=4.0)
    stepped = scaler.update([grad], torch.device("cpu"))
    unscaled = grad.full_tensor().tolist()
    if rank == world - 1:
        grad.to_local()[0, 0] = float("inf")  # the last rank's slice overflows
    skipped = not scaler.update([grad], torch.device("cpu"))
    torch.save({"stepped": stepped, "unscaled": unscaled, "skipped": skipped,
                "scale": scaler.scale}, Path(out) / f"scaler{rank}.pt")


def shard_sync_rank(rank: int, world: int, out: str) -> None:
    """4 ranks in float64 through :data:`SYNC_STEPS`: after each plan, what this rank holds
    (full tensors), the sync path of each of its buckets and its bytes synced per iteration."""
    from ..tpsync import TPGradSync

    spec = gpt_tp()
    trainer = Trainer(
        spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"],
        TrainerConfig(global_batch=spec["global_batch"], device_id=f"local:{rank}", seed=0,
                      dtype=torch.float64, tp_plan=spec["tp_plan"]),
    )
    result: list[dict[str, Any]] = []
    for i, (plan, iterations) in enumerate(SYNC_STEPS):
        trainer.switch(plan_from_dict(plan), i + 1)
        sync = trainer._part.gradsync
        assert isinstance(sync, TPGradSync)
        sent = []
        for _ in range(iterations):
            stats, _ = trainer.train_step()
            sent.append(stats.sync_bytes if stats is not None else 0.0)
        result.append({"states": trainer.holdings.full_states(), "paths": sync.paths,
                       "bytes": sent})
    torch.save(result, Path(out) / f"sync{rank}.pt")
