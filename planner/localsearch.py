"""Local search over device mappings, from the best structures the search found.

Why: the structures of :mod:`.structures` are rules (by host, by speed, stage-major,
mixed); on a handful of devices the mapping that wins depends on memory, links
and which layers are heavy together, which no rule gets right every time. On
clusters of up to 4 devices every mapping is a structure; on 5 devices a
randomized comparison with brute force found 22 of 91 cases more than 2% slower
(up to 1.84x); in those looked at, brute force's mapping was one no rule produced (a
slow device in front, two devices swapped, a pipeline run the other way round, an
unused device put to work). Enumerating every mapping of 5-6 devices tripled the
planning time.

So the best few candidates are improved by a descent over mappings one move away:

* two devices swap places (in one group: a new stage order; across groups);
* a group of three or more runs in reverse order;
* a device moves to another position, another group, or a group of its own;
* an unused device replaces a used one, or joins at any position or as a group;
* a device leaves the plan.

Each neighbour is planned like any structure (cut, microbatches, sync) by the
``plan`` callback; the descent moves to the first neighbour that is faster and
stops at a local optimum or when its budget of plannings is spent. Cuts are
memoised by group, so neighbours that keep most groups cost little.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from .candidates import Candidate
from .types import Device

__all__ = ["LOCAL_SEARCH_BUDGET", "LOCAL_SEARCH_DEVICES", "LOCAL_SEARCH_STARTS", "DeviceMapping",
           "descend", "mapping_key", "neighbours"]

LOCAL_SEARCH_DEVICES = 16
"""On clusters of more than :data:`~.structures.EVERY_MAPPING_DEVICES` and up to this many
devices the best candidates are improved by local search over mappings."""
LOCAL_SEARCH_STARTS = 3
"""Candidates per schedule the local search starts from (the fastest distinct mappings)."""
LOCAL_SEARCH_BUDGET = 300
"""Mappings planned per schedule, at most, over all starts (a 5-device neighbourhood is
about 70 mappings, a 16-device one about 500; a planning takes 1-5 ms)."""

DeviceMapping = tuple[tuple[Device, ...], ...]
"""Groups of devices, each in stage order."""


def mapping_key(groups: DeviceMapping) -> tuple[tuple[str, ...], ...]:
    """The device ids of ``groups``, group by group in stage order."""
    return tuple(tuple(d.id for d in g) for g in groups)


def neighbours(groups: DeviceMapping, unused: Sequence[Device]) -> Iterator[DeviceMapping]:
    """Every mapping one move away from ``groups`` (module docstring), each once; none
    empty. ``unused``: devices of the cluster that ``groups`` leaves out."""
    seen = {mapping_key(groups)}
    pos = [(gi, si) for gi, g in enumerate(groups) for si in range(len(g))]

    def emit(new: list[list[Device]]) -> Iterator[DeviceMapping]:
        out = tuple(tuple(g) for g in new if g)
        k = mapping_key(out)
        if out and k not in seen:
            seen.add(k)
            yield out

    def copy() -> list[list[Device]]:
        return [list(g) for g in groups]

    for gi, g in enumerate(groups):  # reversals: the pipeline run the other way round
        if len(g) > 2:
            new = copy()
            new[gi].reverse()
            yield from emit(new)
    for i, (ga, sa) in enumerate(pos):  # swaps
        for gb, sb in pos[i + 1:]:
            new = copy()
            new[ga][sa], new[gb][sb] = new[gb][sb], new[ga][sa]
            yield from emit(new)
    for ga, sa in pos:  # moves and drops
        dev = groups[ga][sa]
        base = copy()
        del base[ga][sa]
        for gb in range(len(groups)):
            for at in range(len(base[gb]) + 1):
                new = [list(g) for g in base]
                new[gb].insert(at, dev)
                yield from emit(new)
        yield from emit([*base, [dev]])
        yield from emit(base)
    for u in unused:  # replacements and additions
        for ga, sa in pos:
            new = copy()
            new[ga][sa] = u
            yield from emit(new)
        for gb in range(len(groups)):
            for at in range(len(groups[gb]) + 1):
                new = copy()
                new[gb].insert(at, u)
                yield from emit(new)
        yield from emit([*copy(), [u]])


def descend(start: Candidate, devices: Sequence[Device],
            plan: Callable[[DeviceMapping], Candidate | None], budget: int,
            tried: set[tuple[tuple[str, ...], ...]] | None = None) -> list[Candidate]:
    """Descent from ``start`` over :func:`neighbours`, taking the first faster neighbour
    each time, planning at most ``budget`` mappings; returns each improvement found, in
    order (the last is the best), or nothing when ``start`` is a local optimum.

    First improvement rather than steepest descent: on 16 devices a neighbourhood is
    about 500 mappings, and under the same budget steepest descent stopped after one
    or two steps where first improvement went on to plans up to 18% faster (PipeDream's
    VGG16 on its 16-GPU cluster: 0.82 against 0.67 s).

    ``tried``: mappings planned before on the same cluster, skipped, and updated with
    those planned now (:class:`.carried_descent.CarriedDescent` resumes a descent over slots: a
    mapping that was not faster than the best then cannot be faster than the best now)."""
    by_id = {d.id: d for d in devices}
    current = tuple(tuple(by_id[s.device] for s in g.stages) for g in start.plan.groups)
    best_s = start.iteration_s
    tried = set() if tried is None else tried
    tried.add(mapping_key(current))
    out: list[Candidate] = []
    while budget > 0:
        used = {d.id for g in current for d in g}
        unused = [d for d in devices if d.id not in used]
        step: tuple[Candidate, DeviceMapping] | None = None
        for groups in neighbours(current, unused):
            k = mapping_key(groups)
            if k in tried:
                continue
            tried.add(k)
            budget -= 1
            cand = plan(groups)
            if cand is not None and cand.iteration_s < best_s * (1 - 1e-9):
                step = (cand, groups)
                break
            if budget <= 0:
                break
        if step is None:
            break
        out.append(step[0])
        best_s, current = step[0].iteration_s, step[1]
    return out
