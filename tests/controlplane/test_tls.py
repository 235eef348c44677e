"""TLS and mutual TLS on a real daemon, with certificates made by the openssl CLI
for this test (a CA, a server certificate for 127.0.0.1, a client certificate)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hetpilot.daemon.config import TlsConfig
from hetpilot.v1 import agent_pb2, agent_pb2_grpc, job_pb2, job_pb2_grpc

from hetpilot.channel import Endpoint, open_sync

from .conftest import CLUSTER_MD, OWNER_MD, RunningDaemon, start_daemon
from .helpers import register_request, report

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
T = 10.0


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=hetpilot test CA", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", []), ("gpu01", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", *ext, cwd=d)
    return d


def _list_jobs(ep: Endpoint) -> None:
    with open_sync(ep) as ch:
        job_pb2_grpc.JobServiceStub(ch).ListJobs(job_pb2.ListJobsRequest(), metadata=OWNER_MD,
                                                 timeout=T, wait_for_ready=False)


@pytest.fixture
def tls_daemon(tmp_path: Path, pki: Path) -> Iterator[RunningDaemon]:
    d = start_daemon(tmp_path / "state", tls=TlsConfig(cert_file=str(pki / "server.pem"),
                                                       key_file=str(pki / "server.key")))
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def mtls_daemon(tmp_path: Path, pki: Path) -> Iterator[RunningDaemon]:
    d = start_daemon(tmp_path / "state", tls=TlsConfig(
        cert_file=str(pki / "server.pem"), key_file=str(pki / "server.key"),
        client_ca_file=str(pki / "ca.pem")))
    try:
        yield d
    finally:
        d.stop()


def test_tls_serves_clients_that_trust_its_ca_and_refuses_plaintext(tls_daemon: RunningDaemon,
                                                                      pki: Path) -> None:
    _list_jobs(Endpoint(address=tls_daemon.address, ca_file=str(pki / "ca.pem")))
    with pytest.raises(grpc.RpcError) as err:
        _list_jobs(Endpoint(address=tls_daemon.address))  # plaintext to a TLS port
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate(mtls_daemon: RunningDaemon, pki: Path) -> None:
    ca = str(pki / "ca.pem")
    _list_jobs(Endpoint(address=mtls_daemon.address, ca_file=ca,
                        cert_file=str(pki / "client.pem"), key_file=str(pki / "client.key")))
    with pytest.raises(grpc.RpcError) as err:
        _list_jobs(Endpoint(address=mtls_daemon.address, ca_file=ca))  # no client certificate
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_agents_by_certificate_speak_only_for_their_host(tmp_path: Path, pki: Path) -> None:
    d = start_daemon(tmp_path / "state", tls=TlsConfig(
        cert_file=str(pki / "server.pem"), key_file=str(pki / "server.key"),
        client_ca_file=str(pki / "ca.pem"), agents_by_certificate=True))
    ep = Endpoint(address=d.address, ca_file=str(pki / "ca.pem"),
                  cert_file=str(pki / "gpu01.pem"), key_file=str(pki / "gpu01.key"))
    try:
        with open_sync(ep) as ch:
            agents = agent_pb2_grpc.AgentServiceStub(ch)
            reg = agents.Register(register_request("gpu01"), metadata=CLUSTER_MD, timeout=T)
            for call, request in (
                    (agents.Register, register_request("gpu02")),
                    (agents.Heartbeat, agent_pb2.HeartbeatRequest(agent_id="gpu02"))):
                with pytest.raises(grpc.RpcError) as err:
                    call(request, metadata=CLUSTER_MD, timeout=T)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "gpu01" in (err.value.details() or "")
            with pytest.raises(grpc.RpcError) as err:  # each report is checked
                list(agents.Report(iter([report("gpu01", 1, registration=reg.registration),
                                         report("gpu02", 2)]),
                                   metadata=CLUSTER_MD, timeout=T))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        d.stop()
