"""ClusterService against a real daemon: ListNodes for owners and the cluster token,
and drained hosts leaving (and rejoining) every job's plans, across a restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from hetpilot.daemon.config import DaemonConfig
from hetpilot.daemon.controlplane import ControlPlane
from hetpilot.daemon.records import AgentRecord, DeviceInfo, DrainRecord
from hetpilot.daemon.store import MemoryStore
from hetpilot.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

from hetpilot.channel import metadata

from .conftest import CLUSTER_MD, OTHER_MD, OWNER_MD, start_daemon
from .helpers import register_request, report, submit_request, wait_until

pytestmark = pytest.mark.timeout(120)
T = 5.0




def _hosts(jobs: job_pb2_grpc.JobServiceStub, job_id: str) -> set[str]:
    info = jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD, timeout=T)
    return {d.rpartition(":")[0] for d in info.devices}


def _code(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_observed_cluster_leaves_drained_hosts_out() -> None:
    store = MemoryStore()
    dev = DeviceInfo(index="0", name="x", kind="emulated", tflops=10.0, memory_gb=8.0,
                     emulated=True)
    for host in ("a", "b"):
        store.put_agent(AgentRecord(host=host, probe_address="", devices=(dev,)))
    store.put_drain(DrainRecord(host="a", since_ms=1))  # as a restarted daemon finds it
    plane = ControlPlane(store, DaemonConfig(state_dir="/tmp"))
    assert [d.id for d in plane.observed_cluster().devices] == ["b:0"]
    plane.members.resume("a")
    assert [d.id for d in plane.observed_cluster().devices] == ["a:0", "b:0"] and not store.drains()
    plane.members.drain("b", "bad fan")
    assert [d.id for d in plane.observed_cluster().devices] == ["a:0"]
    assert store.drains()[0].reason == "bad fan"


def test_drain_moves_plans_off_and_survives_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    d = start_daemon(state, heartbeat_timeout_s=600.0)  # registered hosts stay up
    try:
        ch = d.channel()
        agents = agent_pb2_grpc.AgentServiceStub(ch)
        jobs = job_pb2_grpc.JobServiceStub(ch)
        cluster = cluster_pb2_grpc.ClusterServiceStub(ch)
        regs = {host: agents.Register(register_request(host, 2), metadata=CLUSTER_MD,
                                      timeout=T).registration for host in ("a", "b")}
        list(agents.Report(iter([report("a", 1, 2, registration=regs["a"]),
                                 report("b", 1, 2, registration=regs["b"])]),
                           metadata=CLUSTER_MD, timeout=T))
        ids = [jobs.SubmitJob(submit_request(name=f"j{i}"), metadata=OWNER_MD,
                              timeout=T).job_id for i in range(2)]
        for job_id in ids:
            wait_until(f"{job_id} on host a", lambda j=job_id: "a" in _hosts(jobs, j))

        # an owner lists the nodes: states, devices, the jobs on each host (their own)
        listed = cluster.ListNodes(cluster_pb2.ListNodesRequest(), metadata=OWNER_MD, timeout=T)
        assert [n.host for n in listed.nodes] == ["a", "b"]
        a = listed.nodes[0]
        assert a.state == cluster_pb2.NODE_STATE_UP and a.alive and set(a.jobs) == set(ids)
        assert [x.device_id for x in a.devices] == ["a:0", "a:1"]
        assert a.devices[0].tflops == 50.0 and a.devices[0].memory_free_gb == 70.0
        assert a.devices[0].price_per_hour == 1.0 and a.devices[0].planned_tflops == 50.0
        assert 0 <= a.last_seen_age_s < 60 and a.state_since_unix_ms > 0
        other = cluster.ListNodes(cluster_pb2.ListNodesRequest(), metadata=OTHER_MD, timeout=T)
        assert not other.nodes[0].jobs  # bob's view: none of alice's jobs

        # only the cluster token drains; bad and unknown hosts are refused by name
        err = _code(lambda: cluster.DrainHost(cluster_pb2.DrainHostRequest(host="a"),
                                              metadata=OWNER_MD, timeout=T))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "cluster token" in err.details()
        err = _code(lambda: cluster.DrainHost(cluster_pb2.DrainHostRequest(host="ghost"),
                                              metadata=CLUSTER_MD, timeout=T))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "'ghost'" in err.details()
        err = _code(lambda: cluster.ResumeHost(cluster_pb2.ResumeHostRequest(host="ghost"),
                                               metadata=CLUSTER_MD, timeout=T))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "'ghost'" in err.details()
        for req, field in ((cluster_pb2.DrainHostRequest(host="bad host"), "host"),
                           (cluster_pb2.DrainHostRequest(host="a", reason="x" * 501), "reason")):
            err = _code(lambda r=req: cluster.DrainHost(r, metadata=CLUSTER_MD, timeout=T))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details()
        err = _code(lambda: cluster.ListNodes(cluster_pb2.ListNodesRequest(),
                                              metadata=metadata("wrong-token-1"), timeout=T))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED

        node = cluster.DrainHost(cluster_pb2.DrainHostRequest(host="a", reason="new disk"),
                                 metadata=CLUSTER_MD, timeout=T)
        assert node.state == cluster_pb2.NODE_STATE_DRAINING and node.drain_reason == "new disk"
        assert set(node.jobs) == set(ids) and node.alive
        again = cluster.DrainHost(cluster_pb2.DrainHostRequest(host="a"), metadata=CLUSTER_MD,
                                  timeout=T)  # idempotent: the first time and reason stay
        assert (again.state_since_unix_ms, again.drain_reason) == (node.state_since_unix_ms,
                                                                    "new disk")
        for job_id in ids:  # both jobs' next plans avoid the drained host
            wait_until(f"{job_id} off host a", lambda j=job_id: _hosts(jobs, j) == {"b"})
    finally:
        d.stop()

    d = start_daemon(state, heartbeat_timeout_s=600.0)  # a restart keeps the drain
    try:
        ch = d.channel()
        jobs = job_pb2_grpc.JobServiceStub(ch)
        cluster = cluster_pb2_grpc.ClusterServiceStub(ch)
        listed = cluster.ListNodes(cluster_pb2.ListNodesRequest(), metadata=CLUSTER_MD, timeout=T)
        a = listed.nodes[0]
        assert a.state == cluster_pb2.NODE_STATE_DRAINING and a.drain_reason == "new disk"
        assert a.state_since_unix_ms == node.state_since_unix_ms
        slot = jobs.GetJob(job_pb2.GetJobRequest(job_id=ids[0]), metadata=OWNER_MD,
                           timeout=T).slot
        wait_until("a slot after the restart", lambda: jobs.GetJob(
            job_pb2.GetJobRequest(job_id=ids[0]), metadata=OWNER_MD, timeout=T).slot > slot + 1)
        assert all(_hosts(jobs, j) == {"b"} for j in ids)

        node = cluster.ResumeHost(cluster_pb2.ResumeHostRequest(host="a"), metadata=CLUSTER_MD,
                                  timeout=T)
        assert node.state == cluster_pb2.NODE_STATE_UP and not node.drain_reason
        # the host can come back: planning sees it again. (The running jobs stay: moving
        # costs them about 0.75 s, more than one 0.3 s slot saves; a new job takes it.)
        fresh = jobs.SubmitJob(submit_request(name="after"), metadata=OWNER_MD, timeout=T)
        wait_until("the new job on host a", lambda: "a" in _hosts(jobs, fresh.job_id))
    finally:
        d.stop()


def test_nodes_show_job_measured_speeds_and_links(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0)
    try:
        ch = d.channel()
        agents = agent_pb2_grpc.AgentServiceStub(ch)
        jobs = job_pb2_grpc.JobServiceStub(ch)
        cluster = cluster_pb2_grpc.ClusterServiceStub(ch)
        regs = {host: agents.Register(register_request(host, 1, probe=f"{host}:9"),
                                      metadata=CLUSTER_MD, timeout=T).registration
                for host in ("a", "b")}
        ra = report("a", 1, 1, registration=regs["a"])
        ra.links.append(agent_pb2.LinkReport(peer_host="b", gbps=9.5, rtt_us=40.0))
        ra.devices[0].probe_dtype, ra.devices[0].probe_shape = "float32", "4096x4096x4096"
        list(agents.Report(iter([ra, report("b", 1, 1, registration=regs["b"])]),
                           metadata=CLUSTER_MD, timeout=T))
        info = jobs.SubmitJob(submit_request(), metadata=OWNER_MD, timeout=T)
        # rank 0 measured 4 of the job's layers on a:0
        trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
        trainer.Attach(trainer_pb2.AttachRequest(
            job_id=info.job_id, rank=0, device_id="a:0", measured_microbatch=4,
            measured_dtype="bfloat16", layer_times=[
                trainer_pb2.LayerTiming(layer=i, fwd_s=0.004, bwd_s=0.008) for i in range(4)]),
            metadata=metadata(info.trainer_token), timeout=T)

        def speeds() -> Any:
            resp = cluster.ListNodes(cluster_pb2.ListNodesRequest(links=True),
                                     metadata=OWNER_MD, timeout=T)
            return resp if resp.nodes[0].devices[0].job_speeds else None

        resp = wait_until("the job's fitted speed", speeds)
        dev = resp.nodes[0].devices[0]
        assert (dev.probe_dtype, dev.probe_shape) == ("float32", "4096x4096x4096")
        [js] = dev.job_speeds
        assert js.job_id == info.job_id and js.dtype == "bfloat16" and js.microbatch == 4
        assert js.tflops > 0 and js.measured_unix_ms > 0
        assert [(x.from_host, x.to_host, x.gbps, x.rtt_us) for x in resp.links] == [
            ("a", "b", 9.5, 40.0)]
        # another owner does not see alice's job's measurements; the cluster token does
        other = cluster.ListNodes(cluster_pb2.ListNodesRequest(), metadata=OTHER_MD, timeout=T)
        assert not other.nodes[0].devices[0].job_speeds
        admin = cluster.ListNodes(cluster_pb2.ListNodesRequest(), metadata=CLUSTER_MD, timeout=T)
        assert admin.nodes[0].devices[0].job_speeds[0].job_id == info.job_id
        assert not admin.links  # links only when asked
    finally:
        d.stop()
