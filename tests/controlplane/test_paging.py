"""ListJobs and ListNodes answer in pages that fit in one message (daemon/paging.py): what
was accepted can always be listed, however much of it there is."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from hetpilot.v1 import agent_pb2_grpc, cluster_pb2, cluster_pb2_grpc, job_pb2, job_pb2_grpc

from hetpilot.cli import main

from .conftest import CLUSTER_MD, OWNER_MD, OWNER_TOKEN, start_daemon
from .helpers import register_request, submit_request

pytestmark = pytest.mark.timeout(120)
T = 10.0
LIMIT = 64 * 1024  # max_message_bytes: a few jobs of long host lists fill a message


def test_jobs_and_nodes_past_one_message_are_listed_in_pages(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    d = start_daemon(tmp_path / "state", max_message_bytes=LIMIT)
    try:
        ch = d.channel()
        jobs = job_pb2_grpc.JobServiceStub(ch)
        hosts = [f"h{i:03d}" + "x" * 120 for i in range(60)]  # ~7.6 kB a job
        ids = [jobs.SubmitJob(submit_request(name=f"j{i}", allowed_hosts=hosts),
                              metadata=OWNER_MD, timeout=T).job_id for i in range(24)]
        jobs.CancelJob(job_pb2.CancelJobRequest(job_id=ids[5]), metadata=OWNER_MD, timeout=T)
        first = jobs.ListJobs(job_pb2.ListJobsRequest(), metadata=OWNER_MD, timeout=T)
        assert first.next_page_token and 1 < len(first.jobs) < 23
        assert first.ByteSize() <= LIMIT

        def pages(cancelled: bool) -> list[str]:
            seen, token = [], ""
            while True:
                page = jobs.ListJobs(job_pb2.ListJobsRequest(include_cancelled=cancelled,
                                                             page_token=token),
                                     metadata=OWNER_MD, timeout=T)
                seen += [j.job_id for j in page.jobs]
                token = page.next_page_token
                if not token:
                    return seen

        assert pages(True) == ids  # every job once, in submission order
        assert pages(False) == ids[:5] + ids[6:]
        with pytest.raises(grpc.RpcError) as err:
            jobs.ListJobs(job_pb2.ListJobsRequest(page_token="nosuchjob"), metadata=OWNER_MD,
                          timeout=T)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "page_token" in (err.value.details() or "")

        # the CLI follows the pages
        monkeypatch.setenv("HETPILOT_ADDRESS", d.address)
        monkeypatch.setenv("HETPILOT_TOKEN", OWNER_TOKEN)
        capsys.readouterr()
        assert main(["jobs", "--all", "--json"]) == 0
        assert [j["job_id"] for j in json.loads(capsys.readouterr().out)] == ids

        agents = agent_pb2_grpc.AgentServiceStub(ch)
        names = [f"n{i:02d}" + "y" * 100 for i in range(30)]
        for name in names:  # 64 devices a host: ~4 kB
            agents.Register(register_request(name, 64), metadata=CLUSTER_MD, timeout=T)
        nodes = cluster_pb2_grpc.ClusterServiceStub(ch)
        seen, token, answers = [], "", 0
        while True:
            page = nodes.ListNodes(cluster_pb2.ListNodesRequest(page_token=token),
                                   metadata=CLUSTER_MD, timeout=T)
            assert page.ByteSize() <= LIMIT
            seen += [n.host for n in page.nodes]
            answers += 1
            token = page.next_page_token
            if not token:
                break
        assert seen == sorted(names) and answers > 1
        capsys.readouterr()
        assert main(["nodes", "--json"]) == 0
        assert [n["host"] for n in json.loads(capsys.readouterr().out)["nodes"]] == sorted(names)
    finally:
        d.stop()
