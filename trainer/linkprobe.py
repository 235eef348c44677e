"""Links between a job's ranks as the job's own transport sees them.

Why: the daemon plans a job's transfers and gradient sync with the agents' link
figures (a TCP probe between hosts, a configured intra-host bandwidth), but the
job talks through its process group (gloo, NCCL), whose rates differ from both:
on a shared CPU host, gloo moved 18 Gbit/s point to point while a 16 MB
all-reduce reached 4.8-11.5 Gbit/s ring-equivalent, and an activation-sized
message sent while both ranks computed arrived after 1-3 ms against 0.2 ms for
an idle ping-pong. Those two differences were most of the gap between the
reference model's prediction and the measured iteration on pipelines and
data-parallel plans (bench/RESULTS-trainer.md, "Fidelity"). So, on Attach, the
ranks measure their links with the job's own process group and send the figures
with their layer times; the daemon plans the job with them
(:mod:`hetpilot.daemon.measured_fit`).

Per measured pair of ranks (a, b), in a process group of just the two:

* ``latency_s``: the larger of two one-way times. Idle: an activation-sized
  tensor sent as the pipeline sends activations
  (:func:`~hetpilot.trainer.activations.send_activation`: a header message,
  then the tensor), ping-pong, halved. Busy: the pair runs a synthetic
  two-stage 1F1B pipeline (``microbatches`` forwards and backwards of
  ``op_ms`` each, a matmul loop, with the pipeline's own activation and
  gradient messages), each rank leading in half the runs, and the latency is
  the transfer time ``C`` (spec 5.1) at which spec 5.2 gives that pipeline the
  makespan it took, less the message's bytes over ``gbps``. So it is the
  latency *in the reference model's terms* of messages exchanged while both
  ranks compute: on a CPU host whose cores the ranks fill, the transport's
  threads wait for a core, and a message took 1-3 ms instead of 0.2.
* ``gbps``: the pair's all-reduce of ``ar_bytes``, as spec 5.3 models a ring of
  two: ``AR = bytes * 8 / (1000 gbps) + 2 lat`` solved for ``gbps`` with the idle
  one-way time of a one-element message as ``lat`` (at most half the all-reduce's
  time, so noise never makes the bandwidth absurd). **A choice**: the contract has one bandwidth per link for both the
  stage transfers and the all-reduce, and this is the all-reduce's, because the
  sync moves a model's worth of bytes per iteration while a stage boundary moves
  activations whose time is mostly the latency above.

Pairs: every pair when the job has at most ``all_pairs_up_to`` ranks, in
``world - 1`` rounds of disjoint pairs (the circle method); above that only
neighbours in rank order (r, r + 1), in two rounds, since a plan's stages and
sync rings are usually laid out along the ranks. Pairs not measured keep the
agents' figures in the daemon. Every rank calls :func:`measure_links`; every
rank gets the whole result.

The "compute" while busy is a matmul loop on the rank's device. **CUDA/NCCL**:
written for it (the loop synchronises the device; the sends run on NCCL's
streams), **not run on a GPU**: only gloo on CPU is tested here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from hetpilot.planner.refmodel import builtin_makespan_1f1b
from hetpilot.planner.schedules import order
from scipy.optimize import brentq

from .activations import recv_activation, recv_grads, send_activation, send_grads

__all__ = ["LinkTime", "link_entries", "measure_links", "pair_rounds", "synthetic_op_ms"]


@dataclass(frozen=True)
class LinkTime:
    """What the job measured between two of its ranks."""

    latency_s: float
    gbps: float
    idle_latency_s: float
    busy_latency_s: float


def pair_rounds(world: int, all_pairs_up_to: int = 8) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs ``(a, b)`` with ``a < b`` (see the module docstring)."""
    if world < 2:
        return []
    if world > all_pairs_up_to:
        return [[(a, a + 1) for a in range(start, world - 1, 2)] for start in (0, 1)]
    ranks = list(range(world)) + ([-1] if world % 2 else [])  # -1: a bye
    n = len(ranks)
    rounds = []
    for _ in range(n - 1):
        pairs = [(min(ranks[i], ranks[n - 1 - i]), max(ranks[i], ranks[n - 1 - i]))
                 for i in range(n // 2)]
        rounds.append([p for p in pairs if p[0] >= 0])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]  # rotate all but the first
    return rounds


def synthetic_op_ms(microbatch_s: float) -> float:
    """``op_ms`` for :func:`measure_links` from the seconds of one microbatch's forward and
    backward through the whole model: a quarter of it (a two-stage pipeline's forward or
    backward op), within 0.5-20 ms."""
    return min(max(microbatch_s * 250, 0.5), 20.0)


def measure_links(device: torch.device | str, *, msg_bytes: int = 128 * 1024,
                  ar_bytes: int = 16 * 1024 * 1024, repeats: int = 6, op_ms: float = 3.0,
                  microbatches: int = 8,
                  all_pairs_up_to: int = 8) -> dict[tuple[int, int], LinkTime]:
    """Measure the links between this job's ranks (collective: every rank of the default
    process group calls it, with the same arguments). ``op_ms`` and ``microbatches``: the
    synthetic pipeline's op length and size (see the module docstring). Returns
    ``{(a, b): LinkTime}`` for the measured pairs, ``a < b``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device(device)
    rounds = pair_rounds(world, all_pairs_up_to)
    mine: dict[tuple[int, int], dict[str, list[float]]] = {}
    for pairs in rounds:
        groups = [dist.new_group(ranks=list(p)) for p in pairs]  # every rank, same order
        # the gradients' channel, apart from the activations' as the pipeline keeps it
        # under NCCL (Trainer's gradient_group)
        grad_groups = ([dist.new_group(ranks=list(p)) for p in pairs]
                       if dist.get_backend() == "nccl" else [None] * len(pairs))
        for pair, group, grad_group in zip(pairs, groups, grad_groups, strict=True):
            if rank in pair:
                peer = pair[1] if rank == pair[0] else pair[0]
                mine[pair] = _measure_pair(rank, peer, (group, grad_group), dev, msg_bytes,
                                           ar_bytes, repeats, op_ms, microbatches)
        for group in [*groups, *grad_groups]:
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    out: dict[tuple[int, int], LinkTime] = {}
    for pair in (p for pairs in rounds for p in pairs):
        parts = [r[pair] for r in every if r and pair in r]
        idle = statistics.median(x for p in parts for x in p["idle"])
        busy = statistics.median(x for p in parts for x in p["busy"])
        tiny = statistics.median(x for p in parts for x in p["tiny"])
        ar = statistics.median(x for p in parts for x in p["ar"])
        transfer = max(ar - 2 * tiny, ar / 2)  # spec 5.3's two latencies; never below half
        gbps = ar_bytes * 8 / 1e9 / transfer
        busy = max(0.0, busy - msg_bytes * 8 / 1e9 / gbps)  # C_j = lat + bytes / gbps
        out[pair] = LinkTime(latency_s=max(idle, busy), gbps=gbps, idle_latency_s=idle,
                             busy_latency_s=busy)
    return out


def _measure_pair(rank: int, peer: int, groups: tuple[Any, Any], dev: torch.device,
                  msg_bytes: int, ar_bytes: int, repeats: int, op_ms: float,
                  microbatches: int) -> dict[str, list[float]]:
    """This rank's side of one pair: idle one-way times (its ping-pongs, halved), the
    synthetic pipeline's per-transfer times, and the all-reduce's times. ``groups``: the
    pair's group and its gradients' (:mod:`hetpilot.trainer.pipeline`)."""
    group, grad_group = groups
    msg = torch.zeros(max(1, msg_bytes // 4), device=dev)
    big = torch.zeros(max(1, ar_bytes // 4), device=dev)
    a = torch.randn(256, 256, device=dev)
    cuda = dev.type == "cuda"
    first = rank < peer

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)
        dist.barrier(group=group)

    def compute(ms: float) -> float:
        started = time.perf_counter()
        while time.perf_counter() - started < ms / 1e3:
            torch.mm(a, a)
            if cuda:
                torch.cuda.synchronize(dev)
        return time.perf_counter() - started

    def send(k: int) -> None:
        for work, _ in send_activation(msg, peer, k):
            work.wait()

    def ping(activation: bool) -> list[float]:
        """One-way times (ping-pongs, halved) of an activation as the pipeline sends one,
        or of a one-element tensor; the first exchange sets the link up."""
        one = torch.zeros(1, device=dev)
        times = []
        for i in range(repeats + 1):
            sync()
            started = time.perf_counter()
            for sending in ((True, False) if first else (False, True)):
                if activation and sending:
                    send(i)
                elif activation:
                    recv_activation(peer, i, dev)
                elif sending:
                    dist.send(one, peer)
                else:
                    dist.recv(one, peer)
            if cuda:
                torch.cuda.synchronize(dev)
            if i:
                times.append((time.perf_counter() - started) / 2)
        return times

    idle = ping(activation=True)
    tiny = ping(activation=False)
    busy = _pipeline_transfers(rank, peer, group, grad_group, dev, msg, compute, sync,
                               max(1, repeats // 2), op_ms, microbatches)
    ar: list[float] = []
    for i in range(4):
        sync()
        started = time.perf_counter()
        dist.all_reduce(big, group=group)
        if cuda:
            torch.cuda.synchronize(dev)
        if i:  # the first one is a warm-up
            ar.append(time.perf_counter() - started)
    return {"idle": idle, "tiny": tiny, "busy": busy, "ar": ar}


def link_entries(links: dict[tuple[int, int], LinkTime],
                 device_ids: Sequence[str]) -> list[dict[str, dict[str, tuple[float, float]]]]:
    """Per rank, what it sends on Attach: ``{"links": {peer device id: (latency_s, gbps)}}``
    for the pairs whose lower rank it is (each pair once)."""
    out: list[dict[str, dict[str, tuple[float, float]]]] = [{"links": {}} for _ in device_ids]
    for (a, b), t in links.items():
        out[a]["links"][device_ids[b]] = (t.latency_s, t.gbps)
    return out


def _pipeline_transfers(rank: int, peer: int, group: Any, grad_group: Any, dev: torch.device,
                        msg: torch.Tensor, compute: Callable[[float], float],
                        sync: Callable[[], None], repeats: int, op_ms: float,
                        microbatches: int) -> list[float]:
    """Per run, the transfer time ``C`` under which spec 5.2 gives a two-stage 1F1B
    pipeline of ``microbatches`` ops of ``op_ms`` (a matmul loop) the makespan this pair
    took; each rank leads (is stage 0) in half the runs. Both ranks get the same list."""
    m = microbatches
    out: list[float] = []
    for lead in sorted((rank, peer)) * repeats:
        stage = 0 if rank == lead else 1
        sync()
        started = time.perf_counter()
        busy, pending = 0.0, []
        for is_bwd, k in order("1f1b", 2, stage, m):
            if not is_bwd:
                if stage == 1:
                    recv_activation(peer, k, dev)
                busy += compute(op_ms)
                if stage == 0:
                    pending += send_activation(msg, peer, k)
            else:
                if stage == 0:
                    recv_grads([msg], peer, k, grad_group)
                busy += compute(op_ms)
                if stage == 1:
                    pending += send_grads([msg], peer, k, grad_group)
        for work, _ in pending:
            work.wait()
        took = torch.tensor([time.perf_counter() - started, busy / (2 * m)],
                            dtype=torch.float64, device=dev)
        both = [torch.zeros_like(took) for _ in range(2)]
        dist.all_gather(both, took, group=group)
        makespan = max(float(t[0]) for t in both)
        op = sum(float(t[1]) for t in both) / 2
        out.append(_solve_transfer(op, makespan, m))
    return out


def _solve_transfer(op_s: float, makespan: float, microbatches: int) -> float:
    """The ``C`` at which spec 5.2's two-stage 1F1B makespan with every op ``op_s`` long is
    ``makespan`` (the makespan grows with ``C`` and exceeds ``C``, so ``[0, makespan]``
    brackets it); 0 when even ``C = 0`` gives more."""
    def excess(c: float) -> float:
        return builtin_makespan_1f1b([op_s, op_s], [op_s, op_s], [c], microbatches) - makespan

    if excess(0.0) >= 0:
        return 0.0
    return float(brentq(excess, 0.0, makespan, xtol=1e-12))
