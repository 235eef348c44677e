"""``hetpilot train-check``: the runtime against one process taking the same steps, float64.

Takes a job (``--job MODULE:FN``, the same job function ``hetpilot train``
runs; default: a small tanh MLP) and draws random valid plans for N local
ranks until every layer boundary has been cut at least once (after
tuple/dict-output layers and between tied layers included): several groups,
uneven samples, every schedule (gpipe, 1f1b, custom), recompute on and off,
one device idle in the last plan. Each plan is checked before any rank
starts, then the N spawned gloo ranks run it for a few iterations and switch
live to the next (layers, tied parameters and optimizer state move between
ranks). After each plan every replica of every layer (parameters and
buffers) and the mean loss are compared with
:class:`~hetpilot.trainer.reference.ReferenceRun`, which takes the same steps
in one process on the same microbatches, accumulating gradients in float64.
Exit 0 when the largest absolute difference is at most ``--tolerance``
(1e-9); otherwise the report names the layer and tensor that differ most.

The job must be deterministic in training mode (no dropout, or dropout 0):
random ops draw different numbers on different ranks than in one process.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import plan_from_dict, plan_to_dict
from hetpilot.planner.types import Plan
from torch import nn

from .jobspec import load_job
from .launch import spawn
from .plans import check_plan, random_plan

__all__ = ["BUILTIN_JOB", "Difference", "make_layers", "run_check", "summarize_plan"]

SCHEDULE_CYCLE = ("1f1b", "custom", "gpipe")
BUILTIN_JOB = "hetpilot.trainer.examples:mlp"
"""The job train-check runs without ``--job``."""


def make_layers(num_layers: int, width: int = 6, d_in: int = 4, d_out: int = 2) -> list[Any]:
    """Factories of a small tanh MLP chain (layer 0: d_in->width, last: width->d_out)."""

    def factory(i: int) -> Any:
        def build() -> nn.Module:
            a = d_in if i == 0 else width
            if i == num_layers - 1:
                return nn.Linear(a, d_out)
            return nn.Sequential(nn.Linear(a, width), nn.Tanh())

        return build

    return [factory(i) for i in range(num_layers)]


def _dataset(size: int, seed: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(size, 2, generator=gen, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, y)


def _adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def summarize_plan(plan: Plan) -> str:
    parts = []
    for g in plan.groups:
        stages = " | ".join(
            f"{s.device}[{s.layers[0]},{s.layers[1]}){'R' if s.recompute else ''}" for s in g.stages
        )
        parts.append(f"{g.samples}: {stages}")
    return f"{plan.schedule:6s} " + "  ;  ".join(parts)


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    from .runtime import Trainer

    spec = load_job(cfg["job"], "--job")
    plans = [plan_from_dict(p) for p in cfg["plans"]]
    trainer = Trainer(
        spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"],
        global_batch=spec["global_batch"], device_id=f"local:{rank}", seed=cfg["seed"],
        dtype=torch.float64,
    )
    out = Path(cfg["out"])
    if rank == 0:  # rank 0's modules are the runtime's starting point: the reference's too
        torch.save({layer: module.state_dict() for layer, module in enumerate(spec["layers"])
                    if isinstance(module, nn.Module)}, out / "init.pt")
    for i, plan in enumerate(plans):
        trainer.switch(plan, i + 1)
        record = trainer.train_epoch(max_iterations=cfg["iterations"])
        state = {layer: {k: v.detach().clone() for k, v in mod.state_dict().items()}
                 for layer, mod in trainer.held_layers.items()}
        torch.save(state, out / f"plan{i}_rank{rank}.pt")
        if rank == 0:
            torch.save({"iterations": record["iterations"], "loss": record["loss"],
                        "switch": dict(trainer.last_switch)}, out / f"plan{i}.pt")


def _microbatch(global_batch: int, ranks: int) -> int:
    """The largest microbatch size leaving at least two microbatches per rank."""
    fits = [m for m in range(1, global_batch + 1)
            if global_batch % m == 0 and global_batch // m >= 2 * ranks]
    return max(fits) if fits else 1


def draw_plans(rng: random.Random, ranks: int, num_layers: int, global_batch: int,
               microbatch: int) -> list[Plan]:
    """Random valid plans until every layer boundary has been a cut (at least three plans;
    schedules in turn, recompute on in every other plan, the last leaves one device idle)."""
    devices = [f"local:{r}" for r in range(ranks)]
    uncovered = set(range(1, num_layers))
    schedules = list(SCHEDULE_CYCLE)
    rng.shuffle(schedules)
    plans: list[Plan] = []
    limit = max(3, 4 * num_layers)
    while len(plans) < 3 or (uncovered and len(plans) < limit):
        i = len(plans)
        groups = (rng.randint(min(2, ranks), ranks) if i == 0 else max(1, ranks // 2)
                  if i == 1 else 1 if uncovered else None)
        plans.append(random_plan(
            rng, devices, num_layers, global_batch, microbatch, schedules[i % len(schedules)],
            groups=groups, prefer_cuts=uncovered, recompute_p=0.5 if i % 2 == 0 else 0.0))
    last = plans[-1]
    plans.append(random_plan(rng, devices, num_layers, global_batch, microbatch,
                             schedules[len(plans) % len(schedules)], leave_idle=True,
                             recompute_p=0.0 if any(s.recompute for g in last.groups
                                                    for s in g.stages) else 0.5))
    return plans


@dataclass
class Difference:
    """The largest absolute difference found, and where."""

    value: float = 0.0
    where: str = "nothing compared"

    def update(self, value: float, where: str) -> None:
        if value > self.value or self.where == "nothing compared":
            self.value, self.where = value, where


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def run_check(
    ranks: int,
    *,
    job: str = BUILTIN_JOB,
    seed: int = 0,
    iterations: int = 2,
    timeout_s: float = 300.0,
    log: Any = print,
) -> Difference:
    """Run the check (module docstring); return the largest difference and where it is."""
    from .reference import ReferenceRun, build_layers

    spec = load_job(job, "--job")
    num_layers, batch = len(list(spec["layers"])), int(spec["global_batch"])
    microbatch = int(spec.get("microbatch_size") or _microbatch(batch, ranks))
    rng = random.Random(seed)
    plans = draw_plans(rng, ranks, num_layers, batch, microbatch)
    devices = [f"local:{r}" for r in range(ranks)]
    for plan in plans:  # refused here, before any rank starts
        check_plan(plan, devices, num_layers, batch)
    cfg = {"plans": [plan_to_dict(p) for p in plans], "job": job, "iterations": iterations,
           "seed": seed}
    worst = Difference()
    with tempfile.TemporaryDirectory(prefix="hetpilot-train-check-") as tmp:
        cfg["out"] = tmp
        started = time.monotonic()
        spawn(_worker, ranks, (cfg,), timeout_s)
        took = time.monotonic() - started
        layers = build_layers(list(spec["layers"]), seed, torch.float64)
        for layer, state in torch.load(Path(tmp) / "init.pt", weights_only=True).items():
            layers[layer].load_state_dict(state)
        ref = ReferenceRun(layers, spec["loss"], spec["optimizer"], spec["dataset"], batch,
                           seed=seed)
        for i, plan in enumerate(plans):
            info = torch.load(Path(tmp) / f"plan{i}.pt", weights_only=False)
            losses = [ref.step(plan) for _ in range(info["iterations"])]
            expected = ref.states()
            here = Difference()
            replicas = 0
            for rank in range(ranks):
                held = torch.load(Path(tmp) / f"plan{i}_rank{rank}.pt", weights_only=True)
                for layer, state in held.items():
                    replicas += 1
                    name = type(layers[layer]).__name__
                    for key, value in state.items():
                        here.update(_max_abs(value, expected[layer][key]),
                                    f"layer {layer} ({name}) {key!r} on rank {rank}")
            loss_diff = abs(info["loss"] - sum(losses) / len(losses))
            here.update(loss_diff, "the mean loss")
            log(f"plan v{i + 1} ({info['iterations']} it): {summarize_plan(plan)}")
            log(f"  {replicas} layer replicas, loss {info['loss']:.6g}: max |diff| = "
                f"{here.value:.3e} at {here.where}  (switch: {info['switch']})")
            worst.update(here.value, f"plan v{i + 1}, {here.where}")
    log(f"{ranks} ranks, {len(plans)} plans, microbatch {microbatch}, {took:.1f} s")
    return worst


def main(ranks: int, seed: int, tolerance: float, timeout_s: float,
         job: str = BUILTIN_JOB, iterations: int = 2) -> int:
    try:
        worst = run_check(ranks, job=job, seed=seed, iterations=iterations, timeout_s=timeout_s)
    except ValidationError as exc:
        print(f"hetpilot train-check: error: {exc}", file=sys.stderr)
        return 2
    except TimeoutError as exc:
        print(f"hetpilot train-check: error: {exc}", file=sys.stderr)
        return 1
    ok = worst.value <= tolerance
    print(f"largest absolute difference: {worst.value:.3e} at {worst.where} "
          f"(tolerance {tolerance:g}) {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1
