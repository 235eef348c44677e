"""Pipelines over torch.distributed: PipeDream-style asynchronous 1F1B with
weight stashing (no flush), and the synchronous 1F1B with a flush per
iteration to compare it with; one stage per rank, gloo on CPU.

**Asynchronous mode** (``flush=False``). Microbatches stream through the
stages without a flush. Stage j runs ``w = S - j - 1`` warm-up forwards, then
alternates one forward and one backward, and steps its optimizer after every
backward. Forward k therefore sees the weights after ``k - w`` updates: stage
j runs with staleness ``S - j - 1``. **Weight stashing**: forward k runs
with a snapshot of the stage's weights taken when it starts
(``torch.func.functional_call`` on detached copies), the autograd graph
keeps that snapshot, and backward k computes its gradient through it, so
each microbatch's backward uses exactly the weights its forward used (the
rule PipeDream needs for a valid gradient); the gradient is then applied to
the live weights. ``record=True`` logs, per microbatch, the weight version
and a checksum at the forward and of the weights the backward used.

**Synchronous mode** (``flush=True``): iteration i runs microbatches
``[i*M, (i+1)*M)`` in 1F1B order, accumulates their gradients and steps once
after the flush; between iterations the run may *re-cut* the stages (a
:class:`Phase` list): every layer's parameters are broadcast from their old
owner, so a re-cut costs a real transfer. The asynchronous mode re-cuts the
same way at a phase's first microbatch, after draining the pipeline there
(the only flush it ever does).

**EMULATED speeds**: ``unit_s`` and per-rank speed functions make each
forward take ``layers * unit_s / speed`` and each backward twice that
(the real compute runs and the rest is slept), so heterogeneous devices and
injected interference can be emulated on one CPU. Outputs say so.

Snapshots of the live weights (every ``snapshot_every`` microbatches in
async mode, every iteration in sync mode) with the time each stage reached
them come back to the caller, which evaluates accuracy after the run so that
evaluation never enters the timed path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Phase", "PipeConfig", "run_local", "stage_main"]


@dataclass(frozen=True)
class Phase:
    """From microbatch ``start`` on, stage r holds layers ``cuts[r]..cuts[r+1]``."""

    start: int
    cuts: tuple[int, ...]


@dataclass
class PipeConfig:
    make_layers: Callable[[], list[nn.Module]]
    """Builds the whole model (same seed on every rank)."""
    data: tuple[torch.Tensor, torch.Tensor]
    """Training inputs and integer labels; microbatch k takes rows of a seeded order."""
    phases: Sequence[Phase]
    microbatch: int = 16
    microbatches: int = 64
    """Microbatches in the whole run."""
    per_iteration: int = 4
    """Microbatches per iteration (sync mode: per flush)."""
    flush: bool = False
    lr: float = 0.05
    unit_s: float = 0.0
    """EMULATED forward seconds per layer at speed 1 (0: no emulation)."""
    speed: Callable[[int, int], float] | None = None
    """EMULATED speed of rank r at microbatch k (default 1)."""
    snapshot_every: int = 4
    record: bool = False
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _order(j: int, S: int, n: int) -> list[tuple[str, int]]:
    w = min(S - j - 1, n)
    ops = [("F", k) for k in range(w)]
    for i in range(n - w):
        ops += [("F", w + i), ("B", i)]
    ops += [("B", k) for k in range(n - w, n)]
    return ops


class _Stage:
    def __init__(self, rank: int, S: int, cfg: PipeConfig, layers: list[nn.Module]) -> None:
        self.rank, self.S, self.cfg = rank, S, cfg
        self.layers = layers
        self.version = 0
        self.log: list[dict[str, Any]] = []
        self.snaps: list[tuple[int, float, dict[int, dict[str, torch.Tensor]]]] = []

    def hold(self, cuts: Sequence[int]) -> None:
        self.lo, self.hi = cuts[self.rank], cuts[self.rank + 1]
        self.module = nn.Sequential(*self.layers[self.lo:self.hi])
        self.params = dict(self.module.named_parameters())

    def _emulate(self, t0: float, factor: float, k: int) -> None:
        cfg = self.cfg
        if cfg.unit_s <= 0:
            return
        speed = cfg.speed(self.rank, k) if cfg.speed else 1.0
        target = factor * (self.hi - self.lo) * cfg.unit_s / speed
        rest = target - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)

    def checksum(self, params: dict[str, torch.Tensor]) -> float:
        return float(sum(p.detach().double().sum() for p in params.values()))


def _batch(cfg: PipeConfig, k: int, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = cfg.data
    n = len(x)
    idx = perm[(torch.arange(cfg.microbatch) + k * cfg.microbatch) % n]
    return x[idx], y[idx]


def _run_ops(st: _Stage, ops: list[tuple[str, int]], k0: int, perm: torch.Tensor,
             width_out: int, t_start: float) -> None:
    """Run one op order (microbatch ids relative to ``k0``); async mode steps per backward."""
    cfg, rank, S = st.cfg, st.rank, st.S
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    stash: dict[int, tuple[int, float, dict[str, torch.Tensor]]] = {}
    grads: dict[str, torch.Tensor] = {}
    sends: list[Any] = []  # isend: a blocking send could wait on a neighbour that sends too
    for op, rel in ops:
        k = k0 + rel
        t0 = time.perf_counter()
        if op == "F":
            if rank == 0:
                x = _batch(cfg, k, perm)[0]
            else:
                hdr = torch.empty(2, dtype=torch.int64)
                dist.recv(hdr, rank - 1, tag=2 * k)
                x = torch.empty(int(hdr[0]), int(hdr[1]))
                dist.recv(x, rank - 1, tag=2 * k)
                x.requires_grad_(True)
            t0 = time.perf_counter()
            # weight stashing: this microbatch's weights, kept by its graph
            snap = {n: p.detach().clone().requires_grad_(True) for n, p in st.params.items()}
            out = torch.func.functional_call(st.module, snap, (x,))
            stash[k] = (st.version, st.checksum(snap) if cfg.record else 0.0, snap)
            inputs[k], outputs[k] = x, out
            st._emulate(t0, 1.0, k)
            if rank < S - 1:
                o = out.detach().contiguous()
                hdr = torch.tensor(o.shape, dtype=torch.int64)
                sends += [(dist.isend(hdr, rank + 1, tag=2 * k), hdr),
                          (dist.isend(o, rank + 1, tag=2 * k), o)]
        else:
            out = outputs.pop(k)
            if rank == S - 1:
                y = _batch(cfg, k, perm)[1]
                loss = nn.functional.cross_entropy(out, y)
                if cfg.flush:
                    loss = loss / cfg.per_iteration
                loss.backward()
            else:
                g = torch.empty_like(out)
                dist.recv(g, rank + 1, tag=2 * k + 1)
                t0 = time.perf_counter()
                out.backward(g)
            x = inputs.pop(k)
            if rank > 0:
                assert x.grad is not None  # x is a received activation that requires grad
                gx = x.grad.contiguous()
                sends.append((dist.isend(gx, rank - 1, tag=2 * k + 1), gx))
            v_fwd, sum_fwd, snap = stash.pop(k)
            if cfg.record:
                st.log.append({"k": k, "fwd_version": v_fwd, "fwd_sum": sum_fwd,
                               "bwd_sum": st.checksum(snap), "bwd_live_version": st.version})
            with torch.no_grad():
                for n, p in snap.items():
                    gr = p.grad if p.grad is not None else torch.zeros_like(p)
                    if cfg.flush:
                        grads[n] = grads[n] + gr if n in grads else gr.clone()
                    else:
                        st.params[n].sub_(cfg.lr * gr)
            if not cfg.flush:
                st.version += 1
                if (k + 1) % cfg.snapshot_every == 0:
                    st.snaps.append((k + 1, time.perf_counter() - t_start, _state(st)))
            st._emulate(t0, 2.0, k)
        if len(sends) > 64:
            for work, _ in sends[:32]:
                work.wait()
            del sends[:32]
    for work, _ in sends:
        work.wait()
    if cfg.flush:
        with torch.no_grad():
            for n, g in grads.items():
                st.params[n].sub_(cfg.lr * g)
        st.version += 1
    del width_out


def _state(st: _Stage) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {n: p.detach().clone() for n, p in st.layers[i].state_dict().items()}
            for i in range(st.lo, st.hi)}


def _recut(st: _Stage, old: Sequence[int], new: Sequence[int]) -> None:
    """Every layer's parameters from its owner under ``old`` to every rank."""
    for r in range(st.S):
        for i in range(old[r], old[r + 1]):
            for p in st.layers[i].parameters():
                dist.broadcast(p.data, src=r)
    st.hold(new)


def stage_main(rank: int, world: int, cfg: PipeConfig) -> dict[str, Any]:
    """One rank's whole run (inside an initialised gloo process group)."""
    torch.manual_seed(cfg.seed)
    layers = cfg.make_layers()
    st = _Stage(rank, world, cfg, layers)
    phases = sorted(cfg.phases, key=lambda p: p.start)
    st.hold(phases[0].cuts)
    perm = torch.randperm(len(cfg.data[0]), generator=torch.Generator().manual_seed(cfg.seed))
    dist.barrier()
    t_start = time.perf_counter()
    recut_s = 0.0
    cuts = phases[0].cuts

    def cut_for(k0: int) -> None:
        """Re-cut (timed) if the phase in force at microbatch k0 has other cuts."""
        nonlocal cuts, recut_s
        want = [p for p in phases if p.start <= k0][-1].cuts
        if tuple(want) != tuple(cuts):
            t0 = time.perf_counter()
            _recut(st, cuts, want)
            cuts = want
            recut_s += time.perf_counter() - t0

    if cfg.flush:
        for it in range(cfg.microbatches // cfg.per_iteration):
            k0 = it * cfg.per_iteration
            cut_for(k0)
            _run_ops(st, _order(rank, world, cfg.per_iteration), k0, perm, 0, t_start)
            st.snaps.append((k0 + cfg.per_iteration, time.perf_counter() - t_start, _state(st)))
    else:
        # Asynchronous: stream microbatches with no flush, except at a re-cut, where
        # the pipeline drains (every backward of the old cut done), the layers move,
        # and streaming resumes; weight versions continue across it.
        starts = sorted({0, *(p.start for p in phases if 0 < p.start < cfg.microbatches)})
        for k0, k1 in zip(starts, [*starts[1:], cfg.microbatches], strict=True):
            cut_for(k0)
            _run_ops(st, _order(rank, world, k1 - k0), k0, perm, 0, t_start)
    dist.barrier()
    return {"rank": rank, "elapsed_s": time.perf_counter() - t_start, "log": st.log,
            "snaps": st.snaps, "recut_s": recut_s, "version": st.version}


def _worker(rank: int, world: int, port: int, cfg: PipeConfig, q: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = stage_main(rank, world, cfg)
        # tensors through a queue share memory with a process about to exit: send arrays
        out["snaps"] = [(k, t, {i: {n: v.numpy() for n, v in st.items()} for i, st in sd.items()})
                        for k, t, sd in out["snaps"]]
        q.put(out)
    finally:
        dist.destroy_process_group()


def run_local(world: int, cfg: PipeConfig, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run ``world`` ranks as local processes (spawn, gloo over loopback); results by rank.

    ``cfg`` must pickle: its callables module-level functions or partials."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = [q.get(timeout=timeout_s) for _ in procs]
    for res in out:
        res["snaps"] = [(k, t, {i: {n: torch.from_numpy(v) for n, v in st.items()}
                                for i, st in sd.items()}) for k, t, sd in res["snaps"]]
    for p in procs:
        p.join(30)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"ranks failed with exit codes {bad}")
    return sorted(out, key=lambda r: r["rank"])
