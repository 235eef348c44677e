"""The trainer against a real daemon subprocess on loopback: plans in over TrainerService,
stage timings back, the model profile sent on Attach, and a daemon that goes away.

Devices are registered directly over AgentService (no agent processes: the
machine has 2 shared cores); the daemon's heartbeat timeout is long so they
stay up. Every wait is bounded; pytest-timeout is the backstop.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hetpilot.daemon.sqlite_store import SqliteStore
from hetpilot.v1 import agent_pb2, agent_pb2_grpc, common_pb2, job_pb2, job_pb2_grpc

from hetpilot.channel import Endpoint, metadata, open_sync

OWNER_TOKEN = "owner-token-trainer"
CLUSTER_TOKEN = "cluster-token-trainer"
HOST = "trainhost"

DAEMON_TOML = f"""
[daemon]
metrics_listen = "127.0.0.1:0"
slot_s = 0.5
report_interval_s = 0.5
heartbeat_timeout_s = 600
grace_s = 1.0

[auth]
owner_tokens = {{ alice = "{OWNER_TOKEN}" }}
cluster_token = "{CLUSTER_TOKEN}"
"""


def _wait(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last {value!r}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Daemon:
    """``hetpilot daemon`` as a subprocess; (re)started on a fixed or OS-picked port."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        (tmp / "daemon.toml").write_text(DAEMON_TOML)
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self, listen: str = "127.0.0.1:0") -> None:
        ends = self.state / "endpoints.json"
        ends.unlink(missing_ok=True)
        log = open(self.tmp / "daemon.log", "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hetpilot", "daemon", "--listen", listen, "--state-dir",
             str(self.state), "--config", str(self.tmp / "daemon.toml")],
            stdout=log, stderr=subprocess.STDOUT)
        _wait(lambda: ends.exists() and json.loads(ends.read_text())["pid"] == self.proc.pid,
              30, "the daemon's endpoints.json")
        self.address = json.loads(ends.read_text())["grpc"]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=20)
        self.proc = None

    def channel(self) -> grpc.Channel:
        return open_sync(Endpoint(address=self.address))

    def setup_job(self, devices: int = 2) -> str:
        """Register ``devices`` emulated devices on HOST and submit a profile-on-attach job."""
        with self.channel() as ch:
            agent_pb2_grpc.AgentServiceStub(ch).Register(agent_pb2.RegisterRequest(
                host=HOST, host_secret=f"test-host-secret-{HOST}", devices=[agent_pb2.DeviceInfo(
                    index=str(i), name="emu", kind=common_pb2.DEVICE_KIND_EMULATED, tflops=50.0,
                    memory_gb=80.0, price_per_hour=1.0, power_watts=300.0, emulated=True)
                    for i in range(devices)]), metadata=metadata(CLUSTER_TOKEN), timeout=10)
            info = job_pb2_grpc.JobServiceStub(ch).SubmitJob(job_pb2.SubmitJobRequest(
                name="mlp", profile_on_attach=True, global_batch=16, microbatch_size=4,
                slot_s=0.5, v=10.0), metadata=metadata(OWNER_TOKEN), timeout=10)
        return str(info.job_id)

    def job(self, job_id: str) -> job_pb2.JobInfo:
        with self.channel() as ch:
            return job_pb2_grpc.JobServiceStub(ch).GetJob(
                job_pb2.GetJobRequest(job_id=job_id), metadata=metadata(OWNER_TOKEN), timeout=10)

    def close(self) -> None:
        if self.proc is not None:
            self.kill()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path)
    d.start()
    try:
        yield d
    finally:
        d.close()


def _train_two_ranks(daemon: Daemon, job_id: str, tmp_path: Path, model: str, epochs: int,
                     *extra: str, timeout: float) -> list[tuple[str, str]]:
    """``hetpilot train --daemon`` on 2 local gloo ranks with the job's own token (as the
    owner hands it out); each rank's (stdout, stderr), after asserting both exited 0."""
    token = tmp_path / "trainer.token"
    token.write_text(daemon.job(job_id).trainer_token + "\n")
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
        env.pop("HETPILOT_TOKEN", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hetpilot", "train", "--model", model,
             "--daemon", daemon.address, "--job", job_id, "--token-file", str(token),
             "--epochs", str(epochs), "--device-id", HOST + ":{rank}", "--plan-wait", "30",
             "--log-format", "json",
             *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return outs


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_two_ranks_train_on_the_daemons_plan_and_report(daemon: Daemon, tmp_path: Path) -> None:
    job_id = daemon.setup_job()
    outs = _train_two_ranks(daemon, job_id, tmp_path, "hetpilot.trainer.examples:mlp", 3,
                            "--report", str(tmp_path / "report.jsonl"), timeout=60)
    assert "plan version" in outs[0][1]
    records = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]
    # one record per slot (the job's 0.5 s) and one at each epoch's end
    assert [r["epoch"] for r in records if r["closed_by"] == "epoch"] == [0, 1, 2]
    assert all(r["plan_version"] >= 1 for r in records)
    # the profile the trainer sent on Attach became the job's model
    info = daemon.job(job_id)
    assert info.model_name == "mlp" and info.plan_version >= 1
    # rank 0 said training returned: the job succeeded, and its loop and streams ended
    assert info.state == job_pb2.JOB_STATE_SUCCEEDED and info.reason == "finished"
    assert info.ended_unix_ms >= info.started_unix_ms > info.created_unix_ms > 0
    # the last epoch's loss reached the job's status (mlp has no eval hook)
    assert info.HasField("loss") and info.loss == pytest.approx(records[-1]["loss"])
    assert info.loss_step == records[-1]["step"] and not info.HasField("eval_metric")
    # the daemon stored each working rank's latest stage timings
    store = SqliteStore(daemon.state / "state.db")
    try:
        timings = store.latest_timings(job_id)
        measured = store.measurements(job_id)
    finally:
        store.close()
    # each rank timed the job's layers on its device and the daemon keeps them
    assert {m.device_id for m in measured} == {f"{HOST}:0", f"{HOST}:1"}
    assert all(len(m.layers) == 6 and all(t.fwd_s > 0 for t in m.layers) for m in measured)
    assert timings, "no stage timings stored"
    plan_devices = set(info.devices)
    for t in timings:
        assert t.plan_version >= 1 and t.iteration >= 8  # after epoch 2 of 4 iterations each
        assert t.stages and {s.device_id for s in t.stages} <= plan_devices
        assert all(s.fwd_s > 0 and s.samples_per_s > 0 for s in t.stages)
    # --report on rank 0 got every rank's record (gathered)
    reported = [json.loads(line) for line in (tmp_path / "report.jsonl").read_text().splitlines()]
    assert sorted({r["rank"] for r in reported}) == [0, 1]


def test_to_proto_carries_loss_and_eval_metric_when_present() -> None:
    from hetpilot.trainer.daemon_link import GrpcReporter

    record: dict[str, Any] = {
        "rank": 1, "plan_version": 3, "step": 12, "stage": 0, "device_id": f"{HOST}:1",
        "fwd_s": 0.01, "bwd_s": 0.02, "transfer_wait_s": 0.001, "sync_s": 0.002,
        "iteration_s": 0.5, "group_samples": 16}
    req = GrpcReporter.to_proto("job1", record)  # a record from before the keys existed
    assert req is not None and req.iteration == 12 and req.stages[0].samples_per_s == 32.0
    assert not req.HasField("loss") and not req.HasField("eval_metric")
    req = GrpcReporter.to_proto("job1", {**record, "loss": None})  # no iteration ran
    assert req is not None and not req.HasField("loss")
    req = GrpcReporter.to_proto("job1", {**record, "loss": 0.25})
    assert req is not None and req.loss == 0.25 and not req.HasField("eval_metric")
    req = GrpcReporter.to_proto("job1", {**record, "loss": 0.25, "eval_metric": -1.5})
    assert req is not None and (req.loss, req.eval_metric) == (0.25, -1.5)
    req = GrpcReporter.to_proto("job1", {**record, "loss": float("nan")})  # diverged: sent
    assert req is not None and req.HasField("loss") and req.loss != req.loss
    # an idle rank sends nothing, loss or not
    assert GrpcReporter.to_proto("job1", {**record, "stage": None, "loss": 0.25}) is None


@pytest.mark.timeout(60)
def test_source_keeps_last_plan_while_daemon_is_away(daemon: Daemon) -> None:
    from hetpilot.trainer.daemon_link import DaemonError, DaemonLink, GrpcPlanSource, GrpcReporter

    job_id = daemon.setup_job(devices=1)
    model = (Path(__file__).resolve().parents[2] / "examples" / "model.json").read_text()
    # a wrong token is refused at once, not retried
    bad = DaemonLink(Endpoint(address=daemon.address, token="wrong-token-123"), job_id)
    with pytest.raises(DaemonError, match="UNAUTHENTICATED"):
        GrpcPlanSource(bad, [f"{HOST}:0"]).start(5)
    bad.close()

    link = DaemonLink(Endpoint(address=daemon.address, token=daemon.job(job_id).trainer_token),
                      job_id,
                      timeout_s=2.0)
    source = GrpcPlanSource(link, [f"{HOST}:0"], model_json=model)
    reporter = GrpcReporter(link)
    try:
        source.start(10)
        first = source.wait_first(20)
        assert first.version >= 1 and source.poll(0) == first
        assert source.poll(first.version) is None
        port = daemon.address.rsplit(":", 1)[1]
        daemon.kill()
        _wait(lambda: not source.connected, 10, "the source to notice the daemon is gone")
        # away: no new plan, no exception, reports dropped, not raised
        assert source.poll(first.version) is None and source.poll(0) == first
        record = {"rank": 0, "plan_version": first.version, "step": 4, "stage": 0,
                  "device_id": f"{HOST}:0", "fwd_s": 0.01, "bwd_s": 0.02,
                  "transfer_wait_s": 0.0, "sync_s": 0.0, "iteration_s": 0.1,
                  "group_samples": 16}
        reporter(record)
        _wait(lambda: reporter.dropped >= 1, 15, "the report to be dropped")
        # back on the same port: the stream resumes by itself, reports flow again
        daemon.start(f"127.0.0.1:{port}")
        _wait(lambda: source.connected and source.reconnects >= 1, 20, "the source to reconnect")
        reporter(record)
        _wait(lambda: reporter.sent >= 1, 15, "a report to be delivered")
    finally:
        reporter.close(2)
        source.close()
        link.close()
    store = SqliteStore(daemon.state / "state.db")
    try:
        assert [t.iteration for t in store.latest_timings(job_id)] == [4]
    finally:
        store.close()


@pytest.mark.timeout(60)
def test_source_finish_reports_the_outcome_unless_torchrun_restarts(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    from hetpilot.trainer.daemon_link import DaemonLink, GrpcPlanSource

    model = (Path(__file__).resolve().parents[2] / "examples" / "model.json").read_text()

    def source(job_id: str) -> GrpcPlanSource:
        link = DaemonLink(Endpoint(address=daemon.address,
                                   token=daemon.job(job_id).trainer_token), job_id)
        src = GrpcPlanSource(link, [f"{HOST}:0"], model_json=model)
        src.start(10)
        return src

    failed = daemon.setup_job(devices=1)
    src = source(failed)
    # torchrun has restarts left: it starts the ranks again, so the job is not failed
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert src.finish(RuntimeError("rank 1 lost")) is False
    assert daemon.job(failed).state != job_pb2.JOB_STATE_FAILED
    src.link.close()
    # the last attempt failed: the job is FAILED, with the error
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    src = source(failed)
    assert src.finish(RuntimeError("rank 1 lost")) is True
    info = daemon.job(failed)
    assert info.state == job_pb2.JOB_STATE_FAILED and info.reason == "RuntimeError: rank 1 lost"
    src.link.close()
    # a trainer re-launched by hand (--resume) attaches again: the job runs again
    src = source(failed)
    assert daemon.job(failed).state == job_pb2.JOB_STATE_RUNNING
    assert src.finish() is True and daemon.job(failed).state == job_pb2.JOB_STATE_SUCCEEDED
    src.link.close()
    # a cancelled job cannot be finished: a warning, never an exception
    cancelled = daemon.setup_job(devices=1)
    src = source(cancelled)
    with daemon.channel() as ch:
        job_pb2_grpc.JobServiceStub(ch).CancelJob(job_pb2.CancelJobRequest(job_id=cancelled),
                                                  metadata=metadata(OWNER_TOKEN), timeout=10)
    assert src.finish() is False
    assert daemon.job(cancelled).state == job_pb2.JOB_STATE_CANCELLED
    src.link.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stage_timings_correct_a_measurement_the_device_stopped_matching(
        daemon: Daemon, tmp_path: Path) -> None:
    """Rank 0's device, the faster at Attach, slows down 8x past rank 1's after it
    (``testing.jobs:drowsy_tiny``): rank 0 sees its stage timings disagree with its layer times
    for three slots and sends them again, scaled; the daemon plans with the new ones and
    moves the job off that device. The job gives no ``sample``: the trainer profiles and
    times it on the dataset's first items, so the profile-on-attach job gets its model."""
    job_id = daemon.setup_job()
    outs = _train_two_ranks(daemon, job_id, tmp_path, "hetpilot.trainer.testing.jobs:drowsy_tiny",
                            16, timeout=90)
    assert daemon.job(job_id).model_name == "drowsy_tiny"
    factors = [float(line.split(" were ")[1].split("x ")[0]) for line in outs[0][1].splitlines()
               if line.startswith("hetpilot: rank 0's stage timings were")]
    assert factors and max(factors) > 3, outs[0][1][-3000:] + outs[0][0][-3000:]
    store = SqliteStore(daemon.state / "state.db")
    try:
        measured = {m.device_id: m for m in store.measurements(job_id)}
    finally:
        store.close()
    slow, fast = measured[f"{HOST}:0"], measured[f"{HOST}:1"]
    # the daemon keeps the corrected one, at the plan's microbatch (4): several times slower
    assert slow.microbatch == 4
    slow_s = sum(t.fwd_s + t.bwd_s for t in slow.layers)
    fast_s = sum(t.fwd_s + t.bwd_s for t in fast.layers)
    assert slow_s > 3 * fast_s, (slow_s, fast_s)
    # the daemon re-planned: the job's last plan has no work on the slowed device
    records = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]
    assert records[-1]["plan_version"] > records[0]["plan_version"]
    assert records[-1]["stage"] is None, records[-1]
