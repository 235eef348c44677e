"""Bootstrap data set: real co-located load against real stages, on this machine.

``python -m hetpilot.adapt.collect --out adapt/data/bootstrap.csv`` runs
*episodes*. Each episode holds one interference configuration: ``n_matmul``
(0-2) worker processes multiplying float32 matrices and ``n_memory`` (0-1)
worker processes streaming a 32 MB array (memory-bound), each busy for
``duty`` (30-100%) of every 20 ms (numpy, one thread each). With this
machine's 2 cores and our stage on one thread, that is at most 4 runnable
processes of ours, so every stage still makes progress. The configuration
persists into the next episode with probability ``persist``, like load on a
shared host; the workers are started (and have set up their arrays) before
the episode's first measurement.

Each episode runs ``per_episode`` stages (small torch layer stacks: MLPs,
convolutions, norm + activation; a new random choice per episode, as after a
re-cut) for ``slots`` consecutive *slots*. In a slot, each stage runs forward
+ backward (torch, one thread) repeatedly for ``window`` seconds, and the
row's target is its mean time per step over that window: what a trainer
reports for a slot. One row per stage and slot.

The features of a row are what the daemon has when it plans that slot:

- agent statistics over the *previous* window, computed as a CPU agent
  computes them (:mod:`hetpilot.agents.cpustat`): CPU utilisation and
  co-located load (from /proc/stat, our own CPU time taken out), runnable
  processes besides ours (/proc/loadavg, sampled every 0.1 s), memory in use
  (/proc/meminfo), loopback UDP round-trip time and jitter to an echo process
  (every 0.1 s), and the agent's matmul probe (``agents.probes.
  cpu_matmul_tflops``, 0.1 s at the end of the window) over its quiet value.
  The previous window is the previous slot, or, for an episode's first slot,
  a 0.5 s agent window after the configuration was set up (the agent's report
  that arrives between a change and the next slot; our stages do not run in
  it, so utilisation is the co-located work alone);
- the stage's workload (FLOPs, bytes, layer kinds);
- history (trainer reports): the stage's slowdown in the previous slot, 0
  if it did not run there (an episode's first slot with a stage the previous
  episode did not run), and the device's mean slowdown in the previous slot.

A stage's quiet time is the least time per step measured with no workers of
ours running (a calibration of every stage at the start, then every quiet
slot); ``slowdown = measured_s / quiet_s``, and the history features are
computed with the same quiet times once the recording ends. Nothing is
emulated: the load is real processes and the stages are real torch ops;
other work on the machine is part of the measurement (visible in the
utilisation features). No row is dropped.

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


def _worker(kind: str, duty: float, stop: Any, ready: Any) -> None:
    import numpy as np

    if kind == "matmul":
        a = np.random.default_rng(1).standard_normal((192, 192), dtype=np.float32)

        def work() -> None:
            a @ a
    else:
        buf = np.zeros(8 * 1024 * 1024, dtype=np.float32)  # 32 MB

        def work() -> None:
            np.add(buf, 1.0, out=buf)
    work()
    ready.put(kind)
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
        ready = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(k, duty, self.stop, ready), daemon=True)
                      for k in ["matmul"] * n_matmul + ["memory"] * n_memory]
        for p in self.procs:
            p.start()
        for _ in self.procs:  # every worker has its arrays and has run once
            ready.get(timeout=60)

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()


class _Window:
    """Agent statistics over one window (see the module docstring), computed
    as a CPU agent computes them (:mod:`hetpilot.agents.cpustat`)."""

    def __init__(self, sock: socket.socket, port: int) -> None:
        from hetpilot.agents.cpustat import CpuMeter

        self.sock, self.port = sock, port
        self.meter = CpuMeter()  # the job is this process: the stage runs in it
        self.running: list[int] = []
        self.rtts: list[float] = []
        self.next = 0.0

    def tick(self) -> None:
        """Sample runnable processes and one round trip, at most every 0.1 s."""
        from hetpilot.agents.cpustat import runnable

        now = time.perf_counter()
        if now < self.next:
            return
        self.next = now + 0.1
        self.running.append(runnable())
        t0 = time.perf_counter()
        self.sock.sendto(len(self.rtts).to_bytes(4, "little"), ("127.0.0.1", self.port))
        with contextlib.suppress(TimeoutError):
            self.sock.recvfrom(64)
        self.rtts.append((time.perf_counter() - t0) * 1e6)

    def close(self, quiet_tflops: float) -> Interference:
        from hetpilot.agents.cpustat import memory_used
        from hetpilot.agents.probes import cpu_matmul_tflops

        cpu = self.meter.read()
        tflops = cpu_matmul_tflops(n=256, seconds=0.1)
        rtts = self.rtts or [0.0]
        return Interference(
            utilization=cpu.utilization, colocated_load=cpu.colocated_load,
            # the mean over the window's samples, less this process
            colocated_processes=max(0.0, statistics.fmean(self.running or [1]) - 1.0),
            memory_used=memory_used(), probe_ratio=tflops / quiet_tflops,
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


def _time_stage(module: Any, x: Any, window_s: float, win: _Window | None = None) -> float:
    """Mean seconds per forward + backward over a window of ``window_s``: the
    stage's throughput, time slices lost to co-located processes included
    (the agent's samples between steps are not counted)."""
    module.zero_grad(set_to_none=True)
    module(x).sum().backward()  # warm up
    reps, busy, t_start = 0, 0.0, time.perf_counter()
    while True:
        t0 = time.perf_counter()
        module(x).sum().backward()
        t1 = time.perf_counter()
        busy += t1 - t0
        reps += 1
        if win is not None:
            win.tick()
        if t1 - t_start >= window_s and reps >= 3:
            return busy / reps


def _history(rows: list[dict[str, Any]]) -> None:
    """Fill the history features from the rows' slowdowns (in slot order)."""
    by_slot: dict[int, dict[str, float]] = {}
    for r in rows:
        by_slot.setdefault(r["gslot"], {})[r["stage"]] = r["slowdown"]
    for r in rows:
        prev = by_slot.get(r["gslot"] - 1, {})
        r["stage_last_slowdown"] = prev.get(r["stage"], 0.0)
        r["device_last_slowdown"] = statistics.fmean(prev.values()) if prev else 0.0


def collect(out: Path, episodes: int, per_episode: int = 3, slots: int = 4,
            window_s: float = 0.8, persist: float = 0.3, seed: int = 0,
            log: Callable[[str], None] = print) -> int:
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
    quiet: dict[str, float] = {n: min(_time_stage(m, x, window_s) for _ in range(2))
                               for n, (m, x) in stages.items()}
    configs = [(mm, me, d) for mm in range(3) for me in range(2) for d in (0.3, 0.5, 0.7, 1.0)
               if mm + me > 0]
    rows: list[dict[str, Any]] = []
    load: _Load | None = None
    config = (0, 0, 1.0)
    t_start = time.time()
    gslot = 0
    try:
        for ep in range(episodes):
            prev = config
            if ep == 0 or rng.random() > persist:
                config = rng.choice(configs) if rng.random() > 0.15 else (0, 0, 1.0)
            if load is None or load.config != config:
                if load is not None:
                    load.close()
                load = _Load(ctx, *config)
            names = rng.sample(sorted(stages), per_episode)
            win = _Window(sock, port)  # the agent's report after the (re)configuration
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.5:
                win.tick()
                time.sleep(0.02)
            inter = win.close(quiet_tflops)
            for slot in range(slots):
                win = _Window(sock, port)
                for name in rng.sample(names, len(names)):
                    module, x = stages[name]
                    measured = _time_stage(module, x, window_s, win)
                    if config[0] + config[1] == 0:
                        quiet[name] = min(quiet[name], measured)
                    rows.append({"t": round(time.time() - t_start, 2), "episode": ep,
                                 "slot": slot, "gslot": gslot, "stage": name,
                                 "changed": int(slot == 0 and config != prev),
                                 "n_matmul": config[0], "n_memory": config[1],
                                 "duty": config[2], **asdict(inter), **asdict(works[name]),
                                 "log_intensity": works[name].log_intensity,
                                 "measured_s": measured})
                inter = win.close(quiet_tflops)
                gslot += 1
            if ep % 10 == 0:
                log(f"episode {ep}/{episodes}: {len(rows)} rows, config {config}, "
                    f"{time.time() - t_start:.0f} s")
    finally:
        if load is not None:
            load.close()
        stop.set()
        echo.join(2.0)
    for r in rows:
        r["quiet_s"] = quiet[r["stage"]]
        r["slowdown"] = r["measured_s"] / r["quiet_s"]
    _history(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    cols = ["t", "episode", "slot", "gslot", "stage", "changed", "n_matmul", "n_memory", "duty",
            *FEATURES, "quiet_s", "measured_s", "slowdown"]
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.5g}" if isinstance(v, float) else v) for k, v in r.items()})
    assert len(row(Interference(), works[next(iter(works))])) == len(FEATURES)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"  # before numpy and torch load their thread pools
    p = argparse.ArgumentParser(prog="python -m hetpilot.adapt.collect", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("adapt/data/bootstrap.csv"))
    p.add_argument("--episodes", type=int, default=120)
    p.add_argument("--per-episode", type=int, default=3)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--window", type=float, default=0.8, help="seconds per stage and slot")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    n = collect(a.out, a.episodes, a.per_episode, a.slots, a.window, seed=a.seed,
                log=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"wrote {n} rows to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
