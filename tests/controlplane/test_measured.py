"""Planning with speeds measured on the job itself, and slots counted in iterations
(issue 14), against a real in-process daemon (gRPC on an OS-picked port, SQLite).

Devices are registered over AgentService with a long heartbeat timeout, so they stay
up without heartbeats (no agent processes on the 2 shared cores)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from hetpilot.client.cli import InputError, job_request_from_toml
from hetpilot.daemon.sqlite_store import SqliteStore
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.serde import model_from_dict, plan_from_dict
from hetpilot.planner.types import Cluster, Device, Layer, Model, Network
from hetpilot.trainer.daemon_link import DaemonLink, GrpcPlanSource
from hetpilot.v1 import (
    agent_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

from hetpilot.channel import Endpoint, metadata

from .conftest import CLUSTER_MD, OWNER_MD, RunningDaemon, start_daemon
from .helpers import model_json, register_request, report, submit_request

pytestmark = pytest.mark.timeout(90)
T = 5.0
HOST = "m"
A, B = f"{HOST}:0", f"{HOST}:1"
PROBE_TFLOPS = 50.0  # what the agent's probe says of both devices
TRUE_TFLOPS = {A: 20.0, B: 5.0}  # what the job's layers really run at: A 4x B
MEASURED_MICROBATCH = 2  # the job plans microbatches of 4: times scale linearly
REL = 1e-4
"""The embedding's forward takes 0.13 us on A, under the fit's 1 us floor: its work is
taken as the floor's, which moves the predicted iteration by about 1e-5."""


def _true_model() -> Model:
    """The example model as its layers really cost: per-layer forward GFLOP off the
    profile by 0.5x / 1.5x (same total), backward 1.6x / 2.4x the forward."""
    profiled = model_from_dict(json.loads(model_json()))
    fwd = [x.fwd_gflop * (0.5 if i % 2 else 1.5) for i, x in enumerate(profiled.layers)]
    fwd = [f * sum(x.fwd_gflop for x in profiled.layers) / sum(fwd) for f in fwd]
    layers = tuple(Layer(name=x.name, fwd_gflop=f, bwd_gflop=f * (1.6 if i % 2 else 2.4),
                         out_mb=x.out_mb, act_mb=x.act_mb, param_mb=x.param_mb)
                   for i, (x, f) in enumerate(zip(profiled.layers, fwd, strict=True)))
    return Model(name=profiled.name, layers=layers, optimizer_factor=profiled.optimizer_factor)


def _layer_times(device: str, model: Model | None = None) -> list[tuple[float, float]]:
    """Seconds per layer of a microbatch of MEASURED_MICROBATCH samples on ``device``."""
    s = 1000.0 * TRUE_TFLOPS[device]
    return [(MEASURED_MICROBATCH * x.fwd_gflop / s, MEASURED_MICROBATCH * x.bwd_gflop / s)
            for x in (model or _true_model()).layers]


def _attach(job_id: str, rank: int, device: str, *, model: str = "",
            times: list[tuple[float, float]] | None = None, microbatch: int = MEASURED_MICROBATCH,
            dtype: str = "bfloat16") -> trainer_pb2.AttachRequest:
    req = trainer_pb2.AttachRequest(job_id=job_id, rank=rank, world_size=2, device_id=device,
                                    model_json=model)
    if times is not None:
        req.measured_microbatch, req.measured_dtype = microbatch, dtype
        req.layer_times.extend(trainer_pb2.LayerTiming(layer=i, fwd_s=f, bwd_s=b)
                               for i, (f, b) in enumerate(times))
    return req


def _trainer_md(ch: grpc.Channel, job_id: str) -> tuple[tuple[str, str], ...]:
    info = job_pb2_grpc.JobServiceStub(ch).GetJob(job_pb2.GetJobRequest(job_id=job_id),
                                                  metadata=OWNER_MD, timeout=T)
    return metadata(info.trainer_token)


def _setup(d: RunningDaemon, **submit: object) -> tuple[grpc.Channel, str]:
    """Two devices the probe calls equal on host HOST, and a profile-on-attach job."""
    ch = d.channel()
    agent_pb2_grpc.AgentServiceStub(ch).Register(
        register_request(HOST, n=2, tflops=PROBE_TFLOPS), metadata=CLUSTER_MD, timeout=T)
    args: dict[str, object] = {"model_json": "", "profile_on_attach": True}
    args.update(submit)
    job_id = job_pb2_grpc.JobServiceStub(ch).SubmitJob(
        submit_request(**args), metadata=OWNER_MD, timeout=T).job_id
    return ch, str(job_id)


def _get(ch: grpc.Channel, job_id: str) -> job_pb2.JobInfo:
    return job_pb2_grpc.JobServiceStub(ch).GetJob(job_pb2.GetJobRequest(job_id=job_id),
                                                  metadata=OWNER_MD, timeout=T)


def _wait(ch: grpc.Channel, job_id: str, what: str, pred: object,
          timeout: float = 30.0) -> job_pb2.JobInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = _get(ch, job_id)
        if pred(info):  # type: ignore[operator]
            return info
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {info}"
        time.sleep(0.05)


@pytest.fixture
def lasting(tmp_path: Path) -> Iterator[RunningDaemon]:
    """A daemon whose agents stay up without heartbeats."""
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0)
    try:
        yield d
    finally:
        d.stop()


def _expected_iteration_s(d: RunningDaemon, plan_dict: dict[str, object]) -> float:
    """The reference model's time of ``plan`` on the devices and layers as they really are."""
    cfg = d.config
    cluster = Cluster(devices=tuple(
        Device(id=dev, host=HOST, tflops=TRUE_TFLOPS[dev], memory_gb=80.0, price_per_hour=1.0,
               power_watts=300.0) for dev in (A, B)), network=Network(
        intra_host_gbps=cfg.intra_host_gbps, inter_host_gbps=cfg.inter_host_gbps,
        latency_us=cfg.latency_us))
    ev = evaluate(cluster, _true_model(), plan_from_dict(plan_dict), 64)
    assert ev.valid, ev.error
    assert ev.iteration_s is not None
    return ev.iteration_s


def _work(plan_dict: dict[str, object]) -> dict[str, float]:
    """GFLOP each device runs per iteration under the plan (samples x its layers' work)."""
    plan, model = plan_from_dict(plan_dict), _true_model()
    work = {A: 0.0, B: 0.0}
    for g in plan.groups:
        for st in g.stages:
            a, b = st.layers
            work[st.device] += g.samples * sum(x.fwd_gflop + x.bwd_gflop
                                               for x in model.layers[a:b])
    return work


def test_measured_speeds_steer_the_plan_and_survive_a_restart(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0)
    try:
        ch, job_id = _setup(d)
        trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
        md = _trainer_md(ch, job_id)
        # each rank sends its device's times; A is 4x B on every layer, though the probe
        # says both run 50 TFLOP/s. Rank 1 first: rank 0's profile starts the planning.
        trainer.Attach(_attach(job_id, 1, B, times=_layer_times(B)), metadata=md, timeout=T)
        resp = trainer.Attach(_attach(job_id, 0, A, model=model_json(), times=_layer_times(A)),
                              metadata=md, timeout=T)
        assert resp.slot_s == pytest.approx(0.3) and resp.slot_iterations == 0
        info = _wait(ch, job_id, "a plan made with both devices' times", lambda i: (
            i.plan_version >= 1 and i.iteration_s == pytest.approx(
                _expected_iteration_s(d, json.loads(_plan(ch, job_id))), rel=REL)))
        plan = json.loads(_plan(ch, job_id))
        work = _work(plan)
        assert work[A] > 2 * work[B], work  # A, 4x faster, does most of the work
        # an unmeasured plan on the probe's speeds would predict a far shorter iteration
        assert info.iteration_s > 2 * _probe_iteration_s(d, plan)
    finally:
        d.stop()
    store = SqliteStore(tmp_path / "state" / "state.db")
    try:
        kept = {m.device_id: m for m in store.measurements(job_id)}
    finally:
        store.close()
    assert set(kept) == {A, B}
    assert kept[A].microbatch == MEASURED_MICROBATCH and kept[A].dtype == "bfloat16"
    assert kept[A].ref_tflops == PROBE_TFLOPS
    assert [(t.fwd_s, t.bwd_s) for t in kept[B].layers] == _layer_times(B)
    # restarted, the daemon plans with the stored times at once (no trainer attached)
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0)
    try:
        ch = d.channel()
        agent_pb2_grpc.AgentServiceStub(ch).Register(  # its agent is back
            register_request(HOST, n=2, tflops=PROBE_TFLOPS), metadata=CLUSTER_MD, timeout=T)
        slot = _get(ch, job_id).slot
        info = _wait(ch, job_id, "a slot after the restart", lambda i: i.slot > slot)
        assert info.iteration_s == pytest.approx(
            _expected_iteration_s(d, json.loads(_plan(ch, job_id))), rel=REL)
    finally:
        d.stop()


def _plan(ch: grpc.Channel, job_id: str) -> str:
    """The job's latest plan JSON."""
    stream = job_pb2_grpc.JobServiceStub(ch).WatchPlans(
        job_pb2.WatchPlansRequest(job_id=job_id), metadata=OWNER_MD, timeout=T)
    latest = _get(ch, job_id).plan_version
    for pv in stream:
        if pv.version == latest:
            stream.cancel()
            return str(pv.plan_json)
    raise AssertionError("plan not found")


def _probe_iteration_s(d: RunningDaemon, plan_dict: dict[str, object]) -> float:
    cfg = d.config
    cluster = Cluster(devices=tuple(
        Device(id=dev, host=HOST, tflops=PROBE_TFLOPS, memory_gb=80.0) for dev in (A, B)),
        network=Network(intra_host_gbps=cfg.intra_host_gbps,
                        inter_host_gbps=cfg.inter_host_gbps, latency_us=cfg.latency_us))
    ev = evaluate(cluster, model_from_dict(json.loads(model_json())),
                  plan_from_dict(plan_dict), 64)
    assert ev.iteration_s is not None
    return ev.iteration_s


def test_bad_measurements_are_refused_by_field_and_change_nothing(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0)
    try:
        ch, job_id = _setup(d)
        trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
        md = _trainer_md(ch, job_id)
        good = _layer_times(A)
        n = len(good)
        # before the model is known a layer beyond it is refused with the profile it came with
        with pytest.raises(grpc.RpcError) as err:
            trainer.Attach(_attach(job_id, 0, A, model=model_json(),
                                   times=[*good, (0.1, 0.1)]), metadata=md, timeout=T)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"layer_times[{n}].layer" in err.value.details()
        info = _get(ch, job_id)  # the profile of the refused attach was not kept either
        assert info.state == job_pb2.JOB_STATE_PENDING and not info.model_name
        trainer.Attach(_attach(job_id, 0, A, model=model_json(), times=good), metadata=md,
                       timeout=T)

        def bad(**change: object) -> trainer_pb2.AttachRequest:
            req = _attach(job_id, 1, B, times=_layer_times(B))
            for key, value in change.items():
                if key.startswith("t0_"):
                    setattr(req.layer_times[0], key[3:], value)
                elif key == "dup":
                    req.layer_times[1].layer = 0
                else:
                    setattr(req, key, value)
            return req

        cases = [
            (bad(t0_fwd_s=float("nan")), "layer_times[0].fwd_s"),
            (bad(t0_bwd_s=-1.0), "layer_times[0].bwd_s"),
            (bad(t0_fwd_s=float("inf")), "layer_times[0].fwd_s"),
            (bad(t0_bwd_s=1e9), "layer_times[0].bwd_s"),
            (bad(t0_layer=n), "layer_times[0].layer"),
            (bad(dup=True), "layer_times[1].layer"),
            (bad(measured_microbatch=0), "measured_microbatch"),
            (bad(measured_dtype="b float"), "measured_dtype"),
        ]
        for req, field in cases:
            with pytest.raises(grpc.RpcError) as err:
                trainer.Attach(req, metadata=md, timeout=T)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert err.value.details().startswith(field), (field, err.value.details())
        def bad_link(peer: str = A, latency_s: float = 1e-3, gbps: float = 10.0,
                     twice: bool = False) -> trainer_pb2.AttachRequest:
            req = _attach(job_id, 1, B, times=_layer_times(B))
            for _ in range(2 if twice else 1):
                req.link_times.add(peer_device_id=peer, latency_s=latency_s, gbps=gbps)
            return req

        cases += [
            (bad_link(peer=B), "link_times[0].peer_device_id"),  # its own device
            (bad_link(peer="a b"), "link_times[0].peer_device_id"),
            (bad_link(twice=True), "link_times[1].peer_device_id"),
            (bad_link(latency_s=float("nan")), "link_times[0].latency_s"),
            (bad_link(latency_s=-1e-3), "link_times[0].latency_s"),
            (bad_link(gbps=0.0), "link_times[0].gbps"),
            (bad_link(gbps=float("inf")), "link_times[0].gbps"),
        ]
        for req, field in cases[-7:]:
            with pytest.raises(grpc.RpcError) as err:
                trainer.Attach(req, metadata=md, timeout=T)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert err.value.details().startswith(field), (field, err.value.details())
        too_many = _attach(job_id, 1, B, times=[(0.1, 0.1)] * 1025)
        with pytest.raises(grpc.RpcError) as err:
            trainer.Attach(too_many, metadata=md, timeout=T)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "layer_times" in err.value.details()
        # a refused re-measurement of A leaves A's stored one
        with pytest.raises(grpc.RpcError):
            trainer.Attach(_attach(job_id, 0, A, times=[(float("nan"), 0.0)]), metadata=md,
                           timeout=T)
        # an attach without times keeps what the device measured before
        trainer.Attach(_attach(job_id, 0, A), metadata=md, timeout=T)
    finally:
        d.stop()
    store = SqliteStore(tmp_path / "state" / "state.db")
    try:
        kept = store.measurements(job_id)
        assert [m.device_id for m in kept] == [A]
        assert [(t.fwd_s, t.bwd_s) for t in kept[0].layers] == good
        assert store.get_job(job_id).model_json == model_json()  # type: ignore[union-attr]
    finally:
        store.close()


def test_slots_in_iterations(lasting: RunningDaemon) -> None:
    ch, job_id = _setup(lasting, model_json=model_json(), profile_on_attach=False,
                        slot_iterations=5, slot_s=60.0)
    trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
    md = _trainer_md(ch, job_id)
    info = _wait(ch, job_id, "the first slot", lambda i: i.slot >= 1)
    assert (info.slot_iterations, info.slot_s) == (5, 60.0)
    resp = trainer.Attach(_attach(job_id, 0, A), metadata=md, timeout=T)
    assert (resp.slot_iterations, resp.slot_s) == (5, 60.0) and resp.plan.version >= 1

    def step(iteration: int) -> None:
        trainer.ReportStageTimings(trainer_pb2.StageTimingsReport(
            job_id=job_id, rank=0, plan_version=1, iteration=iteration, stages=[
                trainer_pb2.StageTiming(stage_index=0, device_id=A, fwd_s=0.1, bwd_s=0.2)]),
            metadata=md, timeout=T)

    def stays(slot: int, seconds: float = 1.5) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert _get(ch, job_id).slot == slot
            time.sleep(0.1)

    slot = _get(ch, job_id).slot
    for it in (2, 4):  # fewer than 5 iterations: no slot, however long it takes
        step(it)
    stays(slot)
    step(5)
    slot = _wait(ch, job_id, "the slot after 5 iterations", lambda i: i.slot == slot + 1).slot
    step(9)
    stays(slot, 1.0)
    step(10)
    slot = _wait(ch, job_id, "the slot after 10 iterations", lambda i: i.slot == slot + 1).slot
    step(3)  # the trainer started over: 5 iterations from here
    step(7)
    stays(slot, 1.0)
    step(8)
    _wait(ch, job_id, "the slot 5 iterations after the restart", lambda i: i.slot == slot + 1)

    # without reports such a job falls back to its slot_s
    _, quiet = _setup(lasting, model_json=model_json(), profile_on_attach=False,
                      slot_iterations=1000, slot_s=0.2)
    _wait(ch, quiet, "slots on time without reports", lambda i: i.slot >= 3)


def test_job_file_slot_iterations(tmp_path: Path) -> None:
    (tmp_path / "model.json").write_text(model_json())
    job = tmp_path / "job.toml"
    base = 'model = "model.json"\nglobal_batch = 64\nmicrobatch_size = 4\n'
    job.write_text(base + "slot_iterations = 50\n")
    assert job_request_from_toml(job).slot_iterations == 50
    job.write_text(base)
    assert job_request_from_toml(job).slot_iterations == 0
    for value in ("-1", "2.5", "true", '"10"', str(2**32)):
        job.write_text(base + f"slot_iterations = {value}\n")
        with pytest.raises(InputError, match=r"job\.toml\.slot_iterations: must be an integer"):
            job_request_from_toml(job)


def test_probe_dtype_and_shape_reach_the_daemon(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from hetpilot.agents import probes
    from hetpilot.agents.agent import Agent
    from hetpilot.agents.config import AgentConfig

    # the CPU probe says what it ran; so do the agent's requests
    monkeypatch.setattr(probes, "_cuda_devices", lambda config: [])  # a CPU host
    [cpu] = probes.discover(AgentConfig(host="probehost"))
    assert (cpu.probe_dtype, cpu.probe_shape) == ("float32", "384x384x384")
    agent = Agent(AgentConfig(host="probehost"))
    agent.devices = [cpu]
    reg, rep = agent.register_request(), agent.report()
    assert (reg.devices[0].probe_dtype, rep.devices[0].probe_shape) == ("float32", "384x384x384")

    d = start_daemon(tmp_path / "state")
    try:
        agents = agent_pb2_grpc.AgentServiceStub(d.channel())
        reg = register_request("p", n=1)
        reg.devices[0].probe_dtype, reg.devices[0].probe_shape = "bfloat16", "4096x4096x4096"
        rep = report("p", 1, registration=agents.Register(
            reg, metadata=CLUSTER_MD, timeout=T).registration)
        rep.devices[0].probe_dtype, rep.devices[0].probe_shape = "float16", "1024x1024x1024"
        list(agents.Report(iter([rep]), metadata=CLUSTER_MD, timeout=T))
        bad = register_request("q", n=1)
        bad.devices[0].probe_shape = "4096 x 4096"
        with pytest.raises(grpc.RpcError) as err:
            agents.Register(bad, metadata=CLUSTER_MD, timeout=T)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("devices[0].probe_shape")
    finally:
        d.stop()
    store = SqliteStore(tmp_path / "state" / "state.db")
    try:
        [info] = [a.devices[0] for a in store.agents() if a.host == "p"]
        assert (info.probe_dtype, info.probe_shape) == ("bfloat16", "4096x4096x4096")
        dev = store.latest_reports()["p"].devices[0]
        assert (dev.probe_dtype, dev.probe_shape) == ("float16", "1024x1024x1024")
    finally:
        store.close()


def test_plan_source_sends_measurements_and_keeps_slot_settings(lasting: RunningDaemon) -> None:
    ch, job_id = _setup(lasting, slot_iterations=7)
    token = _get(ch, job_id).trainer_token
    link = DaemonLink(Endpoint(address=lasting.address, token=token), job_id)
    float32 = {"microbatch": 4, "dtype": "float32",
               "layers": {i: (2 * f, 2 * b) for i, (f, b) in enumerate(_layer_times(A))}}
    source = GrpcPlanSource(link, [A, B], model_json=model_json(), measurements=[float32, None])
    try:
        source.start(10)
        assert (source.slot_iterations, source.slot_s) == (7, 0.3)
        first = source.wait_first(30)
        assert first.version >= 1
        # measure again (a new microbatch size, bfloat16): every rank re-attaches with it
        bf16 = [{"microbatch": MEASURED_MICROBATCH, "dtype": "bfloat16",
                 "layers": dict(enumerate(_layer_times(dev)))} for dev in (A, B)]
        assert source.update_measurements(bf16)
        # a refused measurement is dropped, not kept to block later re-attaches
        assert not source.update_measurements([{"microbatch": 1, "dtype": "float32",
                                                "layers": {999: (1.0, 1.0)}}, None])
        assert source.update_measurements([None, None])  # re-attach: the bf16 ones again
    finally:
        source.close()
        link.close()
    info = _wait(ch, job_id, "a plan on the bfloat16 times", lambda i: i.iteration_s ==
                 pytest.approx(_expected_iteration_s(lasting, json.loads(_plan(ch, job_id))),
                               rel=REL))
    assert info.plan_version >= 1


def test_unmeasured_devices_take_the_measured_ratio_and_changes_scale() -> None:
    """A mixed cluster: measured devices plan at their fitted speed times what the agents
    report since; the others at their probe times the median measured / probe ratio."""
    from hetpilot.daemon.measured_fit import fit_job
    from hetpilot.daemon.records import LayerTime, MeasurementRecord

    model = _true_model()

    def record(device: str, ref: float, unix_ms: int = 1, dtype: str = "bfloat16",
               scale: float = 1.0) -> MeasurementRecord:
        return MeasurementRecord(
            job_id="j", device_id=device, rank=0, microbatch=MEASURED_MICROBATCH, dtype=dtype,
            layers=tuple(LayerTime(layer=i, fwd_s=scale * f, bwd_s=scale * b)
                         for i, (f, b) in enumerate(_layer_times(device, model))),
            ref_tflops=ref, unix_ms=unix_ms)

    fitted = fit_job(model, [record(A, 50.0), record(B, 40.0)])
    assert fitted is not None and fitted.ratios == pytest.approx({A: 0.4, B: 0.125}, rel=REL)
    cluster = Cluster(devices=(
        Device(id=A, host=HOST, tflops=25.0, memory_gb=80.0),  # the agent: half the speed
        Device(id=B, host=HOST, tflops=40.0, memory_gb=80.0),  # as when it measured
        Device(id="m:2", host=HOST, tflops=100.0, memory_gb=80.0)),  # never measured
        network=Network(intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=5.0))
    speeds = {d.id: d.tflops for d in fitted.apply(cluster).devices}
    median = (0.4 + 0.125) / 2
    assert speeds == pytest.approx({A: 10.0, B: 5.0, "m:2": 100.0 * median}, rel=REL)
    assert [x.fwd_gflop for x in fitted.model.layers[1:]] == pytest.approx(
        [x.fwd_gflop for x in model.layers[1:]], rel=REL)  # 0: the embedding, at the floor
    # the newest measurement's dtype wins: B's float32 times (2x slower) are left out
    fitted = fit_job(model, [record(A, 50.0, unix_ms=5), record(B, 40.0, unix_ms=1,
                                                                 dtype="float32", scale=2.0)])
    assert fitted is not None and fitted.dtype == "bfloat16" and set(fitted.fit.tflops) == {A}
    # no reference speed (the device was unknown when it measured): the fitted speed as is
    fitted = fit_job(model, [record(A, 0.0)])
    assert fitted is not None and not fitted.ratios
    speeds = {d.id: d.tflops for d in fitted.apply(cluster).devices}
    assert speeds == pytest.approx({A: 20.0, B: 40.0 * 20.0 / 25.0, "m:2": 100.0 * 0.8},
                                   rel=REL)


def test_links_measured_by_the_job_are_kept_with_the_daemons_figures_then(
        tmp_path: Path) -> None:
    """A rank's link_times are stored with the pair's latency and bandwidth in the daemon's
    cluster at the time; a later attach without links keeps them."""
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0)
    try:
        ch, job_id = _setup(d)
        trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
        md = _trainer_md(ch, job_id)
        req = _attach(job_id, 0, A, model=model_json(), times=_layer_times(A))
        req.link_times.add(peer_device_id=B, latency_s=2e-3, gbps=8.0)
        trainer.Attach(req, metadata=md, timeout=T)
        trainer.Attach(_attach(job_id, 0, A, times=_layer_times(A)), metadata=md, timeout=T)
    finally:
        d.stop()
    store = SqliteStore(tmp_path / "state" / "state.db")
    try:
        (kept,) = store.measurements(job_id)
    finally:
        store.close()
    (link,) = kept.links
    assert (link.peer, link.latency_s, link.gbps) == (B, 2e-3, 8.0)
    # both devices on one host: the daemon's intra-host figures (its config's defaults)
    assert link.ref_gbps == d.config.intra_host_gbps
    assert link.ref_latency_s == pytest.approx(d.config.latency_us / 1e6)


def test_measured_links_override_the_pair_and_follow_the_agents_changes() -> None:
    """Spec 1's device_links carry the job's figures for the measured pair only: the
    bandwidth scaled by what the agents report now over then, the latency shifted."""
    from hetpilot.daemon.measured_fit import fit_job
    from hetpilot.daemon.records import LayerTime, LinkTime, MeasurementRecord

    model = _true_model()
    layers = tuple(LayerTime(layer=i, fwd_s=f, bwd_s=b)
                   for i, (f, b) in enumerate(_layer_times(A, model)))
    old = LinkTime(peer=A, latency_s=9e-3, gbps=1.0, ref_latency_s=5e-6, ref_gbps=100.0)
    new = LinkTime(peer=B, latency_s=2e-3, gbps=4.0, ref_latency_s=5e-6, ref_gbps=100.0)
    records = [MeasurementRecord(job_id="j", device_id=B, rank=1, microbatch=2,
                                 dtype="float32", layers=layers, unix_ms=1, links=(old,)),
               MeasurementRecord(job_id="j", device_id=A, rank=0, microbatch=2,
                                 dtype="float32", layers=layers, unix_ms=2,
                                 links=(new,))]
    fitted = fit_job(model, records)
    assert fitted is not None
    net = Network(intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=5.0)
    devices = (Device(id=A, host=HOST, tflops=25.0, memory_gb=80.0),
               Device(id=B, host=HOST, tflops=40.0, memory_gb=80.0),
               Device(id="m:2", host=HOST, tflops=100.0, memory_gb=80.0))
    applied = fitted.apply(Cluster(devices=devices, network=net))
    # the newer measurement of the pair (A's) wins; unmeasured pairs keep the network's
    assert applied.link(A, B) == pytest.approx((4.0, 2e-3))
    assert applied.link(B, A) == pytest.approx((4.0, 2e-3))
    assert applied.link(A, "m:2") == pytest.approx((100.0, 5e-6))
    # the agents' figures for the pair halve the bandwidth and add 1 ms: so does the job's
    slower = replace(net, intra_host_gbps=50.0, latency_us=1005.0)
    applied = fitted.apply(Cluster(devices=devices, network=slower))
    assert applied.link(A, B) == pytest.approx((2.0, 3e-3))
    # a pair with a device outside the cluster is left out
    applied = fitted.apply(Cluster(devices=devices[::2], network=net))
    assert applied.network.device_links == ()
