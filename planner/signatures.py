"""Group signatures: what a pipeline group's cut and makespan depend on.

A group's signature is its devices' (TFLOP/s, memory) and the links between
consecutive devices, in stage order; for a model with ``kind_scale`` (spec 5.1)
also each device's kind. The planner keys its memos of cuts and
makespans on it, and tells groups apart by a small int per distinct signature
(:meth:`GroupSignatures.of`) rather than hashing signatures again. Signatures of
groups of a cluster's own devices are also kept process-wide by the network's
and the devices' objects: a link depends only on the network and the two
devices (ids and hosts), so clusters that share both (the TP search's virtual
clusters keep the devices they do not merge) share them.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import memos
from .types import Cluster, Device, Network

__all__ = ["GroupSignatures"]

Signature = tuple[tuple[tuple[object, ...], ...], tuple[tuple[float, float], ...]]

_SHARED: dict[tuple[int, ...], tuple[Signature, tuple[Device, ...], Network]] = {}
"""Signatures by the ids of the network and the devices, all held in the value."""
memos.register(_SHARED.clear)


class GroupSignatures:
    """One cluster's group signatures, numbered in the order first seen.

    One thread at a time (each search's planner makes its own): the numbering is
    not guarded."""

    def __init__(self, cluster: Cluster, kinds: bool = False) -> None:
        self.cluster = cluster
        self._kinds = kinds
        """Whether devices' kinds tell signatures apart (the model has ``kind_scale``)."""
        self.speeds: list[float] = []
        """Per signature number: its devices' TFLOP/s summed in stage order."""
        self._by_ids: dict[tuple[int, ...], tuple[Signature, int, tuple[Device, ...]]] = {}
        self._by_object: dict[int, tuple[Sequence[Device], Signature, int]] = {}
        self._numbers: dict[Signature, int] = {}
        self._by_groups: dict[int, tuple[Sequence[Sequence[Device]], tuple[int, ...]]] = {}
        self._own = {id(d) for d in cluster.devices}  # the cluster holds them: ids stay theirs
        self._network_id = id(cluster.network)

    def links(self, devs: Sequence[Device]) -> tuple[tuple[float, float], ...]:
        """(Gbit/s, latency) between consecutive devices of the group."""
        if len(devs) < 2:
            return ()
        return self.cluster.path_links([d.id for d in devs])

    def of(self, devs: Sequence[Device]) -> tuple[Signature, int]:
        """The group's signature and its number (equal signatures, equal numbers)."""
        held = self._by_object.get(id(devs))
        if held is not None and held[0] is devs:  # the same group object: the common case
            return held[1], held[2]
        key = tuple(map(id, devs))  # the device objects, held in the value: ids stay theirs
        found = self._by_ids.get(key)
        if found is None:
            sig = self._shared(devs, key)
            number = self._numbers.get(sig)
            if number is None:
                number = self._numbers[sig] = len(self._numbers)
                self.speeds.append(sum(d.tflops for d in devs))
            found = self._by_ids[key] = (sig, number, tuple(devs))
        self._by_object[id(devs)] = (devs, found[0], found[1])  # holding devs keeps its id unique
        return found[0], found[1]

    def numbers(self, groups: Sequence[Sequence[Device]]) -> tuple[int, ...]:
        """The numbers of ``groups``' non-empty groups, in order; kept by the object
        ``groups`` (a search plans one structure under each schedule), which must
        then not change."""
        held = self._by_groups.get(id(groups))
        if held is not None and held[0] is groups:
            return held[1]
        of = self.of
        found = tuple([of(g)[1] for g in groups if g])
        self._by_groups[id(groups)] = (groups, found)  # holding groups keeps its id unique
        return found

    def _shared(self, devs: Sequence[Device], key: tuple[int, ...]) -> Signature:
        owned = len(devs) > 1 and all(map(self._own.__contains__, key))
        if owned:
            held = _SHARED.get((self._network_id, self._kinds, *key))
            if held is not None:  # the objects are held by the entry: the ids are theirs
                return held[0]
        if self._kinds:
            sig: Signature = (tuple([(d.tflops, d.memory_gb, d.kind) for d in devs]),
                              self.links(devs))
        else:
            sig = (tuple([(d.tflops, d.memory_gb) for d in devs]), self.links(devs))
        if owned:
            if len(_SHARED) >= 50_000:
                _SHARED.clear()
            _SHARED[(self._network_id, self._kinds, *key)] = (sig, tuple(devs),
                                                              self.cluster.network)
        return sig
