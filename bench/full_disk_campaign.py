"""Full-disk campaign against a real daemon: its state dir on a small tmpfs, owners
submitting jobs and EMULATED agents reporting while another file takes every free byte.

  sudo .venv/bin/python bench/full_disk_campaign.py [--rounds 3] [--size 2m] [--out f.json]

Loopback only, as root (it mounts a tmpfs per round and unmounts it after). Each round,
on a fresh file system and daemon (on a fixed port: a daemon started on a full disk
writes no endpoints.json):

  * owners (``--owners``) submit ``--jobs`` jobs each while ``--agents`` agents report;
  * the disk is filled; owners keep submitting, in turn, until each has been refused:
    counted, the jobs acknowledged while full and the refusals by status code;
  * while full: health's status, each owner's ListJobs and GetJob of its own jobs,
    another owner's job (must be refused) and the listings (own jobs only);
  * the filler is removed: seconds until a submit is taken again (one try every 0.1 s),
    until health says SERVING and until an agent's report is acknowledged again;
  * filled again, submits until refused, then SIGTERM while full (exit code, seconds)
    and a start while still full: the acknowledged jobs found again, a submit (must be
    refused), then room again, seconds until writes are taken, a last submit;
  * after a SIGTERM: ``PRAGMA integrity_check``, the jobs in the file against those
    acknowledged, and no WAL moved aside (no ``*.lost`` in the state dir).

Last line ``FULL DISK OK`` or ``FULL DISK FAILED: <reasons>`` (exit 1); not root: one
line saying so, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hetpilot.v1 import job_pb2, job_pb2_grpc

from hetpilot.channel import metadata

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import Daemon, EmulatedAgents, log_summary, submit_request, write_config

from tests.controlplane.sandbox import fill, small_fs  # _daemon puts the root on sys.path

CLUSTER = "full-disk-cluster-token"
SERVING = health_pb2.HealthCheckResponse.SERVING
RESUME_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Owners:
    """Owners submitting jobs to one daemon address; what each had acknowledged."""

    def __init__(self, address: str, tokens: dict[str, str]) -> None:
        self.tokens = tokens
        self.channel = grpc.insecure_channel(address)
        self.jobs = job_pb2_grpc.JobServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.acked: dict[str, list[str]] = {o: [] for o in tokens}
        self.refused: Counter[str] = Counter()

    def close(self) -> None:
        self.channel.close()

    def submit(self, owner: str) -> bool:
        """One submit; True when acknowledged (kept), else the refusal is counted."""
        try:
            info = self.jobs.SubmitJob(
                submit_request(name=f"{owner}-{len(self.acked[owner])}", slot_s=2.0),
                metadata=metadata(self.tokens[owner]), timeout=30)
        except grpc.RpcError as exc:
            self.refused[exc.code().name] += 1  # type: ignore[attr-defined]
            return False
        self.acked[owner].append(info.job_id)
        return True

    def until_refused(self, tries: int) -> int:
        """Owners submit in turn until each was refused once (at most ``tries`` in all);
        how many were acknowledged meanwhile."""
        waiting, taken = list(self.tokens), 0
        for i in range(tries):
            if not waiting:
                break
            owner = waiting[i % len(waiting)]
            if self.submit(owner):
                taken += 1
            else:
                waiting.remove(owner)
        return taken

    def all_acked(self) -> list[str]:
        return sorted(j for ids in self.acked.values() for j in ids)

    def health_status(self) -> str:
        try:
            resp = self.health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name  # type: ignore[attr-defined]
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    def listed(self, owner: str) -> list[str]:
        """The job ids ``owner``'s ListJobs gives, every page."""
        out: list[str] = []
        token = ""
        while True:
            page = self.jobs.ListJobs(job_pb2.ListJobsRequest(page_token=token),
                                      metadata=metadata(self.tokens[owner]), timeout=30)
            out += [j.job_id for j in page.jobs]
            token = page.next_page_token
            if not token:
                return out

    def reads(self, failures: list[str], where: str) -> dict[str, Any]:
        """Each owner's listing and GetJob of (up to 10 of) its own jobs, and of another
        owner's job: what answered; breaches and errors go to ``failures``."""
        out: dict[str, Any] = {"list_ok": 0, "get_ok": 0, "errors": Counter(),
                               "cross_owner_answers": Counter()}
        names = list(self.tokens)
        for k, owner in enumerate(names):
            md = metadata(self.tokens[owner])
            try:
                listed = set(self.listed(owner))
                out["list_ok"] += 1
                if listed != set(self.acked[owner]):
                    failures.append(f"{where}: {owner}'s listing has {len(listed)} jobs, "
                                    f"{len(self.acked[owner])} acknowledged "
                                    f"({len(listed - set(self.acked[owner]))} not hers)")
            except grpc.RpcError as exc:
                out["errors"][f"ListJobs {exc.code().name}"] += 1  # type: ignore[attr-defined]
            for job_id in self.acked[owner][:10]:
                try:
                    self.jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=md, timeout=30)
                    out["get_ok"] += 1
                except grpc.RpcError as exc:
                    out["errors"][f"GetJob {exc.code().name}"] += 1  # type: ignore[attr-defined]
            other = self.acked[names[(k + 1) % len(names)]]
            if other and len(names) > 1:
                try:
                    self.jobs.GetJob(job_pb2.GetJobRequest(job_id=other[0]), metadata=md,
                                     timeout=30)
                    out["cross_owner_answers"]["OK"] += 1
                    failures.append(f"{where}: {owner} read another owner's job {other[0]}")
                except grpc.RpcError as exc:
                    out["cross_owner_answers"][exc.code().name] += 1  # type: ignore[attr-defined]
        if out["errors"]:
            failures.append(f"{where}: reads failed: {dict(out['errors'])}")
        return out


def _resume(owners: Owners, agents: EmulatedAgents, filler: Path, failures: list[str],
            where: str) -> dict[str, Any]:
    """Free the space; seconds until a submit is taken (one try every 0.1 s), health
    says SERVING and an agent's report is acknowledged, each from the freeing."""
    reports = agents.stats.acked
    names = list(owners.tokens)
    checks: dict[str, Callable[[], bool]] = {
        "writes_taken_after_s": lambda: owners.submit(names[0]),
        "health_serving_after_s": lambda: owners.health_status() == "SERVING",
        "agent_report_acked_after_s": lambda: agents.stats.acked > reports}
    out: dict[str, float | None] = dict.fromkeys(checks)
    filler.unlink()
    t0 = time.monotonic()
    while time.monotonic() - t0 < RESUME_TIMEOUT_S and None in out.values():
        for what, check in checks.items():
            if out[what] is None and check():
                out[what] = round(time.monotonic() - t0, 2)
        time.sleep(0.1)
    for what, seconds in out.items():
        if seconds is None:
            failures.append(f"{where}: {what.removesuffix('_after_s').replace('_', ' ')}: not "
                            f"within {RESUME_TIMEOUT_S:.0f} s of space returning")
    return out


def _sigterm(daemon: Daemon, failures: list[str], where: str) -> dict[str, Any]:
    rc, took = daemon.stop(30.0)
    if rc != 0:
        failures.append(f"{where}: SIGTERM exit {rc}" + (" (killed after 30 s)" if rc is None
                                                          else ""))
    return {"exit": rc, "seconds": round(took, 2)}


def _file_check(state: Path, acked: list[str], failures: list[str], where: str
                ) -> dict[str, Any]:
    """integrity_check, the jobs in the file against ``acked``, WALs moved aside."""
    db = sqlite3.connect(state / "state.db")
    try:
        integrity = [r[0] for r in db.execute("PRAGMA integrity_check")]
        in_file = sorted(r[0] for r in db.execute("SELECT job_id FROM jobs"))
    finally:
        db.close()
    lost = sorted(p.name for p in state.glob("*.lost*"))
    missing = sorted(set(acked) - set(in_file))
    if integrity != ["ok"]:
        failures.append(f"{where}: integrity_check {integrity[:3]}")
    if missing:
        failures.append(f"{where}: {len(missing)} acknowledged job(s) not in the file: "
                        f"{missing[:5]}")
    if lost:
        failures.append(f"{where}: moved aside: {lost}")
    return {"integrity_check": integrity[:3], "jobs_in_file": len(in_file),
            "acked_missing": len(missing), "moved_aside": lost}


@contextlib.contextmanager
def _mounted(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (tests/controlplane/sandbox.py), unmounted after; a mount
    that fails raises RuntimeError with mount's words."""
    import pytest

    try:
        with small_fs(where, size) as mnt:
            yield mnt
    except pytest.skip.Exception as exc:
        raise RuntimeError(str(exc)) from None


def round_(i: int, args: argparse.Namespace, tmp: Path, failures: list[str]) -> dict[str, Any]:
    where = f"round {i}"
    out: dict[str, Any] = {"round": i}
    tokens = {f"owner{k}": f"full-disk-owner-{k}-token" for k in range(args.owners)}
    config = write_config(tmp / "daemon.toml", cluster_token=CLUSTER, owner_tokens=tokens,
                          drain_s=0.1, grace_s=1.0)
    round_dir = tmp / f"round{i}"
    round_dir.mkdir()
    with _mounted(round_dir, args.size) as mnt:
        state = mnt / "state"
        daemon = Daemon(state, config, log=tmp / f"daemon-{i}.log", metrics=False,
                        listen=f"127.0.0.1:{_free_port()}", log_level="WARNING")
        agents: EmulatedAgents | None = None
        owners: Owners | None = None
        try:
            address = daemon.start()
            agents = EmulatedAgents(address, CLUSTER, [f"r{i}h{k}" for k in range(args.agents)],
                                    interval=0.5).start()
            owners = Owners(address, tokens)
            for _ in range(args.jobs):
                for owner in tokens:
                    if not owners.submit(owner):
                        failures.append(f"{where}: a submit was refused before the disk was "
                                        f"full: {dict(owners.refused)}")
            out["acked_before_full"] = len(owners.all_acked())

            # full: acknowledged until refused; the daemon answers meanwhile
            filler = fill(mnt)
            out["acked_while_full"] = owners.until_refused(args.max_tries)
            if sum(owners.refused.values()) < len(tokens):
                failures.append(f"{where}: the disk never refused a submit in "
                                f"{args.max_tries} tries")
            acked_reports = agents.stats.acked
            time.sleep(max(args.hold, 1.5))  # agents report and job loops run on a full disk
            out["agent_reports_acked_while_full"] = agents.stats.acked - acked_reports
            out["health_while_full"] = owners.health_status()
            out["reads_while_full"] = owners.reads(failures, f"{where}, full")
            out["first_free"] = _resume(owners, agents, filler, failures, f"{where}, first free")

            # full again: a stop and a start while full
            filler = fill(mnt)
            out["acked_while_full_again"] = owners.until_refused(args.max_tries)
            out["sigterm_while_full"] = _sigterm(daemon, failures, where)
            owners.close()
            t0 = time.monotonic()
            daemon.start()
            out["restart_while_full_s"] = round(time.monotonic() - t0, 2)
            owners.channel = grpc.insecure_channel(address)
            owners.jobs = job_pb2_grpc.JobServiceStub(owners.channel)
            owners.health = health_pb2_grpc.HealthStub(owners.channel)
            acked = owners.all_acked()
            found = sorted(j for o in tokens for j in owners.listed(o))
            missing = sorted(set(acked) - set(found))
            out["acked"] = len(acked)
            out["found_after_restart"] = len(set(found) & set(acked))
            if missing:
                failures.append(f"{where}: {len(missing)} acknowledged job(s) not found after "
                                f"a restart while full: {missing[:5]}")
            refused_before = sum(owners.refused.values())
            if owners.submit(next(iter(tokens))):
                out["submit_after_restart_while_full"] = "OK"
            else:
                out["submit_after_restart_while_full"] = "refused"
            out["reads_after_restart_while_full"] = owners.reads(
                failures, f"{where}, restarted full")
            time.sleep(1.5)  # health follows the store once a second
            out["health_after_restart_while_full"] = owners.health_status()
            out["after_restart_free"] = _resume(owners, agents, filler, failures,
                                                f"{where}, free after restart")
            out["refusals"] = dict(owners.refused)
            out["refused_after_restart"] = sum(owners.refused.values()) - refused_before
            other = {c: n for c, n in owners.refused.items() if c != "RESOURCE_EXHAUSTED"}
            if other:
                failures.append(f"{where}: refusals other than RESOURCE_EXHAUSTED: {other}")
            out["sigterm"] = _sigterm(daemon, failures, where)
            out["file"] = _file_check(state, owners.all_acked(), failures, where)
            out["acked_total"] = len(owners.all_acked())
        finally:
            if agents is not None:
                agents.stop()
                out["agent_reports"] = {"acked": agents.stats.acked, "errors": agents.stats.errors,
                                        "last_error": agents.stats.last_error[:160]}
            if owners is not None:
                owners.close()
            daemon.kill()
    summary = log_summary(tmp / f"daemon-{i}.log")
    text = (tmp / f"daemon-{i}.log").read_text(errors="replace")
    out["daemon_log"] = {"tracebacks": summary["tracebacks"], "exceptions": summary["exceptions"],
                         "checkpoints_stopped_part_way": text.count("checkpoint stopped part way")}
    if summary["tracebacks"]:
        failures.append(f"{where}: {summary['tracebacks']} traceback(s) in the daemon's log")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="2m", help="the tmpfs's size (mount -o size=)")
    ap.add_argument("--owners", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=4, help="jobs per owner before the fill")
    ap.add_argument("--agents", type=int, default=4, help="EMULATED agents reporting")
    ap.add_argument("--hold", type=float, default=3.0,
                    help="seconds the disk stays full before the reads (at least 1.5: health "
                         "follows the store once a second)")
    ap.add_argument("--max-tries", type=int, default=300, help="submits to fill the store")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", type=Path, metavar="DIR", help="keep the daemon's logs in DIR")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("full_disk_campaign: needs root (it mounts a small tmpfs for the daemon's state)",
              file=sys.stderr)
        return 2
    failures: list[str] = []
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hetpilot-fulldisk-") as tmp_name:
        tmp = args.keep or Path(tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        for i in range(args.rounds):
            try:
                rounds.append(round_(i, args, tmp, failures))
            except (grpc.RpcError, RuntimeError, OSError, sqlite3.Error) as exc:
                failures.append(f"round {i}: {type(exc).__name__}: {str(exc)[:300]}")
                break
            print(json.dumps(rounds[-1]), flush=True)
    report = {"size": args.size, "owners": args.owners, "agents": args.agents, "rounds": rounds,
              "failures": failures}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("FULL DISK OK" if not failures else "FULL DISK FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
