"""The daemon never plans tensor-parallel stages for a job while its trainer cannot run
them (issue 38 (d); daemon/job_model.py)."""

from __future__ import annotations

import json

from hetpilot.daemon.job_model import make_controller, to_job
from hetpilot.daemon.records import JobRecord
from hetpilot.planner import serde
from hetpilot.planner.controller import Controller
from hetpilot.planner.types import Cluster, Device, Job, Layer, Model, Network

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
