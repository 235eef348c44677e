"""Plans from the daemon and stage timings back to it, over ``hetpilot.v1.TrainerService``.

Only rank 0 talks to the daemon (the runtime broadcasts what its source
returns, and gathers every rank's epoch record to rank 0 for the reporter):

* :class:`DaemonLink`: one channel (TLS and bearer-token metadata from
  :mod:`hetpilot.client.channel`, whose service config retries the unary calls
  on UNAVAILABLE), a deadline on every unary call;
* :class:`GrpcPlanSource`: Attach for every rank (rank 0 carries the model
  profile for ``profile_on_attach`` jobs), then a background thread follows
  ``WatchPlans`` from the newest version it has; when the stream breaks it
  re-attaches and resumes with exponential backoff (0.2 s doubling to 5 s, with
  jitter). ``poll`` never blocks once a plan is known and never raises: while
  the daemon is away the trainer keeps running its last plan;
* :class:`GrpcReporter`: sends each rank's epoch record as a
  ``StageTimingsReport`` from a sender thread with a bounded queue, so a slow or
  absent daemon never stalls training (reports that cannot be sent are dropped
  and counted).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
from hetpilot.client.channel import Endpoint, metadata, open_sync
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import plan_from_dict
from hetpilot.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

from .plans import PlanVersion

__all__ = ["Backoff", "DaemonError", "DaemonLink", "GrpcPlanSource", "GrpcReporter"]

log = logging.getLogger("hetpilot.trainer.daemon")

#: Status codes worth waiting out: the daemon restarts, is overloaded, or the network blips.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})


class DaemonError(RuntimeError):
    """The daemon refused for good (bad token, no such job, cancelled job) or never answered."""

    def __init__(self, code: grpc.StatusCode | None, message: str) -> None:
        super().__init__(f"{code.name}: {message}" if code is not None else message)
        self.code = code


def _code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    code = exc.code() if hasattr(exc, "code") else None
    return code if isinstance(code, grpc.StatusCode) else None


def _details(exc: grpc.RpcError) -> str:
    return str(exc.details()) if hasattr(exc, "details") else str(exc)


class Backoff:
    """Exponential backoff with +-20% jitter."""

    def __init__(self, initial_s: float = 0.2, max_s: float = 5.0, factor: float = 2.0) -> None:
        self.initial_s, self.max_s, self.factor = initial_s, max_s, factor
        self._next = initial_s

    def reset(self) -> None:
        self._next = self.initial_s

    def next(self) -> float:
        wait = self._next * random.uniform(0.8, 1.2)
        self._next = min(self.max_s, self._next * self.factor)
        return wait


class DaemonLink:
    """One channel to the daemon for one job; unary calls get ``timeout_s`` deadlines."""

    def __init__(self, endpoint: Endpoint, job_id: str, *, timeout_s: float = 5.0) -> None:
        if not job_id:
            raise ValueError("--job: a job id is needed with --daemon")
        self.endpoint = endpoint
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.channel = open_sync(endpoint)
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self.channel)
        self.metadata = metadata(endpoint.token)

    def attach(self, rank: int, world_size: int, device_id: str,
               model_json: str = "") -> common_pb2.PlanVersion:
        resp = self.stub.Attach(
            trainer_pb2.AttachRequest(job_id=self.job_id, rank=rank, world_size=world_size,
                                      device_id=device_id, model_json=model_json),
            metadata=self.metadata, timeout=self.timeout_s)
        plan: common_pb2.PlanVersion = resp.plan
        return plan

    def close(self) -> None:
        self.channel.close()


class GrpcPlanSource:
    """A :class:`~hetpilot.trainer.plans.PlanSource` fed by the daemon (rank 0 only)."""

    def __init__(
        self,
        link: DaemonLink,
        device_ids: Sequence[str],
        *,
        model_json: str = "",
        backoff: Backoff | None = None,
    ) -> None:
        self.link = link
        self.device_ids = list(device_ids)
        """Device id of each rank, in rank order (every rank is attached by rank 0)."""
        self.model_json = model_json
        self._backoff = backoff or Backoff()
        self._cond = threading.Condition()
        self._latest: PlanVersion | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._call: Any = None
        self.connected = False
        """Whether the WatchPlans stream is up now."""
        self.reconnects = 0
        self.last_error = ""

    # -- plans ------------------------------------------------------------------

    @property
    def latest_version(self) -> int:
        with self._cond:
            return self._latest.version if self._latest is not None else 0

    def _offer(self, pv: common_pb2.PlanVersion) -> None:
        if pv.version == 0 or pv.version <= self.latest_version:
            return
        try:
            plan = plan_from_dict(json.loads(pv.plan_json), path="plan_json")
        except (ValueError, ValidationError) as exc:
            log.warning("daemon plan version %d is malformed, ignored: %s", pv.version, exc)
            return
        with self._cond:
            if self._latest is None or pv.version > self._latest.version:
                self._latest = PlanVersion(int(pv.version), plan)
                self._cond.notify_all()

    def poll(self, after_version: int) -> PlanVersion | None:
        """The newest plan the daemon published above ``after_version``; never blocks or raises."""
        with self._cond:
            latest = self._latest
        return latest if latest is not None and latest.version > after_version else None

    def wait_first(self, timeout_s: float) -> PlanVersion:
        """Block until the daemon has published a plan; DaemonError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._latest is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonError(None, f"no plan from the daemon within {timeout_s:g} s "
                                            f"(job {self.link.job_id}; last error: "
                                            f"{self.last_error or 'none'})")
                self._cond.wait(min(left, 0.5))
            return self._latest

    # -- connection ---------------------------------------------------------------

    def _attach_all(self) -> None:
        world = len(self.device_ids)
        for rank, device in enumerate(self.device_ids):
            pv = self.link.attach(rank, world, device, self.model_json if rank == 0 else "")
            self._offer(pv)

    def start(self, timeout_s: float = 60.0) -> None:
        """Attach every rank (waiting out an absent daemon up to ``timeout_s``), then follow
        WatchPlans in a background thread. Raises DaemonError on a lasting refusal."""
        deadline = time.monotonic() + timeout_s
        backoff = Backoff(self._backoff.initial_s, self._backoff.max_s)
        while True:
            try:
                self._attach_all()
                break
            except grpc.RpcError as exc:
                code = _code(exc)
                if code not in TRANSIENT:
                    raise DaemonError(code, _details(exc)) from None
                self.last_error = f"{code.name if code else '?'}: {_details(exc)}"
                if time.monotonic() >= deadline:
                    raise DaemonError(code, f"daemon {self.link.endpoint.address} did not "
                                            f"answer within {timeout_s:g} s: {_details(exc)}"
                                      ) from None
                time.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))
        self._thread = threading.Thread(target=self._follow, name="hetpilot-watch-plans",
                                        daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        attached = True
        while not self._stop.is_set():
            try:
                if not attached:
                    self._attach_all()
                    attached = True
                self._call = self.link.stub.WatchPlans(
                    trainer_pb2.TrainerWatchRequest(job_id=self.link.job_id,
                                                    after_version=self.latest_version),
                    metadata=self.link.metadata)
                self.connected = True
                for pv in self._call:
                    self._offer(pv)
                    self._backoff.reset()
                self.last_error = "stream ended (job ended or daemon stopping)"
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    break
                code = _code(exc)
                self.last_error = f"{code.name if code else '?'}: {_details(exc)}"
                if self.connected:
                    log.warning("daemon plan stream lost (%s); keeping plan version %d, "
                                "reconnecting", self.last_error, self.latest_version)
            except Exception as exc:  # never let the watcher kill training
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("daemon plan watcher failed; retrying")
            self.connected = False
            attached = False
            self.reconnects += 1
            self._stop.wait(self._backoff.next())

    def close(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)


class GrpcReporter:
    """Sends epoch records (``Trainer`` reports) as ``ReportStageTimings``, off the training path.

    A record becomes one StageTiming: ``fwd_s``/``bwd_s`` per microbatch, ``comm_s`` the
    seconds per iteration blocked in receives plus gradient sync, ``samples_per_s`` the
    group's samples per second. The record's ``loss`` and ``eval_metric``, when present and
    not None, go along as they are (NaN included: the job owner sees a diverged run).
    Records of ranks a plan leaves idle are not sent.
    """

    def __init__(self, link: DaemonLink, *, max_queue: int = 256) -> None:
        self.link = link
        self._queue: queue.Queue[trainer_pb2.StageTimingsReport | None] = queue.Queue(max_queue)
        self.sent = 0
        self.dropped = 0
        self.last_error = ""
        self._thread = threading.Thread(target=self._send_loop, name="hetpilot-report",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def to_proto(job_id: str, record: dict[str, Any]) -> trainer_pb2.StageTimingsReport | None:
        if record.get("stage") is None:
            return None
        it_s = float(record.get("iteration_s") or 0.0)
        samples = float(record.get("group_samples") or 0.0)
        req = trainer_pb2.StageTimingsReport(
            job_id=job_id, rank=int(record["rank"]), plan_version=int(record["plan_version"]),
            iteration=int(record["step"]),
            stages=[trainer_pb2.StageTiming(
                stage_index=int(record["stage"]), device_id=str(record["device_id"]),
                fwd_s=float(record["fwd_s"]), bwd_s=float(record["bwd_s"]),
                comm_s=float(record["transfer_wait_s"]) + float(record["sync_s"]),
                samples_per_s=samples / it_s if it_s > 0 else 0.0)])
        if record.get("loss") is not None:
            req.loss = float(record["loss"])
        if record.get("eval_metric") is not None:
            req.eval_metric = float(record["eval_metric"])
        return req

    def __call__(self, record: dict[str, Any]) -> None:
        req = self.to_proto(self.link.job_id, record)
        if req is None:
            return
        try:
            self._queue.put_nowait(req)
        except queue.Full:
            self.dropped += 1

    def _send_loop(self) -> None:
        warned = False
        while True:
            req = self._queue.get()
            try:
                if req is None:
                    return
                try:
                    self.link.stub.ReportStageTimings(req, metadata=self.link.metadata,
                                                      timeout=self.link.timeout_s)
                    self.sent += 1
                    warned = False
                except grpc.RpcError as exc:
                    self.dropped += 1
                    code = _code(exc)
                    self.last_error = f"{code.name if code else '?'}: {_details(exc)}"
                    if not warned:
                        log.warning("stage timings not delivered (%s); training goes on",
                                    self.last_error)
                        warned = True
            finally:
                self._queue.task_done()

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (up to ``timeout_s``), then stop the sender."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
