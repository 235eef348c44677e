"""Plans users would otherwise pick, in the same format, for comparison.

* ``even-dp``: every device its own replica with equal samples (DDP);
* ``uniform-pp``: one pipeline over all devices with equal layer counts
  (torch.distributed.pipelining's default split);
* ``megatron``: one pipeline per host, equal layer counts, equal samples;
* ``balanced-homogeneous``: one pipeline per host cut to balance FLOPs as if
  the devices were equal (DeepSpeed ``partition_balanced``, PipeDream), equal
  samples.

Baselines keep the job's schedule (1f1b when allowed) and turn on recompute
only on stages that would not fit otherwise; where even that does not fit
they raise InfeasibleError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

from .errors import InfeasibleError
from .partition import ModelArrays
from .refmodel import stage_memory_mb
from .schedules import inflight, order
from .types import Cluster, Device, Group, Job, Model, Plan, Stage

__all__ = ["BASELINES", "balanced_cuts", "even_split", "uniform_cuts"]


def even_split(total: int, parts: int) -> list[int]:
    """``total`` items over ``parts`` as evenly as possible (first parts get more)."""
    if parts < 1:
        raise InfeasibleError("no devices to plan on")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def uniform_cuts(num_layers: int, stages: int) -> list[int]:
    sizes = even_split(num_layers, stages)
    cuts = [0]
    for s in sizes:
        cuts.append(cuts[-1] + s)
    return cuts


def balanced_cuts(weights: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of ``weights`` into ``stages`` parts minimising the largest part."""
    return list(_balanced_cuts(tuple(weights), stages))


@lru_cache(maxsize=256)
def _balanced_cuts(weights: tuple[float, ...], stages: int) -> tuple[int, ...]:
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        for b in range(j, n + 1):
            for a in range(j - 1, b):
                cost = max(best[j - 1][a], prefix[b] - prefix[a])
                if cost < best[j][b]:
                    best[j][b], back[j][b] = cost, a
    cuts = [n]
    for j in range(stages, 0, -1):
        cuts.append(back[j][cuts[-1]])
    return tuple(reversed(cuts))


def _schedule(job: Job) -> str:
    return "1f1b" if "1f1b" in job.schedules or "custom" in job.schedules else "gpipe"


def _build(cluster: Cluster, model: Model, job: Job, name: str,
           pipelines: Sequence[tuple[Sequence[Device], Sequence[int]]]) -> Plan:
    """Groups with the given cuts, equal microbatches, recompute where needed."""
    schedule = _schedule(job)
    micro = job.microbatch_size
    pipelines = list(pipelines)[: job.microbatches]
    counts = even_split(job.microbatches, len(pipelines))
    groups = []
    for (devs, cuts), m in zip(pipelines, counts, strict=True):
        stages = []
        n = len(devs)
        for j, d in enumerate(devs):
            stage = Stage(device=d.id, layers=(cuts[j], cuts[j + 1]))
            flight = inflight(order(schedule, n, j, m))
            cap = 1000.0 * d.memory_gb
            if stage_memory_mb(model, stage, micro, flight) > cap:
                stage = Stage(device=d.id, layers=stage.layers, recompute=True)
                if stage_memory_mb(model, stage, micro, flight) > cap:
                    raise InfeasibleError(
                        f"{name}: layers [{cuts[j]}, {cuts[j + 1]}) do not fit on {d.id!r}"
                    )
            stages.append(stage)
        groups.append(Group(samples=m * micro, stages=tuple(stages)))
    return Plan(microbatch_size=micro, schedule=schedule, groups=tuple(groups))


def _per_host(cluster: Cluster, limit: int) -> list[list[Device]]:
    hosts: dict[str, list[Device]] = {}
    for d in cluster.devices:
        hosts.setdefault(d.host, []).append(d)
    return [devs[:limit] for devs in hosts.values()]


def even_dp(cluster: Cluster, model: Model, job: Job) -> Plan:
    return _build(cluster, model, job, "even-dp",
                  [([d], [0, model.num_layers]) for d in cluster.devices])


def uniform_pp(cluster: Cluster, model: Model, job: Job) -> Plan:
    devs = list(cluster.devices)[: model.num_layers]
    return _build(cluster, model, job, "uniform-pp",
                  [(devs, uniform_cuts(model.num_layers, len(devs)))])


def megatron(cluster: Cluster, model: Model, job: Job) -> Plan:
    hosts = _per_host(cluster, model.num_layers)
    return _build(cluster, model, job, "megatron",
                  [(h, uniform_cuts(model.num_layers, len(h))) for h in hosts])


def balanced_homogeneous(cluster: Cluster, model: Model, job: Job) -> Plan:
    arr = ModelArrays(model)
    weights = [float(arr.fwd[i + 1] - arr.fwd[i] + arr.bwd[i + 1] - arr.bwd[i])
               for i in range(model.num_layers)]
    hosts = _per_host(cluster, model.num_layers)
    return _build(cluster, model, job, "balanced-homogeneous",
                  [(h, balanced_cuts(weights, len(h))) for h in hosts])


BASELINES: dict[str, Callable[[Cluster, Model, Job], Plan]] = {
    "even-dp": even_dp,
    "uniform-pp": uniform_pp,
    "megatron": megatron,
    "balanced-homogeneous": balanced_homogeneous,
}
