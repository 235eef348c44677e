"""Gradient sync overlapped with the backward (``hetpilot.trainer.gradsync``) vs blocking.

Runs on CPU with gloo: 2 local ranks (one thread each), each a data-parallel
replica of an 8-layer MLP (Linear + Tanh). Each iteration runs ``--micro``
microbatches forward and backward, then syncs the gradients with a
:class:`GradSync` in one of two modes, alternating iteration by iteration so
both see the same machine load:

* ``blocking`` (``overlap=False``): the runtime's sync, one blocking all-reduce per
  bucket after the whole backward;
* ``overlap``: chunks of ``--cap-mb`` launched during the last backward;

each once with the gradients as views of the sync's buffers (``grad_views=True``, the
runtime's default: the backward accumulates into the buffer, the all-reduce runs on it,
``GradSync.zero_grad`` zeroes it) and once copying (``grad_views=False``: fresh gradients
each iteration, concatenated into a new buffer and copied back, cleared with
``p.grad = None`` as ``optimizer.zero_grad(set_to_none=True)`` does). The iteration time
includes the zeroing.

It prints the median per-iteration backward time, exposed sync time (time spent
in ``finish()``, what the iteration waits for), iteration time, and the ratios.
Timings are of this machine (2 ranks sharing its cores; gloo's all-reduce competes
with the backward for them), so compare the modes, not the absolute numbers.

``--emulate-gbps G`` (EMULATED, off by default) makes each all-reduce last at least
spec 5.3's ring time over a link of G Gbit/s (``min_seconds``): the bucket's when
blocking; each chunk's when overlapping, one after the other on the link, counted
from its launch.

Run: .venv/bin/python bench/gradsync_overlap.py [--width 768 --iterations 10 --cap-mb 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hetpilot.trainer.gradsync import GradSync
from hetpilot.trainer.launch import spawn
from torch import nn


def _worker(rank: int, world: int, out: str, cfg: dict[str, Any]) -> None:
    torch.manual_seed(0)
    width, layers, micro = cfg["width"], cfg["layers"], cfg["micro"]
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                            for _ in range(layers)])
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    gbps = cfg["emulate_gbps"]

    def minimum(bucket: int, size: int) -> float | None:  # EMULATED link, spec 5.3
        return 2 * (world - 1) / world * size * 8 / (gbps * 1e9) if gbps else None

    group = dist.new_group(list(range(world)))
    syncs = {mode: GradSync([(params, group, "mlp")], bucket_cap_mb=cfg["cap_mb"],
                            overlap=mode.startswith("overlap"), min_seconds=minimum,
                            grad_views=mode.endswith("views"))
             for mode in MODES}
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randn(cfg["batch"], width, generator=gen) for _ in range(micro)]
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in syncs}
    for it in range(cfg["warmup"] + len(MODES) * cfg["iterations"]):
        mode = MODES[it % len(MODES)]
        sync = syncs[mode]
        sync.zero_grad()  # binds the views again after another mode's iteration
        dist.barrier()
        started = time.perf_counter()
        bwd = 0.0
        for k, x in enumerate(data):
            loss = model(x).pow(2).mean()
            if k == micro - 1:
                sync.arm([loss])
            t0 = time.perf_counter()
            loss.backward()
            bwd += time.perf_counter() - t0
        stats = sync.finish()
        if mode.endswith("views"):
            sync.zero_grad()
        else:
            for p in params:
                p.grad = None
        if it >= cfg["warmup"]:
            rows[mode].append({"bwd_s": bwd, "exposed_s": stats.exposed_s,
                               "iteration_s": time.perf_counter() - started,
                               "launched": stats.launched_in_backward,
                               "chunks": stats.chunks, "emulated_s": stats.emulated_s})
    for sync in syncs.values():
        sync.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rows": rows, "bytes": nbytes}))


MODES = ("blocking-copy", "blocking-views", "overlap-copy", "overlap-views")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="samples per microbatch")
    ap.add_argument("--micro", type=int, default=2, help="microbatches per iteration")
    ap.add_argument("--iterations", type=int, default=8, help="per mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cap-mb", type=float, default=4.0)
    ap.add_argument("--emulate-gbps", type=float, default=0.0)
    args = ap.parse_args()
    cfg = {k.replace("-", "_"): v for k, v in vars(args).items()}
    print("CPU / gloo: 2 local ranks, one thread each, on this machine's shared cores "
          "(no GPU, no NCCL)")
    if args.emulate_gbps:
        print(f"EMULATED link: each all-reduce (bucket, or chunk when overlapping) lasts at "
              f"least spec 5.3's ring time at {args.emulate_gbps:g} Gbit/s")
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, 2, (tmp, cfg), 590)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    mb = ranks[0]["bytes"] / 2**20
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) + Tanh, "
          f"{mb:.1f} MiB of float32 gradients; {args.micro} microbatches of {args.batch}; "
          f"bucket cap {args.cap_mb:g} MiB; {args.iterations} iterations per mode, "
          "in turn")
    med: dict[str, dict[str, float]] = {}
    for mode in MODES:
        med[mode] = {key: statistics.median(max(r["rows"][mode][i][key] for r in ranks)
                                            for i in range(args.iterations))
                     for key in ("bwd_s", "exposed_s", "iteration_s", "launched", "chunks")}
    print(f"{'mode':15s} {'backward_s':>11s} {'exposed_sync_s':>15s} {'iteration_s':>12s} "
          f"{'launched_in_bwd':>16s} {'chunks':>7s}")
    for mode, m in med.items():
        print(f"{mode:15s} {m['bwd_s']:11.4f} {m['exposed_s']:15.4f} {m['iteration_s']:12.4f} "
              f"{m['launched']:16.2f} {m['chunks']:7.0f}")
    def ratio(a: str, b: str) -> None:
        x, y = med[a], med[b]
        print(f"{a} / {b}: exposed sync {x['exposed_s'] / y['exposed_s']:.2f}x, "
              f"backward {x['bwd_s'] / y['bwd_s']:.2f}x, "
              f"iteration {x['iteration_s'] / y['iteration_s']:.2f}x")

    print("(medians over iterations of the slower rank)")
    ratio("overlap-views", "blocking-views")
    ratio("blocking-views", "blocking-copy")
    ratio("overlap-views", "overlap-copy")


if __name__ == "__main__":
    main()
