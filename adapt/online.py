"""The estimator inside the daemon: features from reports, samples from timings.

:class:`Adapter` is what :class:`hetpilot.daemon.controlplane.ControlPlane` holds.

- :meth:`Adapter.note_report` keeps each link's last round-trip times (their
  standard deviation is the jitter feature: no new report field needed);
- :meth:`Adapter.learn` turns a trainer's stage timings into samples: the
  stage's measured time (``fwd_s + bwd_s`` for one iteration) over its quiet
  time (the stage's GFLOP at the device's registered TFLOP/s, calibrated by
  the smallest ratio seen on that device, so the quietest iteration seen is
  slowdown 1), with the features of the device's latest report, the
  stage's workload and the history before it (that stage's last slowdown on
  that device, the device's last slowdown on any stage); it also remembers
  that workload as the device's, and the slowdown as both histories;
- :meth:`Adapter.predict_tflops` gives the speed the controller plans with:
  registered TFLOP/s over the predicted slowdown for the workload the device
  runs (when it runs none yet: the model's mean layer times the microbatch if
  given, else the median workload of the bootstrap set), with the history of
  that workload on that device (0: never run there, e.g. after a re-cut).

The forest is fitted on the bootstrap set in a background thread at start;
until it is ready (or if scikit-learn fails) :meth:`predict_tflops` returns
None and the daemon keeps its former rule (measured TFLOP/s times
``1 - colocated_load``).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from .estimator import SlowdownEstimator, load_bootstrap
from .features import FEATURES, WORKLOAD, History, Interference, Workload, row, workload_of

__all__ = ["Adapter"]

_SMALLEST_RATIO = 1e-12
"""Measured over predicted stage time below this is not a timing (a stage a trillion
times faster than its device's registered speed): ignored, never a calibration."""

log = logging.getLogger("hetpilot.adapt")

_RTT_KEEP = 8


class Adapter:
    def __init__(self, estimator: SlowdownEstimator | None = None, *, warm: bool = True,
                 default_workload: Workload | None = None) -> None:
        self._est = estimator
        self._ready = threading.Event()
        self._rtts: dict[tuple[str, str], deque[float]] = {}
        self._workload: dict[str, Workload] = {}
        self._calib: dict[str, float] = {}
        self._last_stage: dict[tuple[str, Workload], float] = {}
        self._last_device: dict[str, float] = {}
        self._default = default_workload
        self.learned = 0
        if warm:
            threading.Thread(target=self._warm, name="rf-bootstrap", daemon=True).start()

    def _warm(self) -> None:
        try:
            if self._est is None or self._default is None:
                data = load_bootstrap()
                med = {name: float(statistics.median(data.X[:, i]))
                       for i, name in enumerate(FEATURES) if name in WORKLOAD[:-1]}
                self._default = self._default or Workload(**med)
                self._est = self._est or SlowdownEstimator(data)
            self._est.fit()
            self._ready.set()
        except Exception:  # no data, no sklearn: the daemon keeps its former rule
            log.exception("slowdown estimator unavailable")

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    @property
    def estimator(self) -> SlowdownEstimator | None:
        return self._est if self._ready.is_set() else None

    # -- inputs --------------------------------------------------------------

    def note_report(self, host: str, links: Sequence[Any]) -> None:
        for link in links:
            q = self._rtts.setdefault((host, link.peer_host), deque(maxlen=_RTT_KEEP))
            q.append(float(link.rtt_us))

    def interference(self, host: str, dev: Any, registered_tflops: float) -> Interference:
        """Features of one device's latest report (``dev``: a DeviceReport)."""
        rtts = [r for (h, _), q in self._rtts.items() if h == host for r in q]
        per_link = [statistics.pstdev(q) for (h, _), q in self._rtts.items()
                    if h == host and len(q) > 1]
        total = float(getattr(dev, "memory_total_gb", 0.0))
        free = float(getattr(dev, "memory_free_gb", 0.0))
        return Interference(
            utilization=float(dev.utilization), colocated_load=float(dev.colocated_load),
            colocated_processes=float(dev.colocated_processes),
            memory_used=(1.0 - free / total) if total > 0 else 0.0,
            probe_ratio=float(dev.tflops) / registered_tflops if registered_tflops > 0 else 1.0,
            rtt_us=statistics.median(rtts) if rtts else 0.0,
            rtt_jitter_us=max(per_link) if per_link else 0.0,
        )

    def learn(self, device_id: str, inter: Interference, layers: Sequence[Any], microbatch: int,
              samples: int, measured_s: float, registered_tflops: float) -> None:
        """One stage timing of one iteration (``layers``: spec section 2 layers)."""
        work = workload_of(layers, microbatch)
        self._workload[device_id] = work
        gflop = samples * sum(float(x.fwd_gflop) + float(x.bwd_gflop) for x in layers)
        if registered_tflops <= 0 or gflop <= 0 or measured_s <= 0:
            return
        raw = measured_s / (gflop / (1000.0 * registered_tflops))
        if not (math.isfinite(raw) and raw >= _SMALLEST_RATIO):
            # a subnormal or zero time (5e-324 s passes the servicer's ">= 0, finite"): as
            # the calibration it would make every later slowdown infinite
            return
        calib = min(self._calib.get(device_id, raw), raw)
        slowdown = raw / calib
        if not math.isfinite(slowdown):
            return
        self._calib[device_id] = calib
        est = self.estimator
        if est is not None:
            est.observe(row(inter, work, self.history(device_id, work)), slowdown)
            self.learned += 1
        self._last_stage[(device_id, work)] = slowdown
        self._last_device[device_id] = slowdown

    def history(self, device_id: str, work: Workload) -> History:
        """What the trainer reported last for this workload and this device."""
        return History(stage_last_slowdown=self._last_stage.get((device_id, work), 0.0),
                       device_last_slowdown=self._last_device.get(device_id, 0.0))

    # -- output --------------------------------------------------------------

    def predict_tflops(self, device_id: str, inter: Interference, registered_tflops: float,
                       model_layers: Sequence[Any] | None = None,
                       microbatch: int = 1) -> float | None:
        est = self.estimator
        if est is None:
            return None
        work = self._workload.get(device_id)
        if work is None and model_layers:
            work = workload_of([_MeanLayer(model_layers)], microbatch)
        if work is None:
            work = self._default
        if work is None:
            return None
        try:
            slowdown = max(est.predict_one(row(inter, work, self.history(device_id, work))), 1.0)
        except Exception:
            log.exception("slowdown prediction failed")
            return None
        return registered_tflops / slowdown

    def status(self) -> Mapping[str, float]:
        est = self.estimator
        out = {"ready": float(est is not None), "learned": float(self.learned)}
        if est is not None:
            out.update(est.error())
        return out


class _MeanLayer:
    """The model's average layer (a device that runs no stage yet)."""

    def __init__(self, layers: Sequence[Any]) -> None:
        n = len(layers)
        self.name = "mean"
        for f in ("fwd_gflop", "bwd_gflop", "param_mb", "act_mb", "out_mb"):
            setattr(self, f, sum(float(getattr(x, f)) for x in layers) / n)
