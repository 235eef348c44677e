"""Protobuf <-> daemon records: every ``*_from_proto`` validates and raises
ValidationError (INVALID_ARGUMENT) or TooLarge (RESOURCE_EXHAUSTED); every
``*_to_proto`` builds a message. The only module of the daemon, with the
servicers, that sees protobuf.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from hetpilot.planner.errors import ValidationError
from hetpilot.planner.types import COST_KINDS, MAX_BUDGET, budget_problem
from hetpilot.v1 import agent_pb2, cluster_pb2, common_pb2, job_pb2, trainer_pb2

from hetpilot.entry import Entry

from .errors import TooLarge
from .launches import LaunchStatus, LogChunk, Order
from .nodes import NODE_DOWN, NODE_DRAINING, NODE_UP, NodeView
from .records import (
    JOB_CANCELLED,
    JOB_FAILED,
    JOB_PENDING,
    JOB_RUNNING,
    JOB_SUCCEEDED,
    LAUNCH_EXITED,
    LAUNCH_ORDERED,
    LAUNCH_RUNNING,
    AgentRecord,
    AgentReport,
    DeviceInfo,
    DeviceReport,
    JobProgress,
    JobRecord,
    JobStatus,
    LaunchRecord,
    LayerTime,
    LinkReport,
    LinkTime,
    MeasurementRecord,
    PlanRecord,
    StageTiming,
    TimingsRecord,
)

__all__ = [
    "MAX_DEVICES",
    "MAX_ITEMS",
    "agent_from_proto",
    "attach_from_proto",
    "attach_response",
    "budgets_from_proto",
    "drain_from_proto",
    "entry_from_proto",
    "entry_to_proto",
    "finish_from_proto",
    "job_to_proto",
    "launches_from_proto",
    "log_chunks_from_proto",
    "metric",
    "nodes_to_proto",
    "order_to_proto",
    "peers_to_proto",
    "plan_to_proto",
    "report_from_proto",
    "resume_from_proto",
    "safe_text",
    "submit_from_proto",
    "timings_from_proto",
    "version",
]

MAX_DEVICES = 64
"""Devices per host."""
MAX_ITEMS = 1024
"""Links per report, allowed hosts per job, stages per timing report."""
MAX_MODEL_CHARS = 2_000_000
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,63}")
"""A probe dtype or shape, a measured dtype: "float32", "4096x4096x4096"; may be empty."""
MAX_LAYER_S = 86400.0
"""Seconds one layer of one microbatch may take in a measurement."""
MAX_VERSION = 2**63 - 1
"""Plan versions are stored as SQLite integers (signed 64 bits)."""
_KINDS = {common_pb2.DEVICE_KIND_CPU: "cpu", common_pb2.DEVICE_KIND_CUDA: "cuda",
          common_pb2.DEVICE_KIND_EMULATED: "emulated"}
_KIND_ENUM = {v: k for k, v in _KINDS.items()}
_STATES = {JOB_PENDING: job_pb2.JOB_STATE_PENDING, JOB_RUNNING: job_pb2.JOB_STATE_RUNNING,
           JOB_CANCELLED: job_pb2.JOB_STATE_CANCELLED,
           JOB_SUCCEEDED: job_pb2.JOB_STATE_SUCCEEDED, JOB_FAILED: job_pb2.JOB_STATE_FAILED}
_OUTCOMES = {trainer_pb2.JOB_OUTCOME_SUCCEEDED: JOB_SUCCEEDED,
             trainer_pb2.JOB_OUTCOME_FAILED: JOB_FAILED}
_OUTCOME_ENUM = {v: k for k, v in _OUTCOMES.items()}
_NODE_STATES = {NODE_UP: cluster_pb2.NODE_STATE_UP, NODE_DOWN: cluster_pb2.NODE_STATE_DOWN,
                NODE_DRAINING: cluster_pb2.NODE_STATE_DRAINING}
MAX_FINISH_REASON = 2000
"""Characters of a trainer's FinishJob reason (an error message, not a traceback)."""
MAX_DRAIN_REASON = 500
MAX_LAUNCHES = 256
"""Launches (and output chunks) one agent report may carry."""
MAX_LAUNCH_REASON = 2000
MAX_LOG_BYTES = 2 * 1024 * 1024
"""Output bytes one agent report may carry (agents send at most 1 MiB)."""
_HOST_LAUNCH_STATES = {LAUNCH_ORDERED: job_pb2.HOST_LAUNCH_STATE_ORDERED,
                       LAUNCH_RUNNING: job_pb2.HOST_LAUNCH_STATE_RUNNING,
                       LAUNCH_EXITED: job_pb2.HOST_LAUNCH_STATE_EXITED}


def name(value: str, field: str) -> str:
    """A host, device index, job id or address: short, printable, no spaces."""
    if not value:
        raise ValidationError(field, "must not be empty")
    if not _NAME.fullmatch(value):
        raise ValidationError(field, f"must match {_NAME.pattern}, got {value[:40]!r}"
                                     f"{' (cut)' if len(value) > 40 else ''}")
    return value


def device_index(value: str, field: str) -> str:
    """A device's index on its host: a name without ':'. A device id is ``host:index`` split
    at its last ':', so an index with one would name another host's device (host "a",
    index "b:0" and host "a:b", index "0" are both "a:b:0")."""
    name(value, field)
    if ":" in value:
        raise ValidationError(field, f"must not contain ':' (device ids are host:index), "
                                     f"got {value[:40]!r}")
    return value


def label(value: str, field: str) -> str:
    """An optional short label (a dtype, a shape): empty, or printable without spaces."""
    if value and not _LABEL.fullmatch(value):
        raise ValidationError(field, f"must match {_LABEL.pattern} or be empty, got "
                                     f"{value[:40]!r}{' (cut)' if len(value) > 40 else ''}")
    return value


def version(value: int, field: str = "after_version") -> int:
    if not 0 <= value <= MAX_VERSION:
        raise ValidationError(field, f"must be in [0, 2^63 - 1], got {value}")
    return value


def safe_text(value: str) -> str:
    """Text for a protobuf string field: lone surrogates (from JSON escapes stored before
    the daemon refused them) become U+FFFD instead of failing the whole answer."""
    return value.encode("utf-8", "replace").decode("utf-8")


def number(value: float, field: str, *, positive: bool = False, maximum: float = 1e12) -> float:
    if not math.isfinite(value):
        raise ValidationError(field, f"must be finite, got {value}")
    if value < 0 or (positive and value == 0):
        raise ValidationError(field, f"must be {'> 0' if positive else '>= 0'}, got {value}")
    if value > maximum:
        raise ValidationError(field, f"must be <= {maximum:g}, got {value}")
    return float(value)


def fraction(value: float, field: str) -> float:
    return number(value, field, maximum=1.0)


def count(items: Sequence[object], field: str, limit: int = MAX_ITEMS) -> None:
    if len(items) > limit:
        raise TooLarge(f"{field}: at most {limit} entries, got {len(items)}")


def budgets_from_proto(budgets: Mapping[str, float], field: str = "budgets") -> dict[str, float]:
    out = {}
    for kind, value in budgets.items():
        if kind not in COST_KINDS:
            raise ValidationError(f"{field}.{kind[:40]}",
                                  f"unknown cost kind; known: {', '.join(COST_KINDS)}")
        out[kind] = number(value, f"{field}.{kind}", maximum=MAX_BUDGET)
        if (problem := budget_problem(out[kind])) is not None:
            raise ValidationError(f"{field}.{kind}", problem)
    return out


# -- jobs ------------------------------------------------------------------

def submit_from_proto(req: job_pb2.SubmitJobRequest) -> JobRecord:
    """A JobRecord without id, owner and state (the handler sets them)."""
    if len(req.model_json) > MAX_MODEL_CHARS:
        raise TooLarge(f"model_json: at most {MAX_MODEL_CHARS} characters")
    count(req.allowed_hosts, "allowed_hosts")
    count(req.schedules, "schedules", 3)
    if req.name and len(req.name) > 128:
        raise ValidationError("name", "at most 128 characters")
    if len(req.request_id) > 128:
        raise ValidationError("request_id", "at most 128 characters")
    if req.global_batch < 1:
        raise ValidationError("global_batch", "must be >= 1")
    if req.microbatch_size < 1:
        raise ValidationError("microbatch_size", "must be >= 1")
    return JobRecord(
        job_id="", owner="", state="", name=req.name or "job",
        global_batch=req.global_batch, microbatch_size=req.microbatch_size,
        schedules=tuple(req.schedules), budgets=budgets_from_proto(req.budgets),
        V=number(req.v, "v"),  # 0: the job gives none, the learned default (DEFAULT_V)
        slot_s=number(req.slot_s, "slot_s", maximum=86400 * 7),
        allowed_hosts=tuple(name(h, f"allowed_hosts[{i}]")
                            for i, h in enumerate(req.allowed_hosts)),
        model_json=req.model_json, profile_on_attach=req.profile_on_attach,
        request_id=req.request_id, slot_iterations=req.slot_iterations,
        entry=entry_from_proto(req.entry).to_dict() if req.HasField("entry") else {})


def entry_from_proto(req: job_pb2.JobEntry, field: str = "entry") -> Entry:
    """The job's entry point, checked field by field (:class:`hetpilot.entry.Entry`)."""
    return Entry.from_dict({
        "module": req.module, "command": list(req.command), "args": list(req.args),
        "ranks_per_host": req.ranks_per_host, "hosts": req.hosts,
        "restart_budget": req.restart_budget, "env": dict(req.env), "workdir": req.workdir},
        field)


def entry_to_proto(entry: Entry) -> job_pb2.JobEntry:
    return job_pb2.JobEntry(module=entry.module, command=list(entry.command),
                            args=list(entry.args), ranks_per_host=entry.ranks_per_host,
                            hosts=entry.hosts, restart_budget=entry.restart_budget,
                            env=dict(entry.env), workdir=entry.workdir)


def _model_name(model_json: str) -> str:
    if not model_json:
        return ""
    try:
        return safe_text(str(json.loads(model_json).get("name", "")))[:128]
    except (ValueError, AttributeError, RecursionError):
        return ""


def job_to_proto(rec: JobRecord, status: JobStatus, emulated: Iterable[str] = (),
                 progress: JobProgress | None = None,
                 launch: LaunchRecord | None = None) -> job_pb2.JobInfo:
    emu = set(emulated)
    progress = progress or JobProgress()
    info = job_pb2.JobInfo(
        job_id=rec.job_id, owner=rec.owner, name=rec.name, state=_STATES[rec.state],
        global_batch=rec.global_batch, microbatch_size=rec.microbatch_size,
        schedules=list(rec.schedules), budgets=dict(rec.budgets), v=rec.V, slot_s=rec.slot_s,
        slot_iterations=rec.slot_iterations,
        allowed_hosts=list(rec.allowed_hosts), profile_on_attach=rec.profile_on_attach,
        model_name=_model_name(rec.model_json), slot=status.slot,
        plan_version=status.plan_version, iteration_s=status.iteration_s,
        costs=dict(status.costs), average_costs=status.average_costs(),
        queues=dict(status.queues), devices=list(status.devices),
        emulated_devices=[d for d in status.devices if d in emu],
        created_unix_ms=rec.created_ms, warnings=[safe_text(w) for w in status.warnings],
        loss_step=progress.loss_step, eval_step=progress.eval_step,
        loss_unix_ms=progress.loss_unix_ms, started_unix_ms=rec.started_ms,
        ended_unix_ms=rec.ended_ms, reason=safe_text(rec.reason),
        cost_so_far=dict(status.spent))
    if progress.loss is not None:  # optional fields: unset means "no loss reported yet"
        info.loss = progress.loss
    if progress.eval_metric is not None:
        info.eval_metric = progress.eval_metric
    if rec.entry:
        info.entry.CopyFrom(entry_to_proto(Entry.from_dict(rec.entry)))
    if launch is not None:
        info.launch_id, info.rdzv_endpoint = launch.launch_id, launch.rdzv_endpoint
        info.launch.extend(job_pb2.HostLaunch(
            host=h.host, devices=[f"{h.host}:{d}" for d in h.devices],
            state=_HOST_LAUNCH_STATES[h.state], exit_code=h.exit_code, pid=h.pid,
            reason=safe_text(h.reason), stopped=h.stopped, rdzv_host=h.rdzv_host)
            for h in launch.hosts)
    return info


def plan_to_proto(plan: PlanRecord) -> common_pb2.PlanVersion:
    return common_pb2.PlanVersion(
        job_id=plan.job_id, version=plan.version, slot=plan.slot,
        plan_json=json.dumps(plan.plan), iteration_s=plan.iteration_s,
        costs=dict(plan.costs), queues=dict(plan.queues), switch_cost_s=plan.switch_cost_s,
        warnings=list(plan.warnings), created_unix_ms=plan.created_ms)


# -- agents ----------------------------------------------------------------

def agent_from_proto(req: agent_pb2.RegisterRequest) -> AgentRecord:
    host = name(req.host, "host")
    if req.probe_address:
        name(req.probe_address, "probe_address")
    count(req.devices, "devices", MAX_DEVICES)
    if not req.devices:
        raise ValidationError("devices", "must not be empty")
    devices = []
    seen = set()
    for i, d in enumerate(req.devices):
        f = f"devices[{i}]"
        index = device_index(d.index, f"{f}.index")
        if index in seen:
            raise ValidationError(f"{f}.index", f"duplicate device {index!r}")
        seen.add(index)
        kind = _KINDS.get(d.kind)
        if kind is None:
            raise ValidationError(f"{f}.kind", f"unknown device kind {d.kind}")
        if d.emulated != (kind == "emulated"):
            raise ValidationError(f"{f}.emulated", "must be set exactly for DEVICE_KIND_EMULATED")
        if len(d.name) > 128:
            raise ValidationError(f"{f}.name", "at most 128 characters")
        devices.append(DeviceInfo(
            index=index, name=d.name, kind=kind,
            tflops=number(d.tflops, f"{f}.tflops", positive=True, maximum=1e6),
            memory_gb=number(d.memory_gb, f"{f}.memory_gb", positive=True, maximum=1e6),
            price_per_hour=number(d.price_per_hour, f"{f}.price_per_hour", maximum=1e6),
            power_watts=number(d.power_watts, f"{f}.power_watts", maximum=1e7),
            emulated=d.emulated, probe_dtype=label(d.probe_dtype, f"{f}.probe_dtype"),
            probe_shape=label(d.probe_shape, f"{f}.probe_shape")))
    return AgentRecord(host=host, probe_address=req.probe_address, devices=tuple(devices),
                       launches=req.launches)


def report_from_proto(req: agent_pb2.AgentReport) -> AgentReport:
    agent_id = name(req.agent_id, "agent_id")
    count(req.devices, "devices", MAX_DEVICES)
    count(req.links, "links")
    return AgentReport(agent_id=agent_id, seq=req.seq, unix_ms=req.unix_ms,
                       devices=tuple(_device_report(d, i) for i, d in enumerate(req.devices)),
                       links=tuple(_link_report(link, i) for i, link in enumerate(req.links)))


# Note [valid reports skip the field names]: every agent sends a report a second, so
# the checks of a report's values first run without building the names of its fields
# (eight strings per device); only a value that fails them goes through the checks
# that name the field. The quick test is at least as strict as the named one.

def _device_report(d: agent_pb2.DeviceReport, i: int) -> DeviceReport:
    index, dtype, shape = d.index, d.probe_dtype, d.probe_shape
    if not (0.0 <= d.tflops <= 1e6 and 0.0 <= d.memory_total_gb <= 1e6
            and 0.0 <= d.memory_free_gb <= 1e6 and 0.0 <= d.utilization <= 1.0
            and 0.0 <= d.colocated_load <= 1.0 and index and ":" not in index
            and _NAME.fullmatch(index) and (not dtype or _LABEL.fullmatch(dtype))
            and (not shape or _LABEL.fullmatch(shape))):
        return _device_report_named(d, f"devices[{i}]")  # Note [valid reports skip ...]
    return DeviceReport(index=index, tflops=d.tflops, memory_total_gb=d.memory_total_gb,
                        memory_free_gb=d.memory_free_gb, utilization=d.utilization,
                        colocated_processes=d.colocated_processes,
                        colocated_load=d.colocated_load, emulated=d.emulated,
                        probe_dtype=dtype, probe_shape=shape)


def _device_report_named(d: agent_pb2.DeviceReport, f: str) -> DeviceReport:
    return DeviceReport(
        index=device_index(d.index, f"{f}.index"),
        tflops=number(d.tflops, f"{f}.tflops", maximum=1e6),
        memory_total_gb=number(d.memory_total_gb, f"{f}.memory_total_gb", maximum=1e6),
        memory_free_gb=number(d.memory_free_gb, f"{f}.memory_free_gb", maximum=1e6),
        utilization=fraction(d.utilization, f"{f}.utilization"),
        colocated_processes=d.colocated_processes,
        colocated_load=fraction(d.colocated_load, f"{f}.colocated_load"),
        emulated=d.emulated, probe_dtype=label(d.probe_dtype, f"{f}.probe_dtype"),
        probe_shape=label(d.probe_shape, f"{f}.probe_shape"))


def _link_report(link: agent_pb2.LinkReport, i: int) -> LinkReport:
    peer = link.peer_host
    if not (0.0 <= link.gbps <= 1e6 and 0.0 <= link.rtt_us <= 1e9 and peer
            and _NAME.fullmatch(peer)):
        f = f"links[{i}]"  # Note [valid reports skip the field names]
        return LinkReport(peer_host=name(peer, f"{f}.peer_host"),
                          gbps=number(link.gbps, f"{f}.gbps", maximum=1e6),
                          rtt_us=number(link.rtt_us, f"{f}.rtt_us", maximum=1e9))
    return LinkReport(peer_host=peer, gbps=link.gbps, rtt_us=link.rtt_us)


def launches_from_proto(req: agent_pb2.AgentReport) -> list[LaunchStatus]:
    """The launch states of a report, checked (a launch at most once)."""
    count(req.launches, "launches", MAX_LAUNCHES)
    out = []
    seen: set[str] = set()
    for i, st in enumerate(req.launches):
        f = f"launches[{i}]"
        launch_id = name(st.launch_id, f"{f}.launch_id")
        if launch_id in seen:
            raise ValidationError(f"{f}.launch_id", f"duplicate launch {launch_id!r}")
        seen.add(launch_id)
        if st.state not in (agent_pb2.LAUNCH_STATE_RUNNING, agent_pb2.LAUNCH_STATE_EXITED):
            raise ValidationError(f"{f}.state", "must be LAUNCH_STATE_RUNNING or "
                                                f"LAUNCH_STATE_EXITED, got {st.state}")
        if len(st.reason) > MAX_LAUNCH_REASON:
            raise ValidationError(f"{f}.reason", f"at most {MAX_LAUNCH_REASON} characters, "
                                                 f"got {len(st.reason)}")
        if st.log_bytes > MAX_VERSION:
            raise ValidationError(f"{f}.log_bytes", f"must be < 2^63, got {st.log_bytes}")
        if st.rdzv_port_busy and (st.rdzv_port_busy > 65535
                                  or st.state != agent_pb2.LAUNCH_STATE_EXITED):
            raise ValidationError(f"{f}.rdzv_port_busy", "must be a port (1-65535) of a "
                                  "launch not started (LAUNCH_STATE_EXITED), got "
                                  f"{st.rdzv_port_busy}")
        out.append(LaunchStatus(
            launch_id=launch_id, job_id=name(st.job_id, f"{f}.job_id"),
            running=st.state == agent_pb2.LAUNCH_STATE_RUNNING, exit_code=st.exit_code,
            reason=st.reason, pid=st.pid, stopped=st.stopped, log_bytes=st.log_bytes,
            rdzv_port_busy=st.rdzv_port_busy))
    return out


def log_chunks_from_proto(req: agent_pb2.AgentReport) -> list[LogChunk]:
    """The output chunks of a report, checked (at most MAX_LOG_BYTES in all)."""
    count(req.logs, "logs", MAX_LAUNCHES)
    total = 0
    out = []
    for i, chunk in enumerate(req.logs):
        f = f"logs[{i}]"
        total += len(chunk.data)
        if total > MAX_LOG_BYTES:
            raise TooLarge(f"logs: at most {MAX_LOG_BYTES} bytes of output per report")
        if chunk.offset > MAX_VERSION:
            raise ValidationError(f"{f}.offset", f"must be < 2^63, got {chunk.offset}")
        out.append(LogChunk(launch_id=name(chunk.launch_id, f"{f}.launch_id"),
                            offset=chunk.offset, data=chunk.data))
    return out


def resume_from_proto(req: job_pb2.StreamLogsRequest) -> dict[str, int]:
    """StreamLogsRequest.resume_from, checked: host -> offset in its output."""
    count(list(req.resume_from), "resume_from", MAX_ITEMS)
    out = {}
    for host, offset in req.resume_from.items():
        host = name(host, "resume_from (a host)")
        if offset > MAX_VERSION:
            raise ValidationError(f"resume_from.{host}", f"must be < 2^63, got {offset}")
        out[host] = offset
    return out


def order_to_proto(order: Order, trainer_token: str, unix_user: str = ""
                   ) -> agent_pb2.LaunchOrder:
    launch, part, entry = order.launch, order.part, order.entry
    return agent_pb2.LaunchOrder(unix_user=unix_user,
        launch_id=launch.launch_id, job_id=launch.job_id, nnodes=len(launch.hosts),
        devices=list(part.devices), rdzv_endpoint=launch.rdzv_endpoint,
        rdzv_host=part.rdzv_host, max_restarts=entry.restart_budget, module=entry.module,
        command=list(entry.command), args=list(entry.args), env=dict(entry.env),
        workdir=entry.workdir, trainer_token=trainer_token)


def peers_to_proto(peers: Iterable[tuple[str, str]]) -> list[agent_pb2.Peer]:
    return [agent_pb2.Peer(host=h, probe_address=a) for h, a in peers]


def device_kind_enum(kind: str) -> int:
    return _KIND_ENUM[kind]


# -- trainers --------------------------------------------------------------

def attach_from_proto(req: trainer_pb2.AttachRequest, unix_ms: int = 0
                      ) -> tuple[str, int, str, str, MeasurementRecord | None]:
    """(job id, rank, device id, model JSON, the rank's measurement or None). Layer
    indices are checked against the model by the handler (it knows the model)."""
    if len(req.model_json) > MAX_MODEL_CHARS:
        raise TooLarge(f"model_json: at most {MAX_MODEL_CHARS} characters")
    job_id, device = name(req.job_id, "job_id"), name(req.device_id, "device_id")
    return job_id, req.rank, device, req.model_json, measurement_from_proto(
        req, job_id, device, unix_ms)


def measurement_from_proto(req: trainer_pb2.AttachRequest, job_id: str, device_id: str,
                           unix_ms: int) -> MeasurementRecord | None:
    count(req.layer_times, "layer_times")
    count(req.link_times, "link_times")
    dtype = label(req.measured_dtype, "measured_dtype")
    links = []
    peers: set[str] = set()
    for i, lt in enumerate(req.link_times):
        f = f"link_times[{i}]"
        peer = name(lt.peer_device_id, f"{f}.peer_device_id")
        if peer == device_id or peer in peers:
            raise ValidationError(f"{f}.peer_device_id",
                                  f"{'duplicate peer' if peer in peers else 'own device'} "
                                  f"{peer!r}")
        peers.add(peer)
        links.append(LinkTime(peer=peer,
                              latency_s=number(lt.latency_s, f"{f}.latency_s", maximum=60.0),
                              gbps=number(lt.gbps, f"{f}.gbps", positive=True, maximum=1e6)))
    if not req.layer_times:
        return None
    if req.measured_microbatch < 1:
        raise ValidationError("measured_microbatch", "must be >= 1 when layer_times are given")
    layers = []
    seen: set[int] = set()
    for i, t in enumerate(req.layer_times):
        f = f"layer_times[{i}]"
        if t.layer in seen:
            raise ValidationError(f"{f}.layer", f"duplicate layer {t.layer}")
        seen.add(t.layer)
        layers.append(LayerTime(layer=t.layer,
                                fwd_s=number(t.fwd_s, f"{f}.fwd_s", maximum=MAX_LAYER_S),
                                bwd_s=number(t.bwd_s, f"{f}.bwd_s", maximum=MAX_LAYER_S)))
    return MeasurementRecord(job_id=job_id, device_id=device_id, rank=req.rank,
                             microbatch=req.measured_microbatch, dtype=dtype,
                             layers=tuple(layers), unix_ms=unix_ms, links=tuple(links))


def attach_response(plan: PlanRecord | None, job: JobRecord) -> trainer_pb2.AttachResponse:
    return trainer_pb2.AttachResponse(
        plan=plan_to_proto(plan) if plan else common_pb2.PlanVersion(),
        slot_iterations=job.slot_iterations, slot_s=job.slot_s)


def metric(req: trainer_pb2.StageTimingsReport,
           field: Literal["loss", "eval_metric"]) -> float | None:
    """An optional training metric (``loss``, ``eval_metric``) of a report; None when unset.

    Any double is accepted, NaN and infinity included: a diverged run reports NaN,
    and the job owner must see that (``hetpilot job`` shows "nan") rather than the
    report being refused, which would also drop its stage timings and leave the
    last finite loss on show as if all were well. Losses may be negative
    (log-likelihoods), so there is no range either.
    """
    return float(getattr(req, field)) if req.HasField(field) else None


def timings_from_proto(req: trainer_pb2.StageTimingsReport, unix_ms: int) -> TimingsRecord:
    count(req.stages, "stages")
    stages = []
    for i, s in enumerate(req.stages):
        f = f"stages[{i}]"
        stages.append(StageTiming(
            stage_index=s.stage_index, device_id=name(s.device_id, f"{f}.device_id"),
            fwd_s=number(s.fwd_s, f"{f}.fwd_s"), bwd_s=number(s.bwd_s, f"{f}.bwd_s"),
            comm_s=number(s.comm_s, f"{f}.comm_s"),
            samples_per_s=number(s.samples_per_s, f"{f}.samples_per_s")))
    return TimingsRecord(job_id=name(req.job_id, "job_id"), rank=req.rank,
                         plan_version=version(req.plan_version, "plan_version"),
                         iteration=version(req.iteration, "iteration"),
                         stages=tuple(stages), unix_ms=unix_ms, loss=metric(req, "loss"),
                         eval_metric=metric(req, "eval_metric"))


def finish_from_proto(req: trainer_pb2.FinishJobRequest) -> tuple[str, str, str]:
    """(job id, "succeeded" or "failed", reason)."""
    job_id = name(req.job_id, "job_id")
    outcome = _OUTCOMES.get(req.outcome)
    if outcome is None:
        raise ValidationError("outcome", "must be JOB_OUTCOME_SUCCEEDED or JOB_OUTCOME_FAILED, "
                                         f"got {req.outcome}")
    if len(req.reason) > MAX_FINISH_REASON:
        raise ValidationError("reason", f"at most {MAX_FINISH_REASON} characters, got "
                                        f"{len(req.reason)}")
    return job_id, outcome, req.reason


def outcome_to_proto(state: str) -> trainer_pb2.JobOutcome.ValueType:
    """The JobOutcome of a finished job's state."""
    return _OUTCOME_ENUM[state]


# -- cluster ---------------------------------------------------------------

def drain_from_proto(req: cluster_pb2.DrainHostRequest) -> tuple[str, str]:
    """(host, reason)."""
    if len(req.reason) > MAX_DRAIN_REASON:
        raise ValidationError("reason", f"at most {MAX_DRAIN_REASON} characters, got "
                                        f"{len(req.reason)}")
    return name(req.host, "host"), req.reason


def node_to_proto(node: NodeView) -> cluster_pb2.NodeInfo:
    devices = []
    for d in node.devices:
        r = d.report
        info = d.info
        devices.append(cluster_pb2.DeviceStatus(
            device_id=d.device_id, name=safe_text(info.name), kind=_KIND_ENUM[info.kind],
            emulated=info.emulated,
            tflops=r.tflops if r is not None and r.tflops > 0 else info.tflops,
            probe_dtype=(r.probe_dtype if r is not None else "") or info.probe_dtype,
            probe_shape=(r.probe_shape if r is not None else "") or info.probe_shape,
            planned_tflops=d.planned_tflops,
            memory_free_gb=r.memory_free_gb if r is not None else 0.0,
            memory_total_gb=(r.memory_total_gb if r is not None and r.memory_total_gb
                             else info.memory_gb),
            utilization=r.utilization if r is not None else 0.0,
            colocated_load=r.colocated_load if r is not None else 0.0,
            colocated_processes=r.colocated_processes if r is not None else 0,
            price_per_hour=info.price_per_hour, power_watts=info.power_watts,
            job_speeds=[cluster_pb2.JobSpeed(job_id=j.job_id, tflops=j.tflops, dtype=j.dtype,
                                             microbatch=j.microbatch,
                                             measured_unix_ms=j.unix_ms)
                        for j in d.job_speeds]))
    return cluster_pb2.NodeInfo(
        host=node.agent.host, state=_NODE_STATES[node.state], state_since_unix_ms=node.since_ms,
        alive=node.alive, last_seen_age_s=node.last_seen_age_s,
        registered_unix_ms=node.agent.registered_ms, probe_address=node.agent.probe_address,
        drain_reason=safe_text(node.drain.reason) if node.drain is not None else "",
        devices=devices, jobs=list(node.jobs))


def nodes_to_proto(nodes: Sequence[NodeView], links: Iterable[tuple[str, LinkReport]],
                   unix_ms: int) -> cluster_pb2.ListNodesResponse:
    return cluster_pb2.ListNodesResponse(
        nodes=[node_to_proto(n) for n in nodes], unix_ms=unix_ms,
        links=[cluster_pb2.LinkStatus(from_host=host, to_host=link.peer_host, gbps=link.gbps,
                                      rtt_us=link.rtt_us) for host, link in links])
