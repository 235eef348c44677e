"""The demo run: start the control plane, measure a static even plan, then hetpilot.

Design of the comparison (also stated in the report): two phases in one run,
one after the other, on the same EMULATED cluster, data order, seeds and
epoch count, with the same events at the same epochs:

1. **static**: 4 ``hetpilot train --plan even.json`` ranks, even data parallelism
   (a quarter of each batch per device) for every epoch;
2. **hetpilot**: 4 ``hetpilot train --daemon ADDR --job ID`` ranks; the daemon
   plans from what the agents report and re-plans as the events land.

An event for epoch e is written to the emulation file when rank 0 reports
the end of epoch e-1, in both phases; agents report it at their next report
(0.25 s) and trainer ranks feel it from their next iteration. The trainer
takes a new plan before any iteration and reports once per slot (the job's
0.5 s, and at every plan switch and epoch end), so an epoch has several
records per rank; the rows here sum them per epoch. The daemon and agents run
through both phases (they are idle in the first: no job yet).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetpilot.emulation import write_emulation

from . import scenario
from .procs import Procs

__all__ = ["DemoError", "EpochRow", "PhaseResult", "RunResult", "run_demo"]

PY = sys.executable


class DemoError(RuntimeError):
    pass


@dataclass
class EpochRow:
    epoch: int
    plan_version: int
    iteration_s: float
    """Mean iteration time of the epoch (slowest working rank)."""
    epoch_s: float
    """Training time of the epoch (iterations x iteration_s)."""
    devices: tuple[str, ...]
    samples: dict[str, int]
    cost_per_hour: float
    wall_s: float
    """Seconds since the phase's ranks were started, when rank 0 reported the epoch."""
    accuracy: float | None = None


@dataclass
class PhaseResult:
    name: str
    rows: list[EpochRow] = field(default_factory=list)
    wall_s: float = 0.0
    events: list[tuple[int, str]] = field(default_factory=list)
    event_unix_s: list[float] = field(default_factory=list)
    """When each event was written to the emulation file."""
    switches: list[tuple[int, float]] = field(default_factory=list)
    """(epoch, unix time) of each plan switch rank 0 made (the record it closed)."""

    def reactions_s(self) -> list[float | None]:
        """Per event: seconds until the trainer's first switch after it (None: none)."""
        out: list[float | None] = []
        for at in self.event_unix_s:
            later = [t for _, t in self.switches if t >= at]
            out.append(min(later) - at if later else None)
        return out


@dataclass
class RunResult:
    epochs: int
    static: PhaseResult
    hetpilot: PhaseResult
    plans: list[dict[str, Any]]
    job: dict[str, Any]
    total_s: float


def _env(rank: int, world: int, port: int) -> dict[str, str]:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
    for key in ("HETPILOT_TOKEN", "HETPILOT_CLUSTER_TOKEN", "HETPILOT_ADDRESS"):
        env.pop(key, None)
    return env


def _wait(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise DemoError(f"timed out after {timeout:g} s waiting for {what}")


class Demo:
    def __init__(self, out: Path, epochs: int, on_update: Callable[[Demo], None]) -> None:
        self.out = out
        self.epochs = epochs
        self.work = out / "run"
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        self.procs = Procs(self.work)
        self.emu = self.work / "emulation.json"
        self.on_update = on_update
        self.address = ""
        self.job_id = ""
        self.events = scenario.events(epochs)
        self.phase: PhaseResult | None = None
        self.phases: list[PhaseResult] = []
        self.log: list[str] = []
        self.job: dict[str, Any] = {}
        owner, cluster = secrets.token_hex(16), secrets.token_hex(16)
        self.owner_token, self.cluster_token = owner, cluster
        (self.work / "cluster.token").write_text(cluster + "\n")
        (self.work / "daemon.toml").write_text(f"""
[daemon]
metrics_listen = ""
slot_s = 0.5
report_interval_s = 0.25
heartbeat_timeout_s = 10
grace_s = 1.0
inter_host_gbps = {scenario.LINK_GBPS}
latency_us = {scenario.LINK_LATENCY_US}

[auth]
owner_tokens = {{ demo = "{owner}" }}
cluster_token = "{cluster}"
""")

    # -- emulation -----------------------------------------------------------

    def set_conditions(self, upto_epoch: int) -> list[str]:
        """Write the emulation file with every event of epoch <= ``upto_epoch`` applied."""
        devices = {d: h.tflops for d, h in scenario.DEVICES}
        gbps: dict[tuple[str, str], float] = {}
        texts = []
        for ev in self.events:
            if ev.epoch <= upto_epoch:
                devices.update(ev.devices)
                gbps.update(ev.links)
                texts.append(ev.text)
        write_emulation(self.emu, devices, scenario.links(gbps),
                        note="EMULATED: " + ("; ".join(texts) or "nominal"))
        return texts

    def say(self, text: str) -> None:
        self.log.append(text)
        self.on_update(self)

    # -- control plane -------------------------------------------------------

    def start_control_plane(self) -> None:
        state = self.work / "state"
        self.procs.start("daemon", [PY, "-m", "hetpilot", "daemon", "--listen", "127.0.0.1:0",
                                    "--state-dir", str(state), "--config",
                                    str(self.work / "daemon.toml"), "--log-level", "WARNING"])
        ends = state / "endpoints.json"
        _wait(lambda: ends.exists(), 60, "the daemon (run/daemon.log)")
        self.address = json.loads(ends.read_text())["grpc"]
        self.set_conditions(0)
        for h in scenario.HOSTS:
            spec = (f"tflops={h.tflops},memory_gb={h.memory_gb},price_per_hour="
                    f"{h.price_per_hour},power_watts={h.power_watts},count={h.count}")
            self.procs.start(f"agent-{h.name}", [
                PY, "-m", "hetpilot", "agent", "--daemon", self.address, "--host", h.name,
                "--probe-listen", "127.0.0.1:0", "--token-file", str(self.work / "cluster.token"),
                "--state-dir", str(self.work / f"agent-{h.name}"), "--emulate", spec, "--emulate-file", str(self.emu),
                "--link-probe-interval", "600"])
        for name in (f"agent-{h.name}" for h in scenario.HOSTS):
            _wait(lambda: "registered with" in self.procs.log(name),  # noqa: B023 - waited here
                  60, f"{name} to register (run/{name}.log)")
        self.say(f"daemon on {self.address}; 3 agents, 4 EMULATED devices: " + ", ".join(
            f"{d} {h.tflops:g} TFLOP/s ${h.price_per_hour:g}/h" for d, h in scenario.DEVICES))

    def _stub(self) -> tuple[Any, Any]:
        from hetpilot.v1 import job_pb2_grpc

        from hetpilot.channel import Endpoint, open_sync

        channel = open_sync(Endpoint(address=self.address))
        return channel, job_pb2_grpc.JobServiceStub(channel)

    def submit(self) -> str:
        from hetpilot.v1 import job_pb2

        from hetpilot.channel import metadata

        from .digits import GLOBAL_BATCH, MICROBATCH

        channel, stub = self._stub()
        with channel:
            info = stub.SubmitJob(job_pb2.SubmitJobRequest(
                name="digits-mlp", profile_on_attach=True, global_batch=GLOBAL_BATCH,
                microbatch_size=MICROBATCH, budgets=scenario.BUDGET, v=scenario.V, slot_s=0.5),
                metadata=metadata(self.owner_token), timeout=10)
        # the trainer ranks get the job's own token, not the cluster's
        (self.work / "trainer.token").write_text(info.trainer_token + "\n")
        return str(info.job_id)

    def job_info(self) -> dict[str, Any]:
        from google.protobuf.json_format import MessageToDict
        from hetpilot.v1 import job_pb2

        from hetpilot.channel import metadata

        channel, stub = self._stub()
        with channel:
            info = stub.GetJob(job_pb2.GetJobRequest(job_id=self.job_id),
                               metadata=metadata(self.owner_token), timeout=5)
        return MessageToDict(info, preserving_proto_field_name=True)

    def plans(self, newest: int) -> list[dict[str, Any]]:
        from hetpilot.v1 import job_pb2

        from hetpilot.channel import metadata

        out: list[dict[str, Any]] = []
        if newest < 1:
            return out
        channel, stub = self._stub()
        with channel:
            stream = stub.WatchPlans(job_pb2.WatchPlansRequest(job_id=self.job_id),
                                     metadata=metadata(self.owner_token), timeout=15)
            for pv in stream:
                out.append({"version": pv.version, "plan": json.loads(pv.plan_json),
                            "iteration_s": pv.iteration_s, "slot": pv.slot,
                            "costs": dict(pv.costs), "switch_cost_s": pv.switch_cost_s})
                if pv.version >= newest:
                    stream.cancel()
                    break
        return out

    # -- phases ----------------------------------------------------------------

    def run_phase(self, name: str, source_args: list[str], timeout_s: float) -> PhaseResult:
        from hetpilot.trainer.launch import free_port

        phase = PhaseResult(name)
        self.phase = phase
        self.phases.append(phase)
        self.set_conditions(0)
        ckpt, report = self.work / f"ckpt-{name}", self.work / f"report-{name}.jsonl"
        port = free_port()
        world = len(scenario.DEVICES)
        started = time.monotonic()
        names = set()
        for rank, (device, _) in enumerate(scenario.DEVICES):
            names.add(f"{name}-rank{rank}")
            self.procs.start(f"{name}-rank{rank}", [
                PY, "-m", "hetpilot", "train", "--model", "hetpilot.demo.digits:job",
                *source_args, "--epochs", str(self.epochs), "--device-id", device,
                "--emulate-file", str(self.emu), "--checkpoint", str(ckpt),
                "--report", str(report), "--log-format", "json"], env=_env(rank, world, port), stdout_pipe=rank == 0)
        rank0 = next(p for n, p in self.procs.procs if n == f"{name}-rank0")
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert rank0.stdout is not None
            for line in rank0.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        acc_seen: tuple[int, int] | None = None
        accuracy: dict[int, float] = {}
        deadline = started + timeout_s
        done = False
        last_epoch = -1
        while not done:
            if time.monotonic() > deadline:
                raise DemoError(f"{name} phase: over {timeout_s:g} s")
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                line = ""
            if line is None:
                done = True
            elif line.startswith("{"):
                record = json.loads(line)
                if record.get("closed_by") == "switch":
                    phase.switches.append((int(record["epoch"]), float(record["unix_s"])))
                if record.get("closed_by", "epoch") != "epoch":
                    continue
                last_epoch = epoch = int(record["epoch"])
                for ev in self.events:
                    if ev.epoch == epoch + 1:
                        self.set_conditions(ev.epoch)
                        phase.events.append((ev.epoch, ev.text))
                        phase.event_unix_s.append(time.time())
                        self.say(f"[{name}] from epoch {ev.epoch + 1}: {ev.text}")
                if name == "hetpilot" and self.job_id:
                    # the live view may miss a beat; the report asks again at the end
                    with contextlib.suppress(Exception):
                        self.job = self.job_info()
            self._collect(phase, report, started, rank0_epoch=last_epoch)
            acc_seen = self._accuracy(ckpt, acc_seen, accuracy)
            for row in phase.rows:
                if row.accuracy is None and row.epoch in accuracy:
                    row.accuracy = accuracy[row.epoch]
            self.on_update(self)
        for rank, (_, proc) in enumerate(p for p in self.procs.procs if p[0] in names):
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except Exception:
                raise DemoError(f"{name} rank {rank} did not exit") from None
            if proc.returncode != 0:
                tail = self.procs.log(f"{name}-rank{rank}")[-2000:]
                raise DemoError(f"{name} rank {rank} exited {proc.returncode}:\n{tail}")
        phase.wall_s = time.monotonic() - started
        self._accuracy(ckpt, acc_seen, accuracy)
        self._collect(phase, report, started, rank0_epoch=self.epochs - 1)
        for row in phase.rows:
            if row.accuracy is None:
                row.accuracy = accuracy.get(row.epoch)
        self.on_update(self)
        return phase

    @staticmethod
    def _accuracy(ckpt: Path, seen: tuple[int, int] | None,
                  accuracy: dict[int, float]) -> tuple[int, int] | None:
        """Score the newest checkpoint once (the trainer commits a new one after every epoch)."""
        from hetpilot.trainer.checkpoint import resolve

        from .digits import held_out_accuracy

        where = resolve(ckpt)
        if where is None:
            return seen
        meta = where / "meta.json"
        try:
            st = meta.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == seen:
                return seen
            epoch = int(json.loads(meta.read_text())["epoch"]) - 1
            acc = held_out_accuracy(where)
            st2 = meta.stat()
        except (OSError, ValueError, KeyError, RuntimeError, EOFError):
            return seen
        if (st2.st_mtime_ns, st2.st_size) == stamp:  # not pruned and remade while we read
            accuracy[epoch] = acc
        return stamp

    def _collect(self, phase: PhaseResult, report: Path, started: float,
                 rank0_epoch: int) -> None:
        """Epoch rows from the ranks' records (every rank's, rank 0 gathers with --daemon)."""
        try:
            records = [json.loads(x) for x in report.read_text().splitlines() if x.strip()]
        except (OSError, ValueError):
            return
        # per epoch, per rank: its records (several slots), complete once one closes the epoch
        by_epoch: dict[int, dict[str, list[dict[str, Any]]]] = {}
        for r in records:
            by_epoch.setdefault(int(r["epoch"]), {}).setdefault(r["device_id"], []).append(r)
        price = {d: h.price_per_hour for d, h in scenario.DEVICES}
        known = {row.epoch: row for row in phase.rows}
        now = time.monotonic() - started
        for epoch in sorted(by_epoch):
            ranks = by_epoch[epoch]
            if epoch in known or epoch > rank0_epoch or len(ranks) < len(scenario.DEVICES) \
                    or any(recs[-1].get("closed_by", "epoch") != "epoch"
                           for recs in ranks.values()):
                continue
            # the epoch's mean iteration on each rank; rows show the slowest working rank
            totals = {d: (sum(float(r["iteration_s"]) * int(r["iterations"]) for r in recs),
                          sum(int(r["iterations"]) for r in recs)) for d, recs in ranks.items()}
            working = [recs[-1] for recs in ranks.values() if recs[-1].get("group") is not None]
            slowest = max(working, key=lambda r: totals[r["device_id"]][0])
            wall, iterations = totals[slowest["device_id"]]
            devices = tuple(sorted(r["device_id"] for r in working))
            row = EpochRow(
                epoch=epoch, plan_version=int(slowest["plan_version"]),
                iteration_s=wall / max(iterations, 1), epoch_s=wall, devices=devices,
                samples={r["device_id"]: int(r["group_samples"]) for r in working
                         if r.get("stage") == 0},
                cost_per_hour=sum(price[d] for d in devices), wall_s=now)
            phase.rows.append(row)
        phase.rows.sort(key=lambda r: r.epoch)

    # -- whole run ---------------------------------------------------------------

    def run(self, phase_timeout_s: float) -> RunResult:
        t0 = time.monotonic()
        self.start_control_plane()
        plan_file = self.work / "even-dp.json"
        plan_file.write_text(json.dumps(scenario.even_plan(), indent=1))
        self.say("static phase: even data parallelism (16 samples per device), "
                 f"{self.epochs} epochs")
        static = self.run_phase("static", ["--plan", str(plan_file)], phase_timeout_s)
        self.job_id = self.submit()
        self.say(f"hetpilot phase: job {self.job_id} (budget ${scenario.BUDGET['price_per_hour']:g}"
                 f"/h, V={scenario.V:g}); the daemon plans, the trainer follows")
        het = self.run_phase("hetpilot", [
            "--daemon", self.address, "--job", self.job_id, "--token-file",
            str(self.work / "trainer.token"), "--plan-wait", "60"], phase_timeout_s)
        self.job = self.job_info()
        plans = self.plans(int(self.job.get("plan_version", 0)))
        return RunResult(epochs=self.epochs, static=static, hetpilot=het, plans=plans,
                         job=self.job, total_s=time.monotonic() - t0)


def run_demo(out: Path, epochs: int, on_update: Callable[[Demo], None],
             phase_timeout_s: float = 240.0) -> RunResult:
    """Run both phases; every child process is stopped before this returns or raises."""
    demo = Demo(out, epochs, on_update)
    try:
        return demo.run(phase_timeout_s)
    finally:
        demo.procs.stop_all()
