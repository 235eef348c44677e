"""Switching cost when layers really move: bytes moved vs seconds, fitted as
``time = overhead + bytes / bandwidth``.

2 gloo ranks on 127.0.0.1 (one thread each). A model of ``--layers`` Linear
layers of width w is trained one step under plan A (everything on rank 0, so
Adam state exists), then switched live A -> B_k -> A -> B_k ..., where B_k is a
2-stage pipeline that puts the last k layers on rank 1: each switch moves k
layers' parameters and Adam state (``Trainer.switch``: torch.save, size
header, gloo send, torch.load, then process-group rebuild and barrier). Widths
and k vary the bytes over two orders of magnitude. gloo p2p bandwidth is
measured in the same run (ping-pong of 16 MB) for comparison.

The first switch of the run is a warm-up (gloo sets up the pair's
connection lazily) and is reported but left out of the fit.

Run: .venv/bin/python bench/trainer_switch.py [--widths 256,512,1024,2048] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hetpilot.planner.serde import plan_from_dict
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.runtime import Trainer, TrainerConfig
from torch import nn


def _plan(layers: int, moved: int) -> dict[str, Any]:
    if moved == 0:
        stages = [{"device": "emu:0", "layers": [0, layers]}]
    else:
        stages = [{"device": "emu:0", "layers": [0, layers - moved]},
                  {"device": "emu:1", "layers": [layers - moved, layers]}]
    return {"microbatch_size": 4, "schedule": "1f1b", "groups": [{"samples": 8, "stages": stages}]}


def _worker(rank: int, world: int, out: str, cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    rows = []
    big = torch.zeros(4_000_000)  # 16 MB ping-pong: gloo p2p bandwidth
    pp = []
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        if rank == 0:
            dist.send(big, 1)
            dist.recv(big, 1)
        else:
            dist.recv(big, 0)
            dist.send(big, 0)
        pp.append((time.perf_counter() - started) / 2)
    for width in cfg["widths"]:
        torch.manual_seed(0)
        layers = [nn.Linear(width, width) for _ in range(cfg["layers"])]
        data = torch.utils.data.TensorDataset(torch.randn(64, width), torch.randn(64, width))
        trainer = Trainer(layers, nn.functional.mse_loss, lambda p: torch.optim.Adam(p, lr=1e-4),
                          data, TrainerConfig(global_batch=8, device_id=f"emu:{rank}"))
        trainer.switch(plan_from_dict(_plan(cfg["layers"], 0)))
        trainer.train_step()  # Adam state exists from here on
        for moved in range(1, cfg["layers"]):
            for _ in range(cfg["repeats"]):
                for target in (moved, 0):  # there and back: both move k layers
                    dist.barrier()
                    info = trainer.switch(plan_from_dict(_plan(cfg["layers"], target)))
                    took: list[Any] = [None] * world
                    dist.all_gather_object(took, (info["bytes_sent"], info["total_s"],
                                                  info["move_s"]))
                    if rank == 0:
                        rows.append({"width": width, "layers_moved": moved,
                                     "bytes": sum(t[0] for t in took),
                                     "total_s": max(t[1] for t in took),
                                     "move_s": max(t[2] for t in took)})
        del trainer
    if rank == 0:
        Path(out, "switch.json").write_text(json.dumps(
            {"rows": rows, "p2p_s": statistics.median(pp), "p2p_bytes": big.numel() * 4}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="256,512,1024,2048")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cfg = {"widths": [int(w) for w in args.widths.split(",")], "layers": args.layers,
           "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        spawn(_worker, 2, (tmp, cfg), 580)
        wall = time.monotonic() - started
        data = json.loads(Path(tmp, "switch.json").read_text())
    warmup, rows = data["rows"][0], data["rows"][1:]  # first move: lazy gloo pair setup
    print(f"first switch (warm-up, left out of the fit): {warmup['bytes'] / 1e6:.2f} MB in "
          f"{warmup['total_s']:.3f} s")
    p2p_gbps = data["p2p_bytes"] * 8 / 1e9 / data["p2p_s"]
    x = np.array([r["bytes"] for r in rows], dtype=float)
    for key in ("total_s", "move_s"):
        y = np.array([r[key] for r in rows], dtype=float)
        slope, intercept = np.polyfit(x, y, 1)
        pred = intercept + slope * x
        rel = np.abs(pred - y) / y
        print(f"fit {key}: overhead {intercept * 1000:.1f} ms + bytes / "
              f"{8 / slope / 1e9:.2f} Gbit/s; median |error| {np.median(rel) * 100:.0f}%, "
              f"max {rel.max() * 100:.0f}% over {len(rows)} switches")
    print(f"gloo p2p (16 MB ping-pong, same run): {p2p_gbps:.2f} Gbit/s")
    print(f"{'width':>6s} {'moved':>5s} {'MB':>9s} {'total_s':>8s} {'move_s':>8s}")
    for r in rows:
        print(f"{r['width']:6d} {r['layers_moved']:5d} {r['bytes'] / 1e6:9.2f} "
              f"{r['total_s']:8.4f} {r['move_s']:8.4f}")
    print(f"(wall {wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
