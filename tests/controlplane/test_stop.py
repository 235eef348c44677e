"""Graceful stop (issue 13.5) and storage faults seen from outside (13.4), on a
real daemon subprocess: SIGTERM turns health NOT_SERVING while calls are still
answered, in-flight calls finish instead of being CANCELLED, and a stop during
a long solve still ends the process promptly; a damaged state store is refused
with one line."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hetpilot.v1 import job_pb2, job_pb2_grpc

from hetpilot.channel import Endpoint, open_sync

from .conftest import OWNER_MD, OWNER_TOKEN, wait_endpoints
from .helpers import model_json, submit_request

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def _start(tmp_path: Path, **daemon: object) -> tuple[subprocess.Popen[bytes], str]:
    cfg = tmp_path / "d.toml"
    lines = ["[daemon]", *(f"{k} = {json.dumps(v)}" for k, v in daemon.items()),
             "[auth]", f'owner_tokens = {{ alice = "{OWNER_TOKEN}" }}',
             'cluster_token = "cluster-token-89"']
    cfg.write_text("\n".join(lines) + "\n")
    state = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "hetpilot", "daemon", "--listen",
                             "127.0.0.1:0", "--state-dir", str(state), "--metrics-listen", "",
                             "--config", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        return proc, wait_endpoints(state, timeout=60)["grpc"]
    except TimeoutError:
        proc.kill()
        raise AssertionError(proc.communicate(timeout=10)[1].decode()) from None


def test_sigterm_drains_then_finishes_in_flight_calls(tmp_path: Path) -> None:
    proc, address = _start(tmp_path, drain_s=1.5, grace_s=3.0)
    ch = open_sync(Endpoint(address=address))
    jobs = job_pb2_grpc.JobServiceStub(ch)
    health = health_pb2_grpc.HealthStub(ch)
    job = jobs.SubmitJob(submit_request(), metadata=OWNER_MD, timeout=10).job_id
    codes: Counter[str] = Counter()
    first_refused: list[float] = []
    cancelled: list[float] = []
    stop = threading.Event()

    def client() -> None:  # one fresh channel per thread, calls back to back
        stub = job_pb2_grpc.JobServiceStub(open_sync(Endpoint(address=address)))
        while not stop.is_set():
            try:
                stub.GetJob(job_pb2.GetJobRequest(job_id=job), metadata=OWNER_MD, timeout=5,
                            wait_for_ready=False)
                codes["OK"] += 1
            except grpc.RpcError as exc:
                codes[exc.code().name] += 1
                if exc.code() == grpc.StatusCode.CANCELLED:
                    cancelled.append(time.monotonic())
                if exc.code() == grpc.StatusCode.UNAVAILABLE and not first_refused:
                    first_refused.append(time.monotonic())
                time.sleep(0.05)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    before = codes["OK"]
    t_term = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    not_serving = None
    while time.monotonic() - t_term < 5 and not_serving is None:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            break
        if status == health_pb2.HealthCheckResponse.NOT_SERVING:
            not_serving = time.monotonic()
        time.sleep(0.05)
    assert proc.wait(timeout=20) == 0
    t_exit = time.monotonic()
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert not_serving is not None and not_serving - t_term < 1.0, "health never said NOT_SERVING"
    assert codes["OK"] > before  # calls were still answered after SIGTERM (the drain)
    assert not first_refused or first_refused[0] - t_term >= 1.0, codes
    assert codes["CANCELLED"] == 0, (codes, [round(t - t_term, 3) for t in cancelled])
    assert t_exit - t_term < 1.5 + 3.0 + 5.0


def test_an_in_flight_call_finishes_within_the_grace(tmp_path: Path) -> None:
    """Event-driven: an agent's Report stream, open when SIGTERM comes, is served during
    the drain; once the server has begun stopping (new calls refused) its next report
    ends it UNAVAILABLE (the agent registers with the next daemon), so the daemon exits
    at once rather than at the end of the grace. The end of the drain is seen as the
    plan watcher's stream ending UNAVAILABLE: the daemon ends those streams, then stops
    the server with no await between."""
    import queue

    from hetpilot.v1 import agent_pb2_grpc

    from .conftest import CLUSTER_MD
    from .helpers import register_request, report

    grace_s = 120.0  # a guard: the call ends long before, and the stop with it
    proc, address = _start(tmp_path, drain_s=0.3, grace_s=grace_s)
    try:
        ch = open_sync(Endpoint(address=address))
        jobs = job_pb2_grpc.JobServiceStub(ch)
        agents = agent_pb2_grpc.AgentServiceStub(ch)
        job = jobs.SubmitJob(submit_request(), metadata=OWNER_MD, timeout=10).job_id
        watch = jobs.WatchPlans(job_pb2.WatchPlansRequest(job_id=job), metadata=OWNER_MD)
        reg = agents.Register(register_request("h0"), metadata=CLUSTER_MD,
                              timeout=10).registration
        sent: queue.Queue[object] = queue.Queue()

        def requests() -> Iterator[object]:
            while (item := sent.get(timeout=60)) is not None:
                yield item

        stream = agents.Report(requests(), metadata=CLUSTER_MD)
        sent.put(report("h0", 1, registration=reg))
        assert next(stream).seq == 1  # the call is in flight
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in watch:  # plan versions, until the drain ends
                pass
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stopping" in (ended.value.details() or "")
        # the server is stopping now: a new call is refused ...
        with pytest.raises(grpc.RpcError) as refused:
            jobs.GetJob(job_pb2.GetJobRequest(job_id=job), metadata=OWNER_MD, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # ... and the report stream in flight ends at its next report, not after the grace
        sent.put(report("h0", 2, registration=reg))
        with pytest.raises(grpc.RpcError) as stopped:
            next(stream)
        assert stopped.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the daemon is stopping" in (stopped.value.details() or "")
        sent.put(None)
        assert proc.wait(timeout=grace_s / 2) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_sigterm_during_a_long_solve_exits_promptly(tmp_path: Path) -> None:
    proc, address = _start(tmp_path, drain_s=0.2, grace_s=1.0, slot_s=0.2)
    jobs = job_pb2_grpc.JobServiceStub(open_sync(Endpoint(address=address)))
    data = json.loads(model_json())
    data["layers"] = [dict(data["layers"][1], name=f"l{i}") for i in range(1000)]
    from hetpilot.v1 import agent_pb2_grpc

    from .conftest import CLUSTER_MD
    from .helpers import register_request
    agents = agent_pb2_grpc.AgentServiceStub(open_sync(Endpoint(address=address)))
    for h in range(4):
        agents.Register(register_request(f"h{h}", n=4, tflops=20.0 + 10 * h), metadata=CLUSTER_MD,
                        timeout=10)
    jobs.SubmitJob(submit_request(model_json=json.dumps(data), global_batch=256, slot_s=0.2),
                   metadata=OWNER_MD, timeout=30)
    time.sleep(3.0)  # the first slot of a 1000-layer model takes tens of seconds
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert time.monotonic() - t0 < 0.2 + 1.0 + 5.0


def test_sighup_stops_the_daemon_and_its_agent_as_sigterm_does(tmp_path: Path) -> None:
    """SIGHUP (a closed terminal) used to end both at once, skipping the drain; now it
    is a graceful stop, said in the daemon's log, and the job is there after a restart."""
    proc, address = _start(tmp_path, drain_s=0.2, grace_s=1.0)
    jobs = job_pb2_grpc.JobServiceStub(open_sync(Endpoint(address=address)))
    job = jobs.SubmitJob(submit_request(), metadata=OWNER_MD, timeout=10).job_id
    token = tmp_path / "cluster.token"
    token.write_text("cluster-token-89\n")
    agent = subprocess.Popen([sys.executable, "-m", "hetpilot", "agent", "--daemon", address,
                              "--host", "h0", "--token-file", str(token),
                              "--state-dir", str(tmp_path / "agent"),
                              "--probe-listen", "127.0.0.1:0", "--emulate",
                              "tflops=20,memory_gb=16"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not jobs.GetJob(job_pb2.GetJobRequest(job_id=job), metadata=OWNER_MD,
                              timeout=5).devices:  # the agent is up and planned with
            assert time.monotonic() < deadline and agent.poll() is None, "no plan on h0"
            time.sleep(0.2)
        agent.send_signal(signal.SIGHUP)
        assert agent.wait(timeout=20) == 0, agent.communicate(timeout=5)[1].decode()[-2000:]
    finally:
        agent.kill()
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=20) == 0
    assert "SIGHUP: stopping (there is no reload" in proc.communicate(timeout=5)[1].decode()
    (tmp_path / "s" / "endpoints.json").unlink()  # the stopped daemon's
    proc, address = _start(tmp_path)
    try:
        jobs = job_pb2_grpc.JobServiceStub(open_sync(Endpoint(address=address)))
        assert jobs.GetJob(job_pb2.GetJobRequest(job_id=job), metadata=OWNER_MD,
                           timeout=10).job_id == job
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_damaged_state_store_is_refused_with_one_line(tmp_path: Path) -> None:
    state = tmp_path / "s"
    state.mkdir()
    (state / "state.db").write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "hetpilot", "daemon", "--listen", "127.0.0.1:0",
                           "--state-dir", str(state), "--metrics-listen", ""],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [errors[0]] and "state.db is empty" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert (state / "state.db").stat().st_size == 0


def test_health_follows_the_store_and_full_disk_is_resource_exhausted(tmp_path: Path) -> None:
    from grpc_health.v1 import health
    from hetpilot.daemon.errors import StorageFull
    from hetpilot.daemon.records import JobStatus
    from hetpilot.daemon.server import _store_health
    from hetpilot.daemon.servicers import status_of
    from hetpilot.daemon.sqlite_store import SqliteStore

    store = SqliteStore(tmp_path / "state.db")
    servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]

    async def status() -> int:
        request = health_pb2.HealthCheckRequest(service="")
        return (await servicer.Check(request, None)).status  # type: ignore[no-any-return]

    async def scenario() -> list[int]:
        seen = []
        task = asyncio.create_task(_store_health(store, servicer))
        await asyncio.sleep(0.2)
        seen.append(await status())
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count={pages}")  # the disk is full
        with pytest.raises(StorageFull) as err:
            store.record_slot("j", status=JobStatus(), controller_state={"x": "y" * 1_000_000})
        assert status_of(err.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        await asyncio.sleep(1.5)
        seen.append(await status())
        store._db.execute("PRAGMA max_page_count=1073741823")  # room again
        await asyncio.sleep(5.5)  # the next probe
        seen.append(await status())
        task.cancel()
        return seen

    SERVING, NOT_SERVING = (health_pb2.HealthCheckResponse.SERVING,
                            health_pb2.HealthCheckResponse.NOT_SERVING)
    assert asyncio.run(scenario()) == [SERVING, NOT_SERVING, SERVING]
    store.close()


def test_kill_9_leaves_no_planning_process_behind(tmp_path: Path) -> None:
    from hetpilot.v1 import agent_pb2_grpc

    from .conftest import CLUSTER_MD
    from .helpers import register_request

    proc, address = _start(tmp_path, slot_s=0.2)
    ch = open_sync(Endpoint(address=address))
    agent_pb2_grpc.AgentServiceStub(ch).Register(register_request("h0", 2), metadata=CLUSTER_MD,
                                                 timeout=10)
    job = job_pb2_grpc.JobServiceStub(ch).SubmitJob(submit_request(slot_s=0.2), metadata=OWNER_MD,
                                                   timeout=10).job_id
    deadline = time.monotonic() + 60
    while job_pb2_grpc.JobServiceStub(ch).GetJob(job_pb2.GetJobRequest(job_id=job),
                                                 metadata=OWNER_MD, timeout=10).slot < 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
                .read_text().split()]
    assert children  # the planning process (and multiprocessing's resource tracker)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while [c for c in children if Path(f"/proc/{c}").exists()
           and "zombie" not in Path(f"/proc/{c}/status").read_text()]:
        assert time.monotonic() < deadline, "a planning process outlived its daemon"
        time.sleep(0.2)


def test_a_second_daemon_on_a_taken_port_fails_instead_of_sharing_it(tmp_path: Path) -> None:
    (tmp_path / "first").mkdir()
    proc, address = _start(tmp_path / "first")
    try:
        second = subprocess.run(
            [sys.executable, "-m", "hetpilot", "daemon", "--listen", address, "--state-dir",
             str(tmp_path / "second"), "--metrics-listen", ""],
            capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stderr
        assert f"cannot listen on {address}" in second.stderr and "Traceback" not in second.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=20)
