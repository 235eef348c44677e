"""The gradient sync of a valid plan (spec 5.3, 5.6), both readings in one pass.

:func:`~.refmodel.sync_time` reads the spec literally: it lists every layer's
owner in every group, finds the buckets by comparing them layer by layer, and
adds each bucket's ring time into a per-device sum. On plans of a thousand
devices that is most of a judgement, and the tensor-parallel search asks for
the same plan's sync twice (spec 5.6's split rings, then shared uplinks). Here
the same floats come with fewer steps, for plans whose devices are distinct
and whose groups' stages each cover the layers in order (what
:func:`~.refmodel.validate_plan` checks):

* a layer's owner in a group changes only where a stage starts or, inside a
  tensor-parallel stage, where splitting turns on or off; the buckets are the
  ranges between the union of those points, found once per pattern of stages;
* a bucket's size is summed layer by layer from 0.0, as the reference does;
* a ring's slowest link and largest latency are a min and a max (exact in any
  order) over its neighbour pairs, kept per pair: from one bucket to the next only
  the pairs of groups whose owner changed are looked up again;
* a device's sum runs over its stage's buckets in order from 0.0, and depends
  only on those buckets, the stage's degree and the device's index in it, so
  it is formed once per such key; the largest is the answer (max is exact).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .types import Cluster, Group, Model

__all__ = ["sync_readings"]


def _split_flags(model: Model, t: int) -> list[bool]:
    return [layer.splits(t) for layer in model.layers]


def sync_readings(cluster: Cluster, model: Model, groups: Sequence[Group]) -> tuple[float, float]:
    """(spec 5.3/5.6's sync, the shared-uplinks reading) of a valid plan's groups:
    :func:`~.refmodel.sync_time` without and with ``shared_uplinks``, the same floats."""
    k = len(groups)
    if k <= 1:
        return 0.0, 0.0
    num_layers = model.num_layers
    flags: dict[int, list[bool]] = {}
    patterns: dict[tuple[tuple[int, int, int], ...], int] = {}
    pattern_stages: list[tuple[tuple[int, int, int], ...]] = []
    pattern_of: list[int] = []
    points: set[int] = {0, num_layers}
    for g in groups:
        key = tuple((s.layers[0], s.layers[1], len(s.devices)) for s in g.stages)
        p = patterns.get(key)
        if p is None:
            p = patterns[key] = len(pattern_stages)
            pattern_stages.append(key)
            for a, b, t in key:
                points.add(a)
                if t > 1:
                    split = flags.get(t)
                    if split is None:
                        split = flags[t] = _split_flags(model, t)
                    for i in range(a + 1, b):
                        if split[i] != split[i - 1]:
                            points.add(i)
        pattern_of.append(p)
    starts = sorted(points)
    n_buckets = len(starts) - 1
    # per pattern: each bucket's (stage, split degree), and each stage's bucket range
    owner_of: list[list[tuple[int, int]]] = []
    ranges_of: list[list[tuple[int, int]]] = []
    for key in pattern_stages:
        owners = []
        ranges = []
        for j, (a, b, t) in enumerate(key):
            lo = bisect.bisect_left(starts, a)
            hi = bisect.bisect_left(starts, b)
            ranges.append((lo, hi))
            split = flags.get(t)
            for bucket in range(lo, hi):
                owners.append((j, t if t > 1 and split is not None and split[starts[bucket]]
                               else 1))
        owner_of.append(owners)
        ranges_of.append(ranges)
    layers = model.layers
    factor = 2.0 * (k - 1) / k
    lat_hops = 2.0 * (k - 1)
    times_spec: list[list[float]] = []
    times_shared: list[list[float]] = []
    rings_of: list[int] = []
    stage_lists = [g.stages for g in groups]
    link = cluster.link
    # Each ring's slowest link and largest latency, kept per neighbour pair (g, g + 1):
    # from one bucket to the next only the pairs of groups whose owner changed are looked
    # up again (min and max pick one of the values: exact whatever the order).
    members: list[list[str]] = []
    pair_gbps: list[list[float]] = []
    pair_lat: list[list[float]] = []
    last_rings = 0
    changes: list[list[int]] = [[] for _ in range(n_buckets)]  # groups whose owner changes
    for gi, p in enumerate(pattern_of):
        owners = owner_of[p]
        for bucket in range(1, n_buckets):
            if owners[bucket] != owners[bucket - 1]:
                changes[bucket].append(gi)
    for bucket in range(n_buckets):
        size = 0.0
        for layer in range(starts[bucket], starts[bucket + 1]):
            size += layers[layer].param_mb
        rings = min(owners[bucket][1] for owners in owner_of)  # every pattern is a group's
        spec_size = size / rings if rings > 1 else size
        if rings != last_rings:  # every ring's members and pairs afresh
            members, pair_gbps, pair_lat = [], [], []
            for r in range(rings):
                ids = []
                for stages, p in zip(stage_lists, pattern_of, strict=True):
                    devs = stages[owner_of[p][bucket][0]].devices
                    ids.append(devs[r * len(devs) // rings])
                pairs = cluster.path_links([*ids, ids[0]])  # link(ids[i], ids[i + 1 mod k])
                members.append(ids)
                pair_gbps.append([x[0] for x in pairs])
                pair_lat.append([x[1] for x in pairs])
            last_rings = rings
        else:
            for gi in changes[bucket]:
                devs = stage_lists[gi][owner_of[pattern_of[gi]][bucket][0]].devices
                for r in range(rings):
                    ids = members[r]
                    ids[gi] = devs[r * len(devs) // rings]
                    for i in (gi - 1) % k, gi:
                        found = link(ids[i], ids[(i + 1) % k])
                        pair_gbps[r][i], pair_lat[r][i] = found
        spec: list[float] = []
        shared: list[float] = []
        for r in range(rings):
            gbps, lat = min(pair_gbps[r]), max(pair_lat[r])
            spec.append(factor * spec_size * 8.0 / (1000.0 * gbps) + lat_hops * lat)
            shared.append(factor * size * 8.0 / (1000.0 * gbps) + lat_hops * lat)
        times_spec.append(spec)
        times_shared.append(shared)
        rings_of.append(rings)
    worst_spec = worst_shared = 0.0
    seen: set[tuple[int, int, int, int]] = set()
    for ranges, key in zip(ranges_of, pattern_stages, strict=True):
        for (lo, hi), (_, _, n) in zip(ranges, key, strict=True):
            for r in range(n):
                key_s = (lo, hi, n, r)
                if key_s in seen:
                    continue
                seen.add(key_s)
                a_spec = a_shared = 0.0
                for bucket in range(lo, hi):
                    i = r * rings_of[bucket] // n
                    a_spec = a_spec + times_spec[bucket][i]
                    a_shared = a_shared + times_shared[bucket][i]
                worst_spec = max(worst_spec, a_spec)
                worst_shared = max(worst_shared, a_shared)
    return worst_spec, worst_shared
