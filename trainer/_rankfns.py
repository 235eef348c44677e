"""Rank functions for the trainer's multi-rank tests.

They live in the package, not under tests/, because spawned ranks must import
them by module name (pytest's importlib mode gives test modules names that a
fresh interpreter cannot import).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from hetpilot.planner.serde import plan_from_dict
from torch import nn

from .check import _adam, _dataset, make_layers
from .plans import StaticPlanSource
from .runtime import JsonlReporter, Trainer

CFG: dict[str, Any] = {"num_layers": 6, "batch": 16, "iterations": 2, "seed": 3}

PLAN_A = {  # 3 ranks: a 2-stage pipeline and a single stage, uneven samples
    "microbatch_size": 2, "schedule": "1f1b",
    "groups": [
        {"samples": 10, "stages": [{"device": "local:0", "layers": [0, 2]},
                                   {"device": "local:1", "layers": [2, 6], "recompute": True}]},
        {"samples": 6, "stages": [{"device": "local:2", "layers": [0, 6]}]},
    ],
}
PLAN_B = {  # 2 ranks, other cut, gpipe
    "microbatch_size": 2, "schedule": "gpipe",
    "groups": [{"samples": 16, "stages": [{"device": "local:1", "layers": [0, 4]},
                                          {"device": "local:0", "layers": [4, 6]}]}],
}


def _trainer(rank: int, plan: dict, out: Path) -> Trainer:
    return Trainer(
        make_layers(CFG["num_layers"]), nn.functional.mse_loss, _adam,
        _dataset(CFG["batch"] * CFG["iterations"], CFG["seed"]),
        global_batch=CFG["batch"], device_id=f"local:{rank}",
        plan_source=StaticPlanSource([plan_from_dict(plan)]), seed=CFG["seed"],
        dtype=torch.float64, reporter=JsonlReporter(out / f"report{rank}.jsonl"),
    )


def reference_states() -> list[dict[str, torch.Tensor]]:
    """One process taking the same steps: PLAN_A for epoch 0, PLAN_B for epoch 1."""
    from .reference import ReferenceRun, build_layers

    ref = ReferenceRun(build_layers(make_layers(CFG["num_layers"]), CFG["seed"], torch.float64),
                       nn.functional.mse_loss, _adam,
                       _dataset(CFG["batch"] * CFG["iterations"], CFG["seed"]),
                       CFG["batch"], seed=CFG["seed"])
    for plan in (PLAN_A, PLAN_B):
        for _ in range(CFG["iterations"]):
            ref.step(plan_from_dict(plan))
    return ref.states()


def _save_held(trainer: Trainer, path: Path) -> None:
    torch.save({k: m.state_dict() for k, m in trainer.held_layers.items()}, path)


def _first_run(rank: int, world: int, out: str) -> None:
    trainer = _trainer(rank, PLAN_A, Path(out))
    trainer.fit(1)
    trainer.save_checkpoint(Path(out) / "ckpt")


def _resumed_run(rank: int, world: int, out: str) -> None:
    trainer = _trainer(rank, PLAN_B, Path(out))
    meta = trainer.load_checkpoint(Path(out) / "ckpt")
    assert meta["epoch"] == 1 and trainer.step == CFG["iterations"]
    trainer.fit(2)
    _save_held(trainer, Path(out) / f"held{rank}.pt")


def _bad_device_run(rank: int, world: int, out: str) -> None:
    bad = json.loads(json.dumps(PLAN_B))
    bad["groups"][0]["stages"][1]["device"] = "local:9"
    trainer = _trainer(rank, bad, Path(out))
    trainer.fit(1)


def _activation_round_trip(rank: int, world: int, out: str) -> None:
    """Rank 0 sends a nested activation forward, rank 1 sends gradients back."""
    from .activations import grad_leaves, recv_activation, recv_grads, send_activation, send_grads

    w = torch.ones(3, requires_grad=True)
    if rank == 0:
        value = {"seq": (w * 2, torch.arange(4)), "meta": ["x", 7], "h": torch.zeros(2, 2),
                 "half": w.to(torch.bfloat16) * 3}
        for work, _ in send_activation(value, 1, k=5):
            work.wait()
        outs = grad_leaves(value)
        grads = recv_grads(outs, 1, k=5)
        torch.autograd.backward(outs, grads)
        assert w.grad is not None
        torch.save({"w_grad": w.grad}, Path(out) / "grad.pt")
    else:
        got = recv_activation(0, k=5, device=torch.device("cpu"))
        v = got.value
        torch.save({"ids_dtype": str(v["seq"][1].dtype), "meta": v["meta"],
                    "half_dtype": str(v["half"].dtype), "needs": len(got.grad_inputs),
                    "h_requires": v["h"].requires_grad}, Path(out) / "recv.pt")
        loss = (v["seq"][0] * 5).sum() + v["half"].float().sum()  # "half" via bf16
        loss.backward()
        for work, _ in send_grads(got.grad_inputs, 0, k=5):
            work.wait()


def _eval_hook_run(rank: int, world: int, out: str) -> None:
    """bn_tiny on a 2-stage pipeline with an evaluation hook; rank 0 saves what it needs."""
    from ._jobfns import bn_tiny

    spec = bn_tiny()
    gen = torch.Generator().manual_seed(9)
    held_out = torch.utils.data.TensorDataset(torch.randn(7, 4, generator=gen),
                                              torch.randint(0, 3, (7,), generator=gen))
    plan = {"microbatch_size": 2, "schedule": "1f1b", "groups": [
        {"samples": 24, "stages": [{"device": "local:0", "layers": [0, 2]},
                                   {"device": "local:1", "layers": [2, 3]}]}]}
    trainer = Trainer(spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"],
                      global_batch=spec["global_batch"], device_id=f"local:{rank}",
                      plan_source=StaticPlanSource([plan_from_dict(plan)]),
                      eval_dataset=held_out, metric=nn.functional.cross_entropy)
    records = trainer.fit(1)
    states = {k: m.state_dict() for k, m in trainer.held_layers.items()}
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, states)
    if rank == 0:
        merged = {k: v for part in gathered for k, v in part.items()}
        torch.save({"record": records[-1], "states": merged, "held_out": held_out,
                    "training": all(m.training for m in trainer.held_layers.values())},
                   Path(out) / "eval.pt")
