"""Plans from the daemon and stage timings back to it, over ``hetpilot.v1.TrainerService``.

Only rank 0 talks to the daemon: a plan is parsed here, once, from the proto's JSON into
the :class:`~hetpilot.planner.types.Plan` dataclass, which
:mod:`~hetpilot.trainer.planfeed` broadcasts to the other ranks as it is; every rank's
record is gathered to rank 0 for the reporter (:mod:`~hetpilot.trainer.records`):

* :class:`DaemonLink`: one channel (TLS and bearer-token metadata from
  :mod:`hetpilot.channel`, whose service config retries the unary calls
  on UNAVAILABLE), a deadline on every unary call;
* :class:`GrpcPlanSource`: Attach for every rank (rank 0 carries the model
  profile for ``profile_on_attach`` jobs; each rank its device's measured layer
  times when the trainer measured them, :mod:`hetpilot.trainer.speeds`, so the
  daemon plans with the job's real speeds; :meth:`GrpcPlanSource.update_measurements`
  sends new ones, e.g. after a plan changed the microbatch size, and it keeps
  the job's slot settings the daemon answered), then a background thread follows
  ``WatchPlans`` from the newest version it has; when the stream breaks it
  re-attaches and resumes with exponential backoff (0.2 s doubling to 5 s, with
  jitter). ``poll`` never blocks once a plan is known and never raises: while
  the daemon is away the trainer keeps running its last plan;
* :class:`GrpcReporter`: sends each rank's epoch record as a
  ``StageTimingsReport`` from a sender thread with a bounded queue, so a slow or
  absent daemon never stalls training (reports that cannot be sent are dropped
  and counted);
* :meth:`GrpcPlanSource.finish`: when training returns (SUCCEEDED) or rank 0's
  training loop raises on torchrun's last attempt (FAILED, with the error), it
  tells the daemon (``FinishJob``), after stopping the plan watcher: a watcher
  re-attaching after the job ended would make a failed job run again. A failure
  torchrun will restart (restarts left) is not reported; a rank killed outright
  reports nothing (see docs/operating.md, "Job lifecycle").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import plan_from_dict
from hetpilot.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

from hetpilot.channel import Endpoint, metadata, open_sync

from .plans import PlanVersion

__all__ = ["Backoff", "DaemonError", "DaemonLink", "GrpcPlanSource", "GrpcReporter",
           "Measurement", "restarts_left"]

Measurement = Mapping[str, Any]
"""One rank's measured layer times: ``{"microbatch": m, "dtype": "bfloat16",
"layers": {layer: (fwd_s, bwd_s)}}`` (:func:`hetpilot.trainer.speeds.as_measurement`), and
optionally ``"links": {peer device id: (latency_s, gbps)}``
(:func:`hetpilot.trainer.linkprobe.link_entries`)."""

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


def restarts_left() -> int:
    """How many more times torchrun's agent would restart this worker group (0 outside
    torchrun). Its count is per agent (node), which is what decides whether this rank 0
    comes back."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
                   - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


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

    def attach(self, rank: int, world_size: int, device_id: str, model_json: str = "",
               measurement: Measurement | None = None) -> common_pb2.PlanVersion:
        """Attach one rank; the latest plan (version 0: none yet)."""
        plan: common_pb2.PlanVersion = self.attach_response(
            rank, world_size, device_id, model_json, measurement).plan
        return plan

    def attach_response(self, rank: int, world_size: int, device_id: str,
                        model_json: str = "", measurement: Measurement | None = None,
                        tensor_parallel: bool = False) -> trainer_pb2.AttachResponse:
        """Attach one rank with its measured layer times, if any; the whole answer (the
        latest plan and the job's slot settings). ``tensor_parallel``: this trainer runs
        tensor-parallel stages (the job has a ``tp_plan``), so the daemon may plan them."""
        req = trainer_pb2.AttachRequest(job_id=self.job_id, rank=rank, world_size=world_size,
                                        device_id=device_id, model_json=model_json,
                                        tensor_parallel=tensor_parallel)
        if measurement:
            req.measured_microbatch = int(measurement["microbatch"])
            req.measured_dtype = str(measurement.get("dtype", ""))
            req.layer_times.extend(
                trainer_pb2.LayerTiming(layer=int(layer), fwd_s=float(f), bwd_s=float(b))
                for layer, (f, b) in sorted(measurement["layers"].items(),
                                            key=lambda kv: int(kv[0])))
            req.link_times.extend(
                trainer_pb2.LinkTiming(peer_device_id=str(peer), latency_s=float(lat),
                                       gbps=float(gbps))
                for peer, (lat, gbps) in sorted(measurement.get("links", {}).items()))
        resp: trainer_pb2.AttachResponse = self.stub.Attach(
            req, metadata=self.metadata, timeout=self.timeout_s)
        return resp

    def finish(self, succeeded: bool, reason: str = "") -> bool:
        """Tell the daemon the job ended (FinishJob); True when it took it. Never raises:
        training is over either way, so a daemon that is away or refuses only costs a
        warning (the channel retries UNAVAILABLE)."""
        outcome = (trainer_pb2.JOB_OUTCOME_SUCCEEDED if succeeded
                   else trainer_pb2.JOB_OUTCOME_FAILED)
        try:
            self.stub.FinishJob(trainer_pb2.FinishJobRequest(
                job_id=self.job_id, outcome=outcome, reason=reason[:2000]),
                metadata=self.metadata, timeout=self.timeout_s)
            return True
        except grpc.RpcError as exc:
            code = _code(exc)
            log.warning("could not tell the daemon that job %s %s (%s: %s)", self.job_id,
                        "succeeded" if succeeded else "failed", code.name if code else "?",
                        _details(exc))
            return False

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
        measurements: Sequence[Measurement | None] | None = None,
        tensor_parallel: bool = False,
    ) -> None:
        self.link = link
        self.tensor_parallel = tensor_parallel
        """Every attach says this trainer runs tensor-parallel stages (a job with a tp_plan)."""
        self.device_ids = list(device_ids)
        """Device id of each rank, in rank order (every rank is attached by rank 0)."""
        self.model_json = model_json
        self._pending = self._per_rank(measurements)
        """Each rank's measured layer times not yet delivered (None: nothing to send)."""
        self._measure_lock = threading.Lock()
        self._retry: threading.Thread | None = None
        self.slot_iterations = 0
        """The job's slot length in reported iterations (0: slots of ``slot_s``), as the
        daemon last answered an Attach."""
        self.slot_s = 0.0
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

    def poll(self, after_version: int, *, epoch: int = 0, step: int = 0
             ) -> PlanVersion | None:
        """The newest plan the daemon published above ``after_version``; never blocks or raises
        (the daemon times its plans itself: the position is not used)."""
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

    def _per_rank(self, measurements: Sequence[Measurement | None] | None
                  ) -> list[Measurement | None]:
        per_rank = list(measurements or [])
        if len(per_rank) > len(self.device_ids):
            raise ValueError(f"measurements for {len(per_rank)} ranks, but "
                             f"{len(self.device_ids)} device ids")
        return per_rank + [None] * (len(self.device_ids) - len(per_rank))

    def _attach_all(self) -> bool:
        """Attach every rank, each with its measurement not yet delivered (the daemon
        keeps a delivered one, restarts included, so re-attaches send none). False when
        the daemon refused a measurement (INVALID_ARGUMENT): it is logged and dropped,
        and the rank attached without it, so a bad one never blocks attaching."""
        world = len(self.device_ids)
        delivered = True
        for rank, device in enumerate(self.device_ids):
            model = self.model_json if rank == 0 else ""
            with self._measure_lock:
                measurement = self._pending[rank]
            try:
                resp = self.link.attach_response(rank, world, device, model, measurement,
                                                 self.tensor_parallel)
            except grpc.RpcError as exc:
                if measurement is None or _code(exc) != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                log.warning("the daemon refused rank %d's measured layer times (%s); "
                            "dropped", rank, _details(exc))
                delivered = False
                resp = self.link.attach_response(rank, world, device, model, None,
                                                 self.tensor_parallel)
            with self._measure_lock:
                if self._pending[rank] is measurement:
                    self._pending[rank] = None
            self.slot_iterations, self.slot_s = int(resp.slot_iterations), float(resp.slot_s)
            self._offer(resp.plan)
        return delivered

    def update_measurements(self, measurements: Sequence[Measurement | None]) -> bool:
        """Send new measured layer times (a list indexed by rank; None: nothing new for
        that rank) by attaching every rank again. True when the daemon took them all.
        Never raises for the daemon: after a transient failure a background thread
        retries with backoff (a re-attach of the plan watcher sends them too); a refused
        measurement is logged and dropped (see :meth:`_attach_all`)."""
        new = self._per_rank(measurements)
        with self._measure_lock:
            self._pending = [n if n is not None else p
                             for n, p in zip(new, self._pending, strict=True)]
        try:
            return self._attach_all()
        except grpc.RpcError as exc:
            code = _code(exc)
            self.last_error = f"{code.name if code else '?'}: {_details(exc)}"
            if code in TRANSIENT:
                log.warning("measured layer times not delivered yet (%s); retrying",
                            self.last_error)
                self._retry_later()
            else:
                log.warning("attaching with new measured layer times failed (%s)",
                            self.last_error)
            return False

    def _retry_later(self) -> None:
        if self._retry is not None and self._retry.is_alive():
            return  # it sends the newest measurements on its next try

        def retry() -> None:
            backoff = Backoff(self._backoff.initial_s, self._backoff.max_s)
            while not self._stop.wait(backoff.next()):
                try:
                    self._attach_all()
                    return
                except grpc.RpcError as exc:
                    if _code(exc) not in TRANSIENT:
                        log.warning("re-attaching with measured layer times failed (%s)",
                                    _details(exc))
                        return
                except Exception:  # never let it kill training
                    log.exception("re-sending the measured layer times failed")
                    return

        self._retry = threading.Thread(target=retry, name="hetpilot-measurements",
                                       daemon=True)
        self._retry.start()

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

    def finish(self, error: BaseException | None = None,
               reporter: GrpcReporter | None = None) -> bool:
        """Training ended: SUCCEEDED without ``error``, else FAILED with it, unless
        torchrun will restart the workers (then nothing is said: the restart attaches
        again). Stops the plan watcher first, and delivers what ``reporter`` holds (the
        last loss belongs to the job before it ends). True when the daemon took it."""
        self.close()
        if reporter is not None:
            reporter.close()
        if error is None:
            return self.link.finish(True, "finished")
        if restarts_left():
            log.warning("training failed (%s); torchrun restarts it (%d restart(s) left): "
                        "not reported to the daemon", error, restarts_left())
            return False
        return self.link.finish(False, f"{type(error).__name__}: {error}")


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
        """Deliver what is queued (up to ``timeout_s``), then stop the sender. Again: no-op."""
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
