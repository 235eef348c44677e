"""Bootstrap data set: real co-located load against real stages, on this machine.

``python -m hetpilot.adapt.collect --out adapt/data/bootstrap.csv`` runs
*episodes*. Each episode holds one interference configuration: ``n_matmul``
worker processes multiplying float32 matrices and ``n_memory`` worker
processes streaming a 32 MB array (memory-bound), each busy for ``duty`` of
every 20 ms (numpy, one thread each). The configuration persists into the
next episode with probability ``persist``, like load on a shared host. In
each episode a few stages (small torch layer stacks: MLPs, convolutions,
norm + activation) are measured, one row each:

1. a probe window measures what an agent reports: CPU utilisation and
   co-located load (from /proc/stat, our own CPU time taken out), runnable
   processes (/proc/loadavg), memory in use (/proc/meminfo), the agent's
   matmul probe (``agents.probes.cpu_matmul_tflops``) over its quiet value,
   and loopback UDP round-trip time and jitter to an echo process;
2. the stage then runs forward + backward (torch, one thread) and its time
   per step is the median over repetitions.

A stage's quiet time is the least time measured with no workers running;
``slowdown = measured_s / quiet_s``. Nothing is emulated: the load is real
processes and the stages are real torch ops (other work on the machine is
part of the measurement, visible in the utilisation features).

torch is imported inside the collection functions only.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .features import FEATURES, KINDS, Interference, Workload, row

__all__ = ["collect", "main"]

_PERIOD = 0.02


def _worker(kind: str, duty: float, stop: Any) -> None:
    import numpy as np

    if kind == "matmul":
        a = np.random.default_rng(1).standard_normal((192, 192), dtype=np.float32)

        def work() -> None:
            a @ a
    else:
        buf = np.zeros(8 * 1024 * 1024, dtype=np.float32)  # 32 MB

        def work() -> None:
            np.add(buf, 1.0, out=buf)
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duty * _PERIOD:
            work()
        rest = _PERIOD - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)


def _echo(port_q: Any, stop: Any) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    port_q.put(sock.getsockname()[1])
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            data, addr = sock.recvfrom(64)
            sock.sendto(data, addr)


class _Load:
    """The co-located worker processes of one configuration."""

    def __init__(self, ctx: Any, n_matmul: int, n_memory: int, duty: float) -> None:
        self.config = (n_matmul, n_memory, duty)
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=_worker, args=(k, duty, self.stop), daemon=True)
                      for k in ["matmul"] * n_matmul + ["memory"] * n_memory]
        for p in self.procs:
            p.start()

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()


def _cpu_times() -> tuple[float, float]:
    with open("/proc/stat") as fh:
        vals = [float(x) for x in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals), sum(vals) - idle


def _running() -> int:
    with open("/proc/loadavg") as fh:
        return int(fh.read().split()[3].split("/")[0])


def _mem_used() -> float:
    info: dict[str, float] = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            info[k] = float(v.split()[0])
    return 1.0 - info.get("MemAvailable", 0.0) / max(info.get("MemTotal", 1.0), 1.0)


def _probe(sock: socket.socket, port: int, quiet_tflops: float) -> Interference:
    from hetpilot.agents.probes import cpu_matmul_tflops

    hz = os.sysconf("SC_CLK_TCK")
    ncpu = os.cpu_count() or 1
    tot0, busy0 = _cpu_times()
    own0 = sum(os.times()[:2])
    running = [_running()]
    rtts = []
    for i in range(8):
        t0 = time.perf_counter()
        sock.sendto(i.to_bytes(4, "little"), ("127.0.0.1", port))
        with contextlib.suppress(TimeoutError):
            sock.recvfrom(64)
        rtts.append((time.perf_counter() - t0) * 1e6)
        time.sleep(0.005)
        if i % 3 == 0:
            running.append(_running())
    tflops = cpu_matmul_tflops(n=256, seconds=0.05)
    running.append(_running())
    tot1, busy1 = _cpu_times()
    own = (sum(os.times()[:2]) - own0) * hz
    total = max(tot1 - tot0, 1e-9)
    util = min(1.0, (busy1 - busy0) / total)
    colocated = min(1.0, max(0.0, (busy1 - busy0 - own) / total))
    del ncpu
    return Interference(
        utilization=util, colocated_load=colocated,
        colocated_processes=max(0.0, statistics.fmean(running) - 1.0),
        memory_used=_mem_used(), probe_ratio=tflops / quiet_tflops,
        rtt_us=statistics.median(rtts), rtt_jitter_us=statistics.pstdev(rtts))


def _stages() -> dict[str, tuple[Callable[[], Any], tuple[int, ...]]]:
    from torch import nn

    def mlp(w: int, d: int) -> Callable[[], Any]:
        return lambda: nn.Sequential(*[m for _ in range(d) for m in (nn.Linear(w, w), nn.ReLU())])

    def conv(c: int) -> Callable[[], Any]:
        return lambda: nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(c, c, 3, padding=1), nn.ReLU())

    def norm(w: int) -> Callable[[], Any]:
        return lambda: nn.Sequential(*[m for _ in range(3) for m in (nn.LayerNorm(w), nn.GELU())])

    def mix(w: int) -> Callable[[], Any]:
        return lambda: nn.Sequential(nn.Linear(w, w), nn.LayerNorm(w), nn.GELU(),
                                     nn.Linear(w, w), nn.LayerNorm(w), nn.GELU())

    return {
        "mlp256x2_b32": (mlp(256, 2), (32, 256)),
        "mlp512x2_b32": (mlp(512, 2), (32, 512)),
        "mlp512x4_b64": (mlp(512, 4), (64, 512)),
        "mlp1024x2_b32": (mlp(1024, 2), (32, 1024)),
        "conv16_b8": (conv(16), (8, 16, 24, 24)),
        "conv32_b8": (conv(32), (8, 32, 16, 16)),
        "norm2048_b64": (norm(2048), (64, 2048)),
        "norm4096_b32": (norm(4096), (32, 4096)),
        "mix512_b64": (mix(512), (64, 512)),
    }


def _workload(module: Any, shape: tuple[int, ...]) -> Workload:
    import torch
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(*shape)
    acts: list[float] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: acts.append(o.numel() * 4 / 1e6))
             for m in module]
    counter = FlopCounterMode(display=False)
    with counter:
        out = module(x)
    for h in hooks:
        h.remove()
    # element-wise layers (norms, activations): ~5 FLOP per output element
    elementwise = sum(5 * a * 1e6 / 4 for m, a in zip(module, acts, strict=True)
                      if not isinstance(m, (nn.Linear, nn.Conv2d)))
    kinds = dict.fromkeys(KINDS, 0.0)
    from .features import layer_kind

    for m in module:
        kinds[layer_kind(type(m).__name__)] += 1.0 / len(module)
    return Workload(gflop=(counter.get_total_flops() + elementwise) / 1e9,
                    param_mb=sum(p.numel() for p in module.parameters()) * 4 / 1e6,
                    act_mb=sum(acts), out_mb=out.numel() * 4 / 1e6, **kinds)


def _time_stage(module: Any, x: Any, budget_s: float = 0.3) -> float:
    """Mean seconds per forward + backward over a window of ``budget_s``: the
    stage's throughput, time slices lost to co-located processes included."""
    module.zero_grad(set_to_none=True)
    module(x).sum().backward()  # warm up
    reps, t0 = 0, time.perf_counter()
    while True:
        module(x).sum().backward()
        reps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget_s and reps >= 3:
            return elapsed / reps


def collect(out: Path, episodes: int, per_episode: int = 3, persist: float = 0.5,
            seed: int = 0, log: Callable[[str], None] = print) -> int:
    import torch
    from hetpilot.agents.probes import cpu_matmul_tflops

    torch.set_num_threads(1)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    rng = random.Random(seed)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    port_q = ctx.Queue()
    echo = ctx.Process(target=_echo, args=(port_q, stop), daemon=True)
    echo.start()
    port = port_q.get(timeout=30)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(0.5)
    torch.manual_seed(0)
    stages = {name: (make(), torch.randn(*shape)) for name, (make, shape) in _stages().items()}
    works = {name: _workload(m, tuple(x.shape)) for name, (m, x) in stages.items()}
    quiet_tflops = max(cpu_matmul_tflops(n=256, seconds=0.1) for _ in range(3))
    quiet: dict[str, float] = {n: min(_time_stage(m, x) for _ in range(2))
                               for n, (m, x) in stages.items()}
    configs = [(mm, me, d) for mm in range(4) for me in range(3) for d in (0.4, 0.7, 1.0)
               if mm + me > 0 or d == 1.0]
    rows: list[dict[str, Any]] = []
    load: _Load | None = None
    config = (0, 0, 1.0)
    t_start = time.time()
    try:
        for ep in range(episodes):
            if ep == 0 or rng.random() > persist:
                config = rng.choice(configs) if rng.random() > 0.15 else (0, 0, 1.0)
            if load is None or load.config != config:
                if load is not None:
                    load.close()
                load = _Load(ctx, *config)
                time.sleep(0.3)
            for name in rng.sample(sorted(stages), per_episode):
                module, x = stages[name]
                inter = _probe(sock, port, quiet_tflops)
                measured = _time_stage(module, x)
                if config[0] + config[1] == 0:
                    quiet[name] = min(quiet[name], measured)
                rows.append({"t": round(time.time() - t_start, 3), "episode": ep, "stage": name,
                             "n_matmul": config[0], "n_memory": config[1], "duty": config[2],
                             **asdict(inter), **asdict(works[name]),
                             "log_intensity": works[name].log_intensity,
                             "measured_s": measured})
            if ep % 10 == 0:
                log(f"episode {ep}/{episodes}: {len(rows)} rows, config {config}")
    finally:
        if load is not None:
            load.close()
        stop.set()
        echo.join(2.0)
    for r in rows:
        r["quiet_s"] = quiet[r["stage"]]
        r["slowdown"] = r["measured_s"] / r["quiet_s"]
    out.parent.mkdir(parents=True, exist_ok=True)
    cols = ["t", "episode", "stage", "n_matmul", "n_memory", "duty", *FEATURES,
            "quiet_s", "measured_s", "slowdown"]
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    assert len(row(Interference(), works[next(iter(works))])) == len(FEATURES)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"  # before numpy and torch load their thread pools
    p = argparse.ArgumentParser(prog="python -m hetpilot.adapt.collect", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("adapt/data/bootstrap.csv"))
    p.add_argument("--episodes", type=int, default=160)
    p.add_argument("--per-episode", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    n = collect(a.out, a.episodes, a.per_episode, seed=a.seed,
                log=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"wrote {n} rows to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
