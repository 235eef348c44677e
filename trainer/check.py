"""``hetpilot train-check``: the runtime against single-process full-batch training, float64.

Draws a random valid plan per epoch (several groups, uneven samples,
different cuts, recompute on some stages, one schedule per epoch so gpipe,
1f1b and custom all run, one device left idle in the last epoch), checks
each before any rank starts, runs them on N spawned gloo ranks with a live
switch at every epoch boundary, and compares every replica of every layer
with the same steps taken by one process on the full batch. Exit 0 when the
largest absolute parameter difference is at most ``--tolerance`` (1e-9).
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from hetpilot.planner.serde import plan_from_dict, plan_to_dict
from hetpilot.planner.types import Plan
from torch import nn

from .launch import spawn
from .plans import StaticPlanSource, check_plan, random_plan
from .runtime import Trainer, layer_seed

__all__ = ["make_layers", "run_check", "summarize_plan"]

SCHEDULE_CYCLE = ("1f1b", "custom", "gpipe")


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
    torch.set_default_dtype(torch.float64)
    plans = [plan_from_dict(p) for p in cfg["plans"]]
    trainer = Trainer(
        make_layers(cfg["num_layers"]),
        nn.functional.mse_loss,
        _adam,
        _dataset(cfg["batch"] * cfg["iterations"], cfg["seed"]),
        global_batch=cfg["batch"],
        device_id=f"local:{rank}",
        plan_source=StaticPlanSource(plans),
        seed=cfg["seed"],
        dtype=torch.float64,
    )
    out = Path(cfg["out"])
    for epoch in range(len(plans)):
        trainer.poll_plan()
        trainer.train_epoch()
        state = {layer: {k: v.detach().clone() for k, v in mod.state_dict().items()}
                 for layer, mod in trainer.held_layers.items()}
        torch.save(state, out / f"epoch{epoch}_rank{rank}.pt")
        if rank == 0:
            (out / f"switch{epoch}.txt").write_text(str(trainer.last_switch))


def _reference(cfg: dict[str, Any], epochs: int) -> list[list[dict[str, torch.Tensor]]]:
    """Full-batch training in one process; per epoch, each layer's state.

    Runs in the caller's process (train-check, tests): the float64 default dtype
    it needs is restored afterwards so nothing else in the process inherits it.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _reference_float64(cfg, epochs)
    finally:
        torch.set_default_dtype(previous)


def _reference_float64(cfg: dict[str, Any], epochs: int) -> list[list[dict[str, torch.Tensor]]]:
    layers = []
    for i, build in enumerate(make_layers(cfg["num_layers"])):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(cfg["seed"], i))
            layers.append(build().to(torch.float64))
    model = nn.Sequential(*layers)
    optim = _adam(list(model.parameters()))
    data = _dataset(cfg["batch"] * cfg["iterations"], cfg["seed"])
    b = cfg["batch"]
    states = []
    for epoch in range(epochs):
        gen = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + epoch)
        perm = torch.randperm(len(data), generator=gen)
        for it in range(cfg["iterations"]):
            idx = perm[it * b : (it + 1) * b]
            x, y = data[idx]
            loss = nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
        states.append([{k: v.detach().clone() for k, v in layer.state_dict().items()}
                       for layer in layers])
    return states


def run_check(
    ranks: int,
    *,
    seed: int = 0,
    num_layers: int = 6,
    batch: int = 16,
    microbatch: int = 2,
    iterations: int = 2,
    timeout_s: float = 120.0,
    log: Any = print,
) -> float:
    """Run the check; return the largest absolute parameter difference."""
    rng = random.Random(seed)
    devices = [f"local:{r}" for r in range(ranks)]
    schedules = list(SCHEDULE_CYCLE)
    rng.shuffle(schedules)
    plans = [
        random_plan(rng, devices, num_layers, batch, microbatch, schedules[0],
                    groups=rng.randint(min(2, ranks), ranks)),
        random_plan(rng, devices, num_layers, batch, microbatch, schedules[1],
                    groups=max(1, ranks // 2)),
        random_plan(rng, devices, num_layers, batch, microbatch, schedules[2], leave_idle=True),
    ]
    for plan in plans:  # refused here, before any rank starts
        check_plan(plan, devices, num_layers, batch)
    cfg = {
        "plans": [plan_to_dict(p) for p in plans],
        "num_layers": num_layers,
        "batch": batch,
        "iterations": iterations,
        "seed": seed,
    }
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="hetpilot-train-check-") as tmp:
        cfg["out"] = tmp
        started = time.monotonic()
        spawn(_worker, ranks, (cfg,), timeout_s)
        took = time.monotonic() - started
        reference = _reference(cfg, len(plans))
        for epoch, plan in enumerate(plans):
            diff = 0.0
            replicas = 0
            for rank in range(ranks):
                held = torch.load(Path(tmp) / f"epoch{epoch}_rank{rank}.pt", weights_only=True)
                for layer, state in held.items():
                    replicas += 1
                    for key, value in state.items():
                        ref = reference[epoch][layer][key]
                        diff = max(diff, float((value - ref).abs().max()))
            switch = (Path(tmp) / f"switch{epoch}.txt").read_text()
            log(f"epoch {epoch} plan v{epoch + 1}: {summarize_plan(plan)}")
            log(f"  {replicas} layer replicas vs full batch: max |diff| = {diff:.3e}  "
                f"(switch: {switch})")
            worst = max(worst, diff)
    log(f"{ranks} ranks, {len(plans)} plans, {iterations} iterations each, {took:.1f} s")
    return worst


def main(ranks: int, seed: int, tolerance: float, timeout_s: float) -> int:
    try:
        worst = run_check(ranks, seed=seed, timeout_s=timeout_s)
    except TimeoutError as exc:
        print(f"hetpilot train-check: error: {exc}", file=sys.stderr)
        return 1
    verdict = "ok" if worst <= tolerance else "FAIL"
    print(f"largest absolute parameter difference: {worst:.3e} (tolerance {tolerance:g}) {verdict}")
    return 0 if worst <= tolerance else 1
