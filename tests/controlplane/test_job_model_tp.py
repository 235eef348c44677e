"""The daemon plans tensor-parallel stages for a job exactly while its trainer says on
Attach that it runs them (issues 38 (d) and 40; daemon/job_model.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from hetpilot.daemon.job_model import make_controller, to_job
from hetpilot.daemon.records import JobRecord
from hetpilot.planner import serde
from hetpilot.planner.controller import Controller
from hetpilot.planner.types import Cluster, Device, Job, Layer, Model, Network
from hetpilot.trainer.daemon_link import DaemonLink, GrpcPlanSource
from hetpilot.v1 import agent_pb2_grpc, job_pb2, job_pb2_grpc, trainer_pb2, trainer_pb2_grpc

from hetpilot.channel import Endpoint, metadata

from .conftest import CLUSTER_MD, OWNER_MD, start_daemon
from .helpers import register_request, submit_request, wait_until

# one host of four devices on fast links and one sample per iteration: a v1 plan runs
# the layers one device after another, a 4-way split runs them on all four at once, so
# the planner prefers tensor parallelism wherever a job allows it
CLUSTER = Cluster(
    devices=tuple(Device(id=f"h:{i}", host="h", tflops=10.0, memory_gb=16.0) for i in range(4)),
    network=Network(intra_host_gbps=2400.0, inter_host_gbps=10.0, latency_us=0.0))
MODEL = Model(name="blocks", layers=tuple(
    Layer(name=f"b{i}", fwd_gflop=10.0, bwd_gflop=20.0, out_mb=1.0, act_mb=10.0, param_mb=10.0,
          tp_comm_mb=0.5, tp_allreduces=2) for i in range(4)))


def _record() -> JobRecord:
    return JobRecord(job_id="j", owner="o", name="j", state="running", global_batch=1,
                     microbatch_size=1, schedules=(), budgets={}, V=10.0, slot_s=1.0,
                     model_json=json.dumps(serde.model_to_dict(MODEL)))


def test_a_daemon_job_is_planned_without_tp_stages() -> None:
    allowed = Controller(MODEL, Job(global_batch=1, microbatch_size=1, tensor_parallel=True,
                                    V=10.0)).step(CLUSTER)
    assert allowed.plan is not None and allowed.plan.tensor_parallel  # TP would win here
    rec = _record()
    assert to_job(rec).tensor_parallel is False
    decision = make_controller(rec, None).step(CLUSTER)
    assert decision.plan is not None and not decision.plan.tensor_parallel


def test_a_stored_tp_plan_is_not_restored_for_a_job_that_cannot_run_it() -> None:
    ctl = Controller(MODEL, Job(global_batch=1, microbatch_size=1, tensor_parallel=True, V=10.0))
    assert ctl.step(CLUSTER).plan.tensor_parallel  # type: ignore[union-attr]
    state = ctl.to_state()
    restored = make_controller(_record(), state)
    assert restored.plan is None or not restored.plan.tensor_parallel
    decision = restored.step(CLUSTER)
    assert decision.plan is not None and not decision.plan.tensor_parallel
    # a state without TP stages keeps its plan
    plain = Controller(MODEL, to_job(_record()))
    kept = plain.step(CLUSTER).plan
    assert make_controller(_record(), plain.to_state()).plan == kept


def test_a_job_whose_trainer_runs_tp_may_get_a_tp_plan() -> None:
    rec = replace(_record(), tensor_parallel=True)
    assert to_job(rec).tensor_parallel is True
    decision = make_controller(rec, None).step(CLUSTER)
    assert decision.plan is not None and decision.plan.tensor_parallel
    # its stored TP plan is restored with it
    ctl = make_controller(rec, None)
    kept = ctl.step(CLUSTER).plan
    assert make_controller(rec, ctl.to_state()).plan == kept


def _plan_json(ch: object, job_id: str) -> dict[str, object]:
    jobs = job_pb2_grpc.JobServiceStub(ch)
    latest = jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD,
                         timeout=5.0).plan_version
    if latest == 0:
        return {}
    stream = jobs.WatchPlans(job_pb2.WatchPlansRequest(job_id=job_id), metadata=OWNER_MD,
                             timeout=5.0)
    for pv in stream:
        if pv.version == latest:
            stream.cancel()
            return dict(json.loads(pv.plan_json))
    raise AssertionError("plan not found")


def _has_tp_stage(plan: dict[str, object]) -> bool:
    return any("devices" in st for g in plan["groups"] for st in g["stages"])  # type: ignore[attr-defined]


def _wait_plan(ch: object, job_id: str, tp: bool, what: str) -> None:
    wait_until(what, lambda: (plan := _plan_json(ch, job_id)).get("groups")
               and _has_tp_stage(plan) == tp, timeout=90)


def test_the_attach_says_whether_the_trainer_runs_tp(tmp_path: Path) -> None:
    """Over gRPC: a job is planned without TP stages until its trainer attaches saying it
    runs them, then (TP wins on one host with one sample per iteration) with them, and
    without again once a trainer attaches without saying so."""
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0)
    try:
        ch = d.channel()
        agent_pb2_grpc.AgentServiceStub(ch).Register(
            register_request("h", n=4, tflops=10.0), metadata=CLUSTER_MD, timeout=5.0)
        jobs = job_pb2_grpc.JobServiceStub(ch)
        job_id = jobs.SubmitJob(submit_request(
            model_json=json.dumps(serde.model_to_dict(MODEL)), global_batch=1,
            microbatch_size=1, slot_s=0.2), metadata=OWNER_MD, timeout=5.0).job_id
        _wait_plan(ch, job_id, False, "a first plan without TP stages")
        token = jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD,
                            timeout=5.0).trainer_token
        trainer = trainer_pb2_grpc.TrainerServiceStub(ch)

        def attach(tp: bool) -> None:
            trainer.Attach(trainer_pb2.AttachRequest(
                job_id=job_id, rank=0, world_size=1, device_id="h:0", tensor_parallel=tp),
                metadata=metadata(token), timeout=5.0)

        # the trainer's own attach path (rank 0 attaches every rank) says it runs TP
        link = DaemonLink(Endpoint(address=d.address, token=token), job_id)
        source = GrpcPlanSource(link, ["h:0", "h:1"], tensor_parallel=True)
        try:
            source.start(10)
            _wait_plan(ch, job_id, True, "a plan with a TP stage")
        finally:
            source.close()
            link.close()
        attach(False)
        _wait_plan(ch, job_id, False, "a plan without TP stages again")
    finally:
        d.stop()
