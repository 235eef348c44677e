"""Host take-over and agent-death campaign (issue 37.2 and 37.3, the daemon's side).

  .venv/bin/python bench/host_campaign.py [--rounds 3] [--out host_campaign.json] [--keep DIR]

Loopback only, EMULATED devices, real processes: a ``hetpilot daemon`` on a fixed
port (so agents follow it across its restarts) and a real ``hetpilot agent``
(launching) whose job's entry point is ``sleep`` under the agent's runner and
torchrun. Each round:

  * take-over: the daemon is stopped, the agent paused (SIGSTOP), the daemon
    started again; while every
    known host is up for the restart grace, an impostor holding the cluster token
    registers the live host's name with no secret, with random secrets and with
    its own bound name's secret, then tries to report for the host. Counted: how
    many of these the daemon took (must be 0). The real agent is resumed: seconds
    until it registered again, and whether the job launched before kept running;
  * agent death: the agent is killed (SIGKILL) under a running job: seconds until
    the job is FAILED naming the host (expected: heartbeat_timeout_s plus up to a
    quarter of it, the sweep's period), how many of the launch's processes still
    live then (the agent's side, process group and parent-death signal, is not on
    this branch), and once an agent starts again on the state dir, seconds until
    they are gone;
  * cancel while down: another job, the agent killed, ``cancel`` at once: the job
    answers CANCELLED, its view says "cancelling: waiting for host ..."; an agent
    started again: seconds until the launch's processes are gone and its part
    exited.

Last line ``CAMPAIGN OK`` or ``CAMPAIGN FAILED: <reasons>`` (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from hetpilot.v1 import agent_pb2, agent_pb2_grpc, common_pb2, job_pb2, job_pb2_grpc

from hetpilot.channel import metadata

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import write_config

CLUSTER, OWNER = "campaign-cluster-token", "campaign-owner-token"
HEARTBEAT_S, GRACE_S = 2.0, 4.0
ENDED = (job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED, job_pb2.JOB_STATE_SUCCEEDED)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(what: str, pred: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


def _tree(pid: int) -> set[int]:
    """``pid`` and its live descendants (from /proc)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            fields = text[text.rfind(")") + 2:].split()
            if fields[0] != "Z":
                parent[int(entry.name)] = int(fields[1])
    found, todo = set(), [pid] if pid in parent else []
    while todo:
        p = todo.pop()
        found.add(p)
        todo += [c for c, pp in parent.items() if pp == p and c not in found]
    return found


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(p)
    return out


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = _free_port()
        base = _free_port()
        self.config = write_config(
            tmp / "daemon.toml", cluster_token=CLUSTER, owner_tokens={"alice": OWNER},
            report_interval_s=0.2, heartbeat_timeout_s=HEARTBEAT_S, restart_grace_s=GRACE_S,
            slot_s=1.0, rdzv_port_min=min(base, 65000), rdzv_port_max=min(base, 65000) + 30)
        (tmp / "cluster.token").write_text(CLUSTER + "\n")
        self.daemon: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.agent_log = tmp / "agent.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HETPILOT_")}
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.jobs = job_pb2_grpc.JobServiceStub(self.channel)
        self.agents = agent_pb2_grpc.AgentServiceStub(self.channel)

    def start_daemon(self) -> None:
        ends = self.tmp / "state" / "endpoints.json"
        ends.unlink(missing_ok=True)
        with open(self.tmp / "daemon.log", "ab") as log:
            self.daemon = subprocess.Popen(
                [sys.executable, "-m", "hetpilot", "daemon", "--listen", f"127.0.0.1:{self.port}",
                 "--state-dir", str(self.tmp / "state"), "--config", str(self.config),
                 "--metrics-listen", ""], stdout=subprocess.DEVNULL, stderr=log, env=self.env)
        _until("the daemon to serve", lambda: ends.exists() and json.loads(
            ends.read_text())["pid"] == self.daemon.pid)  # type: ignore[union-attr]

    def stop_daemon(self) -> None:
        assert self.daemon is not None
        self.daemon.send_signal(signal.SIGTERM)
        self.daemon.wait(timeout=30)

    def start_agent(self) -> None:
        with open(self.agent_log, "ab") as log:
            self.agent = subprocess.Popen(
                [sys.executable, "-m", "hetpilot", "agent", "--daemon", f"127.0.0.1:{self.port}",
                 "--host", "hosta", "--probe-listen", "127.0.0.1:0", "--token-file",
                 str(self.tmp / "cluster.token"), "--state-dir", str(self.tmp / "agent"),
                 "--stop-grace", "3", "--run-as", "agent",
                 "--emulate", "tflops=2,memory_gb=8,count=1"],
                stdout=subprocess.DEVNULL, stderr=log, env=self.env)

    def registrations(self) -> int:
        return self.agent_log.read_bytes().count(b"registered with") \
            if self.agent_log.exists() else 0

    def kill_agent(self) -> None:
        assert self.agent is not None
        self.agent.send_signal(signal.SIGKILL)
        self.agent.wait(timeout=10)

    def submit(self, name: str) -> str:
        entry = job_pb2.JobEntry(command=["sleep", "600"], ranks_per_host=1, hosts=1)
        info = self.jobs.SubmitJob(job_pb2.SubmitJobRequest(
            name=name, profile_on_attach=True, global_batch=16, microbatch_size=4, entry=entry),
            metadata=metadata(OWNER), timeout=10)
        return str(info.job_id)

    def job(self, job_id: str) -> job_pb2.JobInfo:
        return self.jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=metadata(OWNER),
                                timeout=10)

    def ranks(self, job_id: str) -> set[int]:
        """The running launch's processes (runner, torchrun, sleep), once all three run."""
        parts = [p for p in self.job(job_id).launch
                 if p.state == job_pb2.HOST_LAUNCH_STATE_RUNNING and p.pid]
        tree = _tree(parts[0].pid) if parts else set()
        return tree if len(tree) >= 3 else set()

    def close(self) -> None:
        for proc in (self.agent, self.daemon):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def _impostor(c: Cluster) -> dict[str, int]:
    """Register the live host's name as an impostor would; answers by status code."""
    codes: dict[str, int] = {}

    def call(fn: Callable[[], Any]) -> None:
        try:
            fn()
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name  # type: ignore[attr-defined]
        codes[code] = codes.get(code, 0) + 1

    md = metadata(CLUSTER)
    device = agent_pb2.DeviceInfo(index="0", name="emu", kind=common_pb2.DEVICE_KIND_EMULATED,
                                  tflops=200.0, memory_gb=80.0, emulated=True)
    own = "impostor-own-secret-" + secrets.token_hex(8)
    c.agents.Register(agent_pb2.RegisterRequest(host=f"imp{secrets.token_hex(3)}",
                                                devices=[device], host_secret=own),
                      metadata=md, timeout=10)
    for secret in ["", own, *(secrets.token_urlsafe(32) for _ in range(20))]:
        call(lambda s=secret: c.agents.Register(agent_pb2.RegisterRequest(  # type: ignore[misc]
            host="hosta", probe_address="127.0.0.1:7071", devices=[device], launches=True,
            host_secret=s), metadata=md, timeout=10))
    for registration in ("", secrets.token_hex(16)):
        call(lambda r=registration: list(c.agents.Report(iter([agent_pb2.AgentReport(  # type: ignore[misc]
            agent_id="hosta", seq=1, registration=r)]), metadata=md, timeout=10)))
    return codes


def round_(c: Cluster, i: int) -> dict[str, Any]:
    out: dict[str, Any] = {"round": i}
    job = c.submit(f"takeover-{i}")
    _until("the job's ranks", lambda: c.ranks(job))
    # -- take-over right after a daemon restart ----------------------------------
    assert c.agent is not None
    c.stop_daemon()
    c.agent.send_signal(signal.SIGSTOP)  # (paused before the stop, the old daemon would
    c.start_daemon()                     # count it silent and end the job first)
    out["impostor_answers"] = _impostor(c)
    before = c.registrations()
    t0 = time.monotonic()
    c.agent.send_signal(signal.SIGCONT)
    _until("the real agent to register again", lambda: c.registrations() > before)
    out["real_agent_back_s"] = round(time.monotonic() - t0, 2)
    info = c.job(job)
    out["job_after_takeover"] = job_pb2.JobState.Name(info.state)
    out["part_after_takeover"] = job_pb2.HostLaunchState.Name(info.launch[0].state)
    # -- agent death under the running job ---------------------------------------
    procs = c.ranks(job)
    t0 = time.monotonic()
    c.kill_agent()
    info = _until("the job to end", lambda: (j := c.job(job)).state in ENDED and j)
    out["death_to_failed_s"] = round(time.monotonic() - t0, 2)
    out["failed_reason"] = info.reason[:120]
    out["job_after_death"] = job_pb2.JobState.Name(info.state)
    out["processes_alive_at_failed"] = len(_alive(procs))
    # -- cancel while the host is down -------------------------------------------
    c.start_agent()
    t0 = time.monotonic()
    _until("the lost launch's processes to go", lambda: not _alive(procs))
    out["restart_to_stopped_s"] = round(time.monotonic() - t0, 2)
    job2 = c.submit(f"cancel-{i}")
    procs2 = _until("the second job's ranks", lambda: c.ranks(job2))
    c.kill_agent()
    answered = c.jobs.CancelJob(job_pb2.CancelJobRequest(job_id=job2), metadata=metadata(OWNER),
                                timeout=10)
    out["cancel_answer"] = job_pb2.JobState.Name(answered.state)
    view = _until("the view to say it waits", lambda: next(
        (w for w in c.job(job2).warnings if w.startswith("cancelling: waiting for host")), ""))
    out["cancel_view"] = view[:60]
    out["processes_alive_while_down"] = len(_alive(procs2))
    c.start_agent()
    t0 = time.monotonic()
    _until("the cancelled launch's processes to go", lambda: not _alive(procs2))
    _until("its part to exit", lambda: all(p.state == job_pb2.HOST_LAUNCH_STATE_EXITED
                                           for p in c.job(job2).launch))
    out["cancel_carried_out_s"] = round(time.monotonic() - t0, 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--keep", default="", metavar="DIR",
                    help="run in DIR and keep it (the daemon's and the agent's logs)")
    args = ap.parse_args()
    failures: list[str] = []
    rounds = []
    with tempfile.TemporaryDirectory(prefix="hetpilot-campaign-") as tmp:
        if args.keep:  # the daemon's and the agent's logs stay there
            tmp = args.keep
            Path(tmp).mkdir(parents=True, exist_ok=True)
        c = Cluster(Path(tmp))
        try:
            c.start_daemon()
            c.start_agent()
            _until("the agent to register", lambda: c.registrations() > 0)
            for i in range(args.rounds):
                r = round_(c, i)
                rounds.append(r)
                print(json.dumps(r), flush=True)
                if r["impostor_answers"].get("OK"):
                    failures.append(f"round {i}: the impostor was taken")
                if r["job_after_takeover"] in ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED") or \
                        r["part_after_takeover"] != "HOST_LAUNCH_STATE_RUNNING":
                    failures.append(f"round {i}: the job did not survive the take-over try")
                if r["job_after_death"] != "JOB_STATE_FAILED" or "hosta lost" not in \
                        r["failed_reason"]:
                    failures.append(f"round {i}: the job did not fail naming its host")
                if r["cancel_answer"] != "JOB_STATE_CANCELLED":
                    failures.append(f"round {i}: cancel answered {r['cancel_answer']}")
        except (TimeoutError, grpc.RpcError, AssertionError) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            c.close()
    summary = {"rounds": rounds, "heartbeat_timeout_s": HEARTBEAT_S, "restart_grace_s": GRACE_S,
               "failures": failures}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print("CAMPAIGN OK" if not failures else f"CAMPAIGN FAILED: {'; '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
