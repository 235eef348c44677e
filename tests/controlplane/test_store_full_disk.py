"""A full disk on a real small file system (a 2 MiB tmpfs, mounted as root): the store
refuses writes while it is full, takes them again once there is room, without a
restart, and a restart, with the disk full or not, finds every acknowledged write.

What the campaign hit (issue 37.5): a WAL checkpoint that ran out of room part way
left the database file shorter than its header says, with every page still in the
WAL; the store took that for a file truncated under it, refused all writes for good,
moved the WAL aside on stop and the next start refused the file."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hetpilot.daemon.errors import StorageFull
from hetpilot.daemon.records import JobRecord
from hetpilot.daemon.sqlite_store import SqliteStore
from hetpilot.v1 import job_pb2, job_pb2_grpc

from hetpilot.channel import Endpoint, open_sync

from .conftest import OWNER_MD, OWNER_TOKEN, wait_endpoints
from .helpers import submit_request
from .sandbox import fill

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system (tmpfs) needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, text=True, timeout=30)
    if run.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip() or run.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], timeout=30, check=True)


def _job(i: int) -> JobRecord:
    return JobRecord(job_id=f"j{i:03d}", owner="alice", name="n", state="queued",
                     global_batch=8, microbatch_size=2, schedules=("1f1b",), budgets={},
                     V=10.0, slot_s=1.0, allowed_hosts=(), model_json="m" * 6000)


def _short_of_its_header(path: Path) -> bool:
    """Whether the file is shorter than the pages its header counts: a checkpoint that
    stopped part way (page 1 is written first)."""
    header = path.read_bytes()[:100]
    page_size = int.from_bytes(header[16:18], "big")
    return path.stat().st_size < page_size * int.from_bytes(header[28:32], "big")


def _submit(store: SqliteStore, jobs: list[str], n: int, until_full: bool) -> int:
    """Create up to ``n`` jobs, keeping the ids acknowledged; how many were refused as
    StorageFull (any other error fails the test). With ``until_full``, stop at the first."""
    refused = 0
    for _ in range(n):
        job = _job(len(jobs) + refused)
        try:
            store.create_job(job)
        except StorageFull:
            refused += 1
            if until_full:
                break
        else:
            jobs.append(job.job_id)
    return refused


def test_a_full_disk_loses_no_acknowledged_write_and_writes_resume(small_fs: Path) -> None:
    path = small_fs / "state.db"
    acked: list[str] = []
    # a checkpoint every 12 pages (3-4 commits), so that some run while the disk is full
    store = SqliteStore(path, checkpoint_pages=12)
    assert _submit(store, acked, 12, until_full=False) == 0  # WAL space to reuse
    filler = fill(small_fs)

    # full: writes are acknowledged while the WAL has room, then refused as full
    # (never UNAVAILABLE), reads go on, and nothing acknowledged is lost
    assert _submit(store, acked, 40, until_full=True) == 1
    assert _submit(store, acked, 3, until_full=False) == 3 and not store.writable
    assert [j.job_id for j in store.list_jobs()] == acked
    short = _short_of_its_header(path)

    # a restart while the disk is still full
    store.close()
    assert not list(small_fs.glob("*.lost"))
    short = short or _short_of_its_header(path)
    assert short, "no checkpoint stopped part way: the test did not fill the disk in time"
    store = SqliteStore(path, checkpoint_pages=12)
    assert [j.job_id for j in store.list_jobs()] == acked
    assert _submit(store, acked, 2, until_full=False) == 2

    # room again: writes resume without a restart
    filler.unlink()
    assert store.probe() and store.writable
    before = len(acked)
    assert _submit(store, acked, 20, until_full=False) == 0 and len(acked) == before + 20
    assert not _short_of_its_header(path)  # the checkpoint completed
    store.close()

    # a restart finds every acknowledged write, in a sound file, its WAL never moved
    store = SqliteStore(path)
    assert [j.job_id for j in store.list_jobs()] == acked
    store.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert db.execute("SELECT count(*) FROM jobs").fetchone()[0] == len(acked)
    db.close()
    assert not list(small_fs.glob("*.lost"))


def _daemon(state: Path, config: Path, listen: str = "127.0.0.1:0"
            ) -> tuple[subprocess.Popen[bytes], str]:
    """A daemon subprocess and its address: from endpoints.json for port 0, else once
    ``listen`` answers (on a full disk there is no endpoints.json)."""
    proc = subprocess.Popen([sys.executable, "-m", "hetpilot", "daemon", "--listen", listen,
                             "--state-dir", str(state), "--metrics-listen", "",
                             "--config", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        if listen.endswith(":0"):
            return proc, wait_endpoints(state, timeout=60)["grpc"]
        grpc.channel_ready_future(open_sync(Endpoint(address=listen))).result(timeout=60)
        return proc, listen
    except (TimeoutError, grpc.FutureTimeoutError):
        proc.kill()
        raise AssertionError(proc.communicate(timeout=10)[1].decode()[-3000:]) from None


def _sigterm_exits_0(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.communicate(timeout=10)[1].decode()[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health_becomes(address: str, status: int) -> None:
    """Return once the daemon's health says ``status`` (a Watch stream: no polling)."""
    stub = health_pb2_grpc.HealthStub(open_sync(Endpoint(address=address)))
    for update in stub.Watch(health_pb2.HealthCheckRequest(), timeout=60):
        if update.status == status:
            return


def _submit_until_full(jobs: job_pb2_grpc.JobServiceStub, acked: list[str], n: int) -> int:
    """Submit up to ``n`` jobs, keeping the acknowledged ids; stop at the first
    RESOURCE_EXHAUSTED (any other refusal fails the test); how many were refused."""
    for i in range(n):
        try:
            acked.append(jobs.SubmitJob(submit_request(name=f"j{len(acked)}-{i}"),
                                        metadata=OWNER_MD, timeout=30).job_id)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
            return 1
    return 0


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_the_daemon_on_a_full_disk_answers_again_and_keeps_every_acknowledged_job(
        small_fs: Path, tmp_path: Path) -> None:
    """The campaign, on a real daemon: fill its state dir's file system, submit until
    RESOURCE_EXHAUSTED, free the space: health turns SERVING again and submits are
    taken, without a restart. Fill it again, stop the daemon while full and start it
    while still full: it serves every acknowledged job, refuses writes, and takes them
    once there is room; the file is sound and no WAL was moved aside."""
    state = small_fs / "state"
    config = tmp_path / "d.toml"
    config.write_text("[daemon]\ndrain_s = 0.1\ngrace_s = 1.0\n[auth]\n"
                      f'owner_tokens = {{ alice = "{OWNER_TOKEN}" }}\n'
                      'cluster_token = "cluster-token-89"\n')
    proc, address = _daemon(state, config)
    acked: list[str] = []
    try:
        jobs = job_pb2_grpc.JobServiceStub(open_sync(Endpoint(address=address)))
        assert _submit_until_full(jobs, acked, 3) == 0
        filler = fill(small_fs)
        assert _submit_until_full(jobs, acked, 200) == 1
        _health_becomes(address, health_pb2.HealthCheckResponse.NOT_SERVING)
        filler.unlink()
        _health_becomes(address, health_pb2.HealthCheckResponse.SERVING)  # its probe
        before = len(acked)
        assert _submit_until_full(jobs, acked, 3) == 0 and len(acked) == before + 3

        filler = fill(small_fs)
        assert _submit_until_full(jobs, acked, 200) == 1
        _sigterm_exits_0(proc)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    proc, address = _daemon(state, config, listen=f"127.0.0.1:{_free_port()}")
    try:
        jobs = job_pb2_grpc.JobServiceStub(open_sync(Endpoint(address=address)))
        listed = [j.job_id for j in jobs.ListJobs(job_pb2.ListJobsRequest(), metadata=OWNER_MD,
                                                  timeout=30).jobs]
        assert sorted(listed) == sorted(acked)
        assert _submit_until_full(jobs, acked, 1) == 1  # still full
        _health_becomes(address, health_pb2.HealthCheckResponse.NOT_SERVING)
        filler.unlink()
        _health_becomes(address, health_pb2.HealthCheckResponse.SERVING)
        assert _submit_until_full(jobs, acked, 2) == 0
        _sigterm_exits_0(proc)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    db = sqlite3.connect(state / "state.db")
    assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert sorted(r[0] for r in db.execute("SELECT job_id FROM jobs")) == sorted(acked)
    db.close()
    assert not list(state.glob("*.lost"))
