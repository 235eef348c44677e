"""A job that gives no V gets the controller's learned default (issue 17): over
gRPC (``v = 0``), from a job file without ``V``, and back via ``V=auto``."""

from __future__ import annotations

import time

import grpc
import pytest
from hetpilot.client.jobfile import budget_settings, job_request_from_toml
from hetpilot.v1 import agent_pb2_grpc, job_pb2, job_pb2_grpc

from .conftest import CLUSTER_MD, OWNER_MD, RunningDaemon
from .helpers import register_request, report, submit_request

pytestmark = pytest.mark.timeout(60)
T = 5.0


def test_default_v_over_grpc_and_back(daemon: RunningDaemon) -> None:
    ch = daemon.channel()
    agents = agent_pb2_grpc.AgentServiceStub(ch)
    jobs = job_pb2_grpc.JobServiceStub(ch)
    reg = agents.Register(register_request("a", 2), metadata=CLUSTER_MD, timeout=T)
    list(agents.Report(iter([report("a", 1, 2, registration=reg.registration)]),
                       metadata=CLUSTER_MD, timeout=T))
    info = jobs.SubmitJob(submit_request(v=0.0, budgets={"price_per_hour": 3.0}),
                          metadata=OWNER_MD, timeout=T)
    assert info.v == 0.0  # stored as "no V given", not replaced by a number
    deadline = time.monotonic() + 20
    while jobs.GetJob(job_pb2.GetJobRequest(job_id=info.job_id), metadata=OWNER_MD,
                      timeout=T).plan_version < 1:
        assert time.monotonic() < deadline, "no plan under the default V"
        time.sleep(0.1)
    set_v = jobs.UpdateBudgets(job_pb2.UpdateBudgetsRequest(job_id=info.job_id, v=50.0),
                               metadata=OWNER_MD, timeout=T)
    assert set_v.v == 50.0
    back = jobs.UpdateBudgets(job_pb2.UpdateBudgetsRequest(job_id=info.job_id, v=0.0),
                              metadata=OWNER_MD, timeout=T)
    assert back.v == 0.0 and back.budgets["price_per_hour"] == 3.0
    with pytest.raises(grpc.RpcError) as err:
        jobs.UpdateBudgets(job_pb2.UpdateBudgetsRequest(job_id=info.job_id, v=-1.0),
                           metadata=OWNER_MD, timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "v" in (err.value.details() or "")
    assert jobs.GetJob(job_pb2.GetJobRequest(job_id=info.job_id), metadata=OWNER_MD,
                       timeout=T).v == 0.0  # nothing stored was lost


def test_job_file_without_v_sends_the_default(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "model.json").write_text('{"layers": [{"fwd_gflop": 1, "out_mb": 1, "act_mb": 1, '
                                         '"param_mb": 1}]}')
    body = 'model = "model.json"\nglobal_batch = 64\nmicrobatch_size = 4\n'
    (tmp_path / "job.toml").write_text(body)
    assert job_request_from_toml(tmp_path / "job.toml").v == 0.0
    (tmp_path / "job.toml").write_text(body + "V = 0\n")
    with pytest.raises(Exception, match=r"job\.toml\.V: must be > 0"):
        job_request_from_toml(tmp_path / "job.toml")
    assert budget_settings(["V=auto", "price_per_hour=2"]) == ({"price_per_hour": 2.0}, 0.0)
    assert budget_settings(["V=7"]) == ({}, 7.0)
