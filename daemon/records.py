"""What the daemon keeps: jobs, plan versions, agents and their reports.

Plain frozen dataclasses; the store persists them as JSON and the servicers
translate them to and from protobuf (:mod:`hetpilot.daemon.convert`). Nothing
here imports grpc.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, NamedTuple, Self

__all__ = [
    "JOB_CANCELLED",
    "JOB_ENDED",
    "JOB_FAILED",
    "JOB_PENDING",
    "JOB_RUNNING",
    "JOB_SUCCEEDED",
    "LAUNCH_EXITED",
    "LAUNCH_ORDERED",
    "LAUNCH_RUNNING",
    "AgentRecord",
    "AgentReport",
    "DeviceInfo",
    "DeviceReport",
    "DrainRecord",
    "HostLaunch",
    "JobProgress",
    "JobRecord",
    "JobStatus",
    "JobView",
    "LaunchRecord",
    "LayerTime",
    "LinkReport",
    "MeasurementRecord",
    "PlanRecord",
    "StageTiming",
    "TimingsRecord",
]

JOB_PENDING = "pending"
JOB_RUNNING = "running"
JOB_CANCELLED = "cancelled"
JOB_SUCCEEDED = "succeeded"
JOB_FAILED = "failed"
JOB_ENDED = frozenset({JOB_CANCELLED, JOB_SUCCEEDED, JOB_FAILED})
"""States in which a job has no control loop and takes no budget change."""

LAUNCH_ORDERED = "ordered"
LAUNCH_RUNNING = "running"
LAUNCH_EXITED = "exited"


def _plain(value: Any) -> Any:
    """``dataclasses.asdict`` for these records, without its deep copy of every leaf
    (a third of the daemon's CPU per agent report went there): the leaves are
    scalars and strings, and JSON copies them anyway."""
    if isinstance(value, _Json):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}  # type: ignore[arg-type]
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


_compact = json.JSONEncoder(separators=(",", ":")).encode


class _Json:
    """to_json / from_json for flat dataclasses whose tuples hold dataclasses or scalars
    (``_nested`` names the dataclass of each such tuple's items)."""

    _nested: ClassVar[dict[str, type]] = {}

    def to_json(self) -> str:
        return json.dumps(_plain(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        kwargs: dict[str, Any] = {}
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        for key, value in data.items():
            if key not in names:
                continue
            nested = cls._nested.get(key)
            if nested is not None:
                value = tuple(nested.from_dict(v) for v in value)  # type: ignore[attr-defined]
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True, kw_only=True)
class JobRecord(_Json):
    job_id: str
    owner: str
    name: str
    state: str
    global_batch: int
    microbatch_size: int
    schedules: tuple[str, ...]
    budgets: dict[str, float]
    V: float
    slot_s: float
    allowed_hosts: tuple[str, ...] = ()
    model_json: str = ""
    """Spec v1 section 2 JSON; empty until the trainer profiles (profile_on_attach)."""
    profile_on_attach: bool = False
    request_id: str = ""
    created_ms: int = 0
    slot_iterations: int = 0
    """Slots counted in reported training iterations (0: every ``slot_s`` seconds)."""
    started_ms: int = 0
    """When the first trainer rank attached (0: none yet): the job's cost counts from here."""
    ended_ms: int = 0
    """When the job ended (succeeded, failed, cancelled); 0 while it has not."""
    reason: str = ""
    """Why it ended (a failed trainer's error, "finished", "cancelled by the owner")."""
    tensor_parallel: bool = False
    """The job's trainer runs tensor-parallel stages (it said so on its last Attach: its
    job has a ``tp_plan``), so the job is planned with them (spec 5.6); False: never."""
    entry: dict[str, Any] = field(default_factory=dict)
    """The entry point the agents start (:meth:`hetpilot.entry.Entry.to_dict`); empty:
    the owner starts the ranks. Stored as plain JSON, so older bodies read back empty."""

    @property
    def ended(self) -> bool:
        return self.state in JOB_ENDED

    def with_changes(self, **changes: Any) -> JobRecord:
        return replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class JobStatus(_Json):
    """What the control loop leaves after each slot."""

    slot: int = 0
    plan_version: int = 0
    iteration_s: float = 0.0
    costs: dict[str, float] = field(default_factory=dict)
    cost_sums: dict[str, float] = field(default_factory=dict)
    """Sum over slots of each cost rate; / slot gives the time average."""
    queues: dict[str, float] = field(default_factory=dict)
    devices: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    spent: dict[str, float] = field(default_factory=dict)
    """Each cost rate integrated over the wall time it ran since the first Attach
    (``price_per_hour`` -> dollars, ``power_watts`` -> watt-hours)."""
    updated_ms: int = 0
    """Wall clock of this slot (where the next slot's ``spent`` picks up)."""

    def average_costs(self) -> dict[str, float]:
        return {k: v / self.slot for k, v in self.cost_sums.items()} if self.slot else {}


@dataclass(frozen=True, kw_only=True)
class DrainRecord(_Json):
    """A drained host (``hetpilot drain``): left out of every job's planning until resumed."""

    host: str
    since_ms: int
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class HostLaunch(_Json):
    """One host's part of a launch, as the daemon ordered it and its agent last reported it."""

    host: str
    devices: tuple[str, ...]
    """Indexes of the host's devices, one rank each, in local rank order."""
    rdzv_host: bool = False
    """This host runs the c10d rendezvous store."""
    state: str = LAUNCH_ORDERED
    """"ordered" (not reported yet), "running", "exited"."""
    exit_code: int = 0
    pid: int = 0
    reason: str = ""
    stopped: bool = False
    """The agent stopped it on the daemon's order."""
    log_bytes: int = 0
    """Output bytes the launch had written when it exited (all of it must arrive)."""
    updated_ms: int = 0


@dataclass(frozen=True, kw_only=True)
class LaunchRecord(_Json):
    """A job's launch (jobs with an entry point): which hosts run its ranks, under
    torchrun with c10d rendezvous at ``rdzv_endpoint``. One per job; never re-made (its
    port may change until the store's host has started: ``busy_ports``)."""

    launch_id: str
    job_id: str
    rdzv_endpoint: str
    hosts: tuple[HostLaunch, ...]
    created_ms: int = 0
    busy_ports: tuple[int, ...] = ()
    """Rendezvous ports the store's host found in use, in the order tried (the launch
    moved on to another port each time)."""
    _nested: ClassVar[dict[str, type]] = {"hosts": HostLaunch}

    @property
    def rdzv_port(self) -> int:
        return int(self.rdzv_endpoint.rpartition(":")[2])

    @property
    def exited(self) -> bool:
        """Every host's part has exited."""
        return all(h.state == LAUNCH_EXITED for h in self.hosts)

    def device_ids(self) -> frozenset[str]:
        return frozenset(f"{h.host}:{d}" for h in self.hosts for d in h.devices)

    def host(self, host: str) -> HostLaunch | None:
        return next((h for h in self.hosts if h.host == host), None)

    def with_host(self, part: HostLaunch) -> LaunchRecord:
        return replace(self, hosts=tuple(part if h.host == part.host else h
                                         for h in self.hosts))


@dataclass(frozen=True, kw_only=True)
class PlanRecord(_Json):
    job_id: str
    version: int
    slot: int
    plan: dict[str, Any]
    """Spec v1 section 4 JSON (serde.plan_to_dict)."""
    iteration_s: float
    costs: dict[str, float]
    queues: dict[str, float]
    switch_cost_s: float = 0.0
    warnings: tuple[str, ...] = ()
    created_ms: int = 0


@dataclass(frozen=True, kw_only=True)
class DeviceInfo(_Json):
    index: str
    name: str
    kind: str
    """"cpu", "cuda" or "emulated"."""
    tflops: float
    memory_gb: float
    price_per_hour: float = 0.0
    power_watts: float = 0.0
    emulated: bool = False
    probe_dtype: str = ""
    """What the matmul probe behind ``tflops`` ran ("float32"; empty: declared)."""
    probe_shape: str = ""
    """Its shape, "m x k x n" as "4096x4096x4096"."""


@dataclass(frozen=True, kw_only=True)
class AgentRecord(_Json):
    host: str
    probe_address: str
    devices: tuple[DeviceInfo, ...]
    registered_ms: int = 0
    launches: bool = False
    """The agent starts job ranks when ordered (RegisterRequest.launches)."""
    secret_hash: str = ""
    """SHA-256 (hex) of the secret the host name is bound to (RegisterRequest.host_secret);
    empty: not bound (registered before bindings existed, or forgotten)."""
    _nested: ClassVar[dict[str, type]] = {"devices": DeviceInfo}

    @property
    def agent_id(self) -> str:
        return self.host


@dataclass(frozen=True, kw_only=True)
class DeviceReport(_Json):
    index: str
    tflops: float
    memory_total_gb: float = 0.0
    memory_free_gb: float = 0.0
    utilization: float = 0.0
    colocated_processes: int = 0
    colocated_load: float = 0.0
    emulated: bool = False
    probe_dtype: str = ""
    probe_shape: str = ""


@dataclass(frozen=True, kw_only=True)
class LinkReport(_Json):
    peer_host: str
    gbps: float
    rtt_us: float


@dataclass(frozen=True, kw_only=True)
class AgentReport(_Json):
    agent_id: str
    seq: int
    unix_ms: int
    devices: tuple[DeviceReport, ...] = ()
    links: tuple[LinkReport, ...] = ()
    _nested: ClassVar[dict[str, type]] = {"devices": DeviceReport, "links": LinkReport}

    def to_json(self) -> str:
        """The generic JSON, written without walking the fields (one report a second per
        agent): a frozen dataclass's ``vars`` holds its fields in their order, scalars."""
        return _compact({"agent_id": self.agent_id, "seq": self.seq, "unix_ms": self.unix_ms,
                         "devices": [vars(d) for d in self.devices],
                         "links": [vars(link) for link in self.links]})


@dataclass(frozen=True, kw_only=True)
class StageTiming(_Json):
    stage_index: int
    device_id: str
    fwd_s: float
    bwd_s: float
    comm_s: float
    samples_per_s: float


@dataclass(frozen=True, kw_only=True)
class TimingsRecord(_Json):
    job_id: str
    rank: int
    plan_version: int
    iteration: int
    stages: tuple[StageTiming, ...]
    unix_ms: int = 0
    loss: float | None = None
    """Mean training loss over the iterations the report covers; None when none ran."""
    eval_metric: float | None = None
    """Held-out metric at the end of an epoch (jobs with an evaluation hook)."""
    _nested: ClassVar[dict[str, type]] = {"stages": StageTiming}


@dataclass(frozen=True, kw_only=True)
class LayerTime(_Json):
    layer: int
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True, kw_only=True)
class LinkTime(_Json):
    """A link from the measuring device to ``peer`` as the job's process group saw it
    (:mod:`hetpilot.trainer.linkprobe`), with the link the daemon planned with then."""

    peer: str
    latency_s: float
    gbps: float
    ref_latency_s: float = 0.0
    ref_gbps: float = 0.0
    """The pair's latency and bandwidth in the daemon's cluster when the measurement came
    (0: unknown); later changes of the agents' figures shift the measured ones by the same
    amount (latency) or factor (bandwidth)."""


@dataclass(frozen=True, kw_only=True)
class MeasurementRecord(_Json):
    """What one device measured on the job's own layers (a rank's Attach): the latest
    per (job, device) is kept and fitted by :mod:`hetpilot.daemon.measured_fit`."""

    job_id: str
    device_id: str
    rank: int
    microbatch: int
    dtype: str
    layers: tuple[LayerTime, ...]
    ref_tflops: float = 0.0
    """The speed the daemon planned this device with when the measurement came (0:
    the device was unknown then): later changes of that speed (an agent reporting a
    slowdown) scale the measured speed by the same factor."""
    unix_ms: int = 0
    links: tuple[LinkTime, ...] = ()
    """Links to other ranks' devices measured by the job (each pair from one end)."""
    _nested: ClassVar[dict[str, type]] = {"layers": LayerTime, "links": LinkTime}


@dataclass(frozen=True, kw_only=True)
class JobProgress(_Json):
    """Training progress as the trainer last reported it (one per job).

    The loss and the eval metric are tracked apart: a report without an eval
    metric (a partial epoch) leaves the last one in place. The latest report
    wins, not the highest step, so a trainer restarted from scratch shows its
    own losses at once. NaN and infinity are kept (JSON ``NaN``/``Infinity``,
    which :mod:`json` reads back): a diverged run must be visible.
    """

    loss: float | None = None
    loss_step: int = 0
    loss_unix_ms: int = 0
    eval_metric: float | None = None
    eval_step: int = 0

    def updated(self, timings: TimingsRecord) -> JobProgress:
        """This progress after ``timings``; ``self`` itself when nothing changes (a report
        without loss or eval metric, or another rank's report of the same step and value:
        every rank reports the epoch's loss, and the first report's time is kept)."""
        new = self
        if timings.loss is not None and not (
                timings.iteration == self.loss_step and _same(timings.loss, self.loss)):
            new = replace(new, loss=timings.loss, loss_step=timings.iteration,
                          loss_unix_ms=timings.unix_ms)
        if timings.eval_metric is not None and not (
                timings.iteration == self.eval_step and _same(timings.eval_metric,
                                                              self.eval_metric)):
            new = replace(new, eval_metric=timings.eval_metric, eval_step=timings.iteration)
        return new


def _same(a: float, b: float | None) -> bool:
    """Equal, NaN equal to NaN (``float('nan') != float('nan')``)."""
    return b is not None and (a == b or (math.isnan(a) and math.isnan(b)))


class JobView(NamedTuple):
    """What the job owner's calls return: the job, its last slot, its training progress."""

    job: JobRecord
    status: JobStatus
    progress: JobProgress
