"""Structures: which devices form data-parallel groups, in which stage order.

A *structure* fixes the device mapping of a plan; :mod:`.structure_planner` then
cuts its groups and assigns them microbatches. Structures tried:

* ``dp``: every device its own replica;
* ``host``: one pipeline per host (fast intra-host links);
* ``chain``: one pipeline over all devices, hosts chained along fast links;
* ``split-host`` / ``host-pairs``: halves of hosts, pairs of linked hosts;
* ``chunk-s``: pipelines of s devices along the chain (s = 2, 4, 8);
* ``speed-class``: per-host pipelines of devices of similar speed;
* ``fit-dp``: replicas where the model fits, pipelines of the rest;
* ``stage-major-S`` / ``stage-major-speed-S``: K = n / S identical pipelines of
  S stages whose copies of stage s sit side by side (on one host, or in one
  speed class): the pipelines cross hosts, and each stage's gradient
  all-reduce runs among neighbours on fast links (PipeDream's and AMP's
  layouts for hierarchical networks);
* ``mixed-K-slow-first`` / ``mixed-K-fast-first`` (devices of speeds 1.5x or
  more apart): K pipelines of about equal total speed, slow devices beside fast
  ones (Metis' layouts for mixed GPU types);
* ``mapping-i``: on clusters of at most :data:`EVERY_MAPPING_DEVICES` devices,
  every split into groups with every stage order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain as chain_from

from .partition import ModelArrays
from .types import Cluster, Device, Job

__all__ = ["BIG_CLUSTER", "BUILTIN_SCHEDULES", "EVERY_MAPPING_DEVICES", "Structure",
           "balanced_groups", "searched_schedules", "structures"]

EVERY_MAPPING_DEVICES = 4
"""On clusters of up to this many devices every device mapping is a structure (on 5-6
devices, whose every subset is tried, it tripled the planning time)."""
BIG_CLUSTER = 64
"""Above this many devices the search narrows (fewer, coarser structures; see
:func:`~.search.candidate_plans` and :meth:`~.structure_planner.Planner.cut`)."""
BUILTIN_SCHEDULES = ("1f1b", "gpipe")
"""The schedules structures are planned under (custom orders come from 1f1b plans)."""


def searched_schedules(job: Job) -> list[str]:
    """The built-in schedules ``job`` allows, or 1f1b where it allows none."""
    return [s for s in BUILTIN_SCHEDULES if s in job.schedules] or ["1f1b"]


@dataclass(frozen=True)
class Structure:
    label: str
    groups: tuple[tuple[Device, ...], ...]



def _host_chain(cluster: Cluster, devices: Sequence[Device]) -> list[str]:
    """Hosts ordered greedily so that consecutive hosts share fast links."""
    hosts = list(dict.fromkeys(d.host for d in devices))
    if len(hosts) <= 2:
        return hosts
    rep: dict[str, str] = {}
    for d in devices:
        rep.setdefault(d.host, d.id)
    if len(hosts) > 64:  # uniform big clusters: keep the given order (O(n^2) otherwise)
        return hosts
    chain = [hosts[0]]
    left = set(hosts[1:])
    while left:
        last = rep[chain[-1]]
        nxt = max(sorted(left), key=lambda h: cluster.link(last, rep[h])[0])
        chain.append(nxt)
        left.remove(nxt)
    return chain


def _by_host(cluster: Cluster, devices: Sequence[Device]) -> dict[str, list[Device]]:
    out: dict[str, list[Device]] = {h: [] for h in _host_chain(cluster, devices)}
    for d in devices:
        out[d.host].append(d)
    for h in out:  # biggest memory first: stage 0 keeps the most microbatches in flight
        out[h].sort(key=lambda d: (-d.memory_gb, -d.tflops, d.id))
    return out


def _chunks(items: Sequence[Device], size: int) -> list[tuple[Device, ...]]:
    return [tuple(items[i:i + size]) for i in range(0, len(items), size)]


def _alone_mb(arr: ModelArrays, micro: int) -> float:
    """MB one device needs to hold the whole model with recompute (a device fits alone
    when this is at most its memory)."""
    total = arr.num_layers
    params = arr.segment_sum(arr.param, 0, total) * (1 + arr.opt)
    return params + micro * arr.segment_sum(arr.inp, 0, total) + micro * arr.segment_sum(arr.act, 0, total)


def structures(cluster: Cluster, devices: Sequence[Device], arr: ModelArrays,
               micro: int, every_mapping: bool = False) -> list[Structure]:
    """Candidate device mappings for ``devices`` (a subset of the cluster); with
    ``every_mapping`` (clusters of at most :data:`EVERY_MAPPING_DEVICES`), all of them."""
    max_stages = arr.num_layers
    by_host = _by_host(cluster, devices)
    chain = [d for h in by_host for d in by_host[h]]
    out: list[Structure] = []

    def add(label: str, groups: Iterable[Sequence[Device]]) -> None:
        split: list[tuple[Device, ...]] = []
        for g in groups:
            if len(g) > max_stages:
                split.extend(_chunks(list(g), max_stages))
            elif g:
                split.append(g if type(g) is tuple else tuple(g))
        out.append(Structure(label, tuple(split)))

    add("dp", [(d,) for d in chain])
    add("host", by_host.values())
    if len(chain) <= 16:  # deeper single pipelines come from chunks and host pairs
        add("chain", [chain])
    add("split-host", [half for g in by_host.values()
                       for half in (g[: (len(g) + 1) // 2], g[(len(g) + 1) // 2:])])
    hosts = list(by_host.values())
    add("host-pairs", [hosts[i] + (hosts[i + 1] if i + 1 < len(hosts) else [])
                       for i in range(0, len(hosts), 2)])
    big = len(chain) > BIG_CLUSTER  # big clusters: fewer, coarser structures
    for size in (2, 4) if big else (2, 4, 8, 16):
        if size < len(chain):
            add(f"chunk-{size}", _chunks(chain, size))
    tiers: dict[tuple[str, int], list[Device]] = {}
    tier_of: dict[float, int] = {}
    for d in chain:
        tier = tier_of.get(d.tflops)
        if tier is None:
            tier = tier_of[d.tflops] = round(math.log(d.tflops, 1.5))
        tiers.setdefault((d.host, tier), []).append(d)
    add("speed-class", tiers.values())
    need = _alone_mb(arr, micro)
    fit = [d for d in chain if need <= 1000.0 * d.memory_gb]
    fit_ids = {d.id for d in fit}
    rest: dict[str, list[Device]] = {}
    for d in chain:
        if d.id not in fit_ids:
            rest.setdefault(d.host, []).append(d)
    add("fit-dp", [(d,) for d in fit] + list(rest.values()))
    by_speed = sorted(chain, key=lambda d: -d.tflops)  # stable: host order within a speed
    for size in _stage_counts(len(chain), max_stages, big):
        add(f"stage-major-{size}", _stage_major(chain, size))
        add(f"stage-major-speed-{size}", _stage_major(by_speed, size))
    if by_speed[0].tflops >= 1.5 * by_speed[-1].tflops and not big:
        for k in _mixed_counts(by_speed):
            add(f"mixed-{k}-slow-first", balanced_groups(by_speed, k, slow_first=True))
            add(f"mixed-{k}-fast-first", balanced_groups(by_speed, k, slow_first=False))
    if every_mapping:
        for i, groups in enumerate(_ordered_partitions(chain)):
            add(f"mapping-{i}", groups)
    unique: dict[tuple[tuple[int, ...], tuple[int, ...]], Structure] = {}
    for s in out:  # by the devices' objects (one per id in ``devices``) and group sizes
        key = (tuple(map(len, s.groups)), tuple(map(id, chain_from(s.groups))))
        unique.setdefault(key, s)
    return list(unique.values())


def _stage_counts(n: int, max_stages: int, big: bool) -> list[int]:
    """Stage counts S of the stage-major structures: S divides n, K = n / S >= 2."""
    sizes = (2, 4) if big else (2, 3, 4, 6, 8) if n <= 32 else (2, 4, 8)
    return [s for s in sizes if s <= max_stages and n % s == 0 and n // s >= 2]


def _ordered_partitions(devices: Sequence[Device]) -> Iterator[list[tuple[Device, ...]]]:
    """Every split of ``devices`` into groups, with every stage order of each group (73
    for 4 devices): on a handful of devices the order that wins depends on memory, links
    and which layers are heavy together, which no rule above gets right every time (a
    randomized comparison with brute force on 3-4 devices found the best order neither
    fastest- nor slowest-first in half the gaps; bench/RESULTS-planner.md)."""
    if not devices:
        yield []
        return
    first, rest = devices[0], devices[1:]
    for part in _ordered_partitions(rest):
        yield [(first,), *part]
        for i, g in enumerate(part):
            for at in range(len(g) + 1):
                yield [*part[:i], (*g[:at], first, *g[at:]), *part[i + 1:]]


def _mixed_counts(by_speed: Sequence[Device]) -> list[int]:
    """Group counts K of the mixed structures: as many groups as fast devices (each slow
    device then joins a fast one), and 2 and 4, for K < n."""
    n = len(by_speed)
    fast = sum(1 for d in by_speed if d.tflops >= by_speed[0].tflops / 1.5)
    return sorted({k for k in (fast, 2, 4) if 2 <= k < n})


def balanced_groups(by_speed: Sequence[Device], k: int, slow_first: bool) -> list[tuple[Device, ...]]:
    """K pipelines of about equal total speed, each mixing fast and slow devices: the
    devices, fastest first, each to the group with the least speed so far. A slow device
    then takes a short stage beside a fast one instead of sitting idle or slowing a group of
    its own (Metis' GPT on A100 and T4: a T4 with the first 2 of 10 layers ahead of an
    A100). Each group runs slowest first or fastest first: stage 0 holds the most
    microbatches in flight, and the first layers (an embedding) are often the heavy ones."""
    groups: list[list[Device]] = [[] for _ in range(k)]
    least = [(0.0, j) for j in range(k)]  # (speed so far, group): a heap, least first
    for d in by_speed:
        speed, i = least[0]
        groups[i].append(d)
        heapq.heapreplace(least, (speed + d.tflops, i))
    return [tuple(reversed(g)) if slow_first else tuple(g) for g in groups]


def _stage_major(devices: Sequence[Device], size: int) -> list[tuple[Device, ...]]:
    """K = n / size pipelines; stage s of every pipeline on devices s*K .. s*K + K - 1."""
    k = len(devices) // size
    return [tuple(devices[g:g + size * k:k]) for g in range(k)]
