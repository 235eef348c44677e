"""Layer times kept true to what each stage takes in training, so the daemon keeps
learning from stage timings.

Why: the layer times a rank sends on Attach (:mod:`hetpilot.trainer.speeds`) are one
measurement, taken once before the job runs, one layer class at a time. It can be off
for the whole run. On an H100, a GPT-2 block at microbatch 8 in bfloat16 (a case bound by
the host's kernel launches) timed 1.7x slower at attach than a minute later in the same
process, and the plan's prediction missed by -37.7% (bench/RESULTS-gpu.md, lease F).
The trainer's stage timings say what the device does in training. So rank 0, which
receives every rank's slot record (``report_from_rank0``), compares each rank's stage time
per microbatch with what that rank's measurement predicts for its stage. When ``confirm``
slots in a row are off by more than ``band`` on the same side, it sends the rank's
measurement again, scaled by the median ratio of those slots and taken at the plan's
microbatch size. The daemon fits it like any measurement
(:meth:`hetpilot.trainer.daemon_link.GrpcPlanSource.update_measurements`): a
measurement without links keeps the links measured before.

The rules, and the choices made:

* **Predicted** time of one microbatch on a stage: the sum over its layers of the
  measured forward and backward, with the forward counted again when the stage
  recomputes (spec 5.2's rule), linear in the microbatch's mean size (the group's
  samples over its number of microbatches) as spec 5.1 takes op times.
* **Measured**: the record's ``fwd_s + bwd_s``, op times per microbatch. The last
  stage's include the loss, as the attach measurement's last layer does.
* **One factor per device.** Every layer of the measurement scales alike, so the
  daemon's fit moves that device's speed and no layer's work. A stage sees only its
  own layers, and a device's error on them is the best guess for the others.
* **Slots not counted**: one opened by a plan switch (its first iterations warm up the
  new layout; a run's first slot is one), one of a plan other than the trainer's
  current, an emulated one (emulated op times are the measurement by construction),
  and a rank with no measurement.
* After a correction the rank's ratios start again from the new measurement.
* **Slowdowns.** The daemon takes a measurement relative to the speed it plans the device
  with when the measurement arrives. So a slowdown that the slowdown estimator already
  predicts is not counted twice. One that it predicts only later would be. Requiring
  ``confirm`` slots in a row keeps short bursts out.
* **Noise.** Three slots, not two: on this project's shared 2-core CPU machine one
  slot's op time per microbatch moves by 10-25% from the next, and with two slots a run
  whose measurement was right was "corrected" away from it
  (``bench/trainer_calibration.py``, bench/RESULTS-trainer.md).

Pure Python: no torch, no gRPC; the CLI wires it (``hetpilot train --daemon``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hetpilot.planner.types import Plan

__all__ = ["StageCalibration", "stage_ratio"]

BAND = 0.10
"""Measured / predicted outside [1 / (1 + BAND), 1 + BAND] counts as off: the project's
10% prediction target."""
CONFIRM = 3
"""Slots in a row that must be off on the same side before a correction."""


def stage_ratio(record: Mapping[str, Any], plan: Plan,
                measurement: Mapping[str, Any]) -> float | None:
    """Measured over predicted stage time per microbatch for one slot record, or None when
    the record says nothing about the measurement (no stage, no ops, a layer not measured)."""
    group, stage = record.get("group"), record.get("stage")
    if group is None or stage is None:
        return None
    try:
        g = plan.groups[int(group)]
        st = g.stages[int(stage)]
    except (IndexError, ValueError, TypeError):
        return None
    layers = measurement.get("layers", {})
    a, b = st.layers
    if a >= b or any(layer not in layers for layer in range(a, b)):
        return None
    fwd = sum(float(layers[layer][0]) for layer in range(a, b))
    bwd = sum(float(layers[layer][1]) for layer in range(a, b))
    if st.recompute:
        bwd += fwd
    m = plan.microbatch_size
    mean_size = g.samples / math.ceil(g.samples / m)
    predicted = (fwd + bwd) * mean_size / float(measurement["microbatch"])
    measured = float(record.get("fwd_s") or 0.0) + float(record.get("bwd_s") or 0.0)
    if not (predicted > 0 and measured > 0 and math.isfinite(measured)):
        return None
    return measured / predicted


def _scaled(measurement: Mapping[str, Any], factor: float, microbatch: int) -> dict[str, Any]:
    """``measurement`` times ``factor``, at ``microbatch`` samples (linear), without links."""
    k = factor * microbatch / float(measurement["microbatch"])
    return {"microbatch": microbatch, "dtype": measurement.get("dtype", ""),
            "layers": {layer: (float(f) * k, float(b) * k)
                       for layer, (f, b) in measurement["layers"].items()}}


class StageCalibration:
    """Rank 0's reporter that corrects each rank's measurement from its stage timings.

    ``measurements``: what each rank sent (None: it sent none); ``plan_of(version)``: the
    plan of that version while it is the trainer's current, else None; ``send(list)``:
    delivers new measurements, a list indexed by rank with None for no change."""

    def __init__(self, measurements: Sequence[Mapping[str, Any] | None],
                 plan_of: Callable[[int], Plan | None],
                 send: Callable[[list[Mapping[str, Any] | None]], Any], *,
                 band: float = BAND, confirm: int = CONFIRM) -> None:
        if not band > 0 or confirm < 1:
            raise ValueError(f"band must be > 0 and confirm >= 1, got {band}, {confirm}")
        self.measurements: list[Mapping[str, Any] | None] = list(measurements)
        self.plan_of, self.send = plan_of, send
        self.band, self.confirm = band, confirm
        self._ratios: list[list[float]] = [[] for _ in self.measurements]
        self.corrections: list[tuple[int, float]] = []
        """(rank, factor) of every correction sent, in order."""

    def __call__(self, record: Mapping[str, Any]) -> None:
        new = self.observe(record)
        if new is not None:
            rank, measurement = new
            per_rank: list[Mapping[str, Any] | None] = [None] * len(self.measurements)
            per_rank[rank] = measurement
            self.send(per_rank)

    def observe(self, record: Mapping[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """Take one slot record; (rank, its corrected measurement) when one is due."""
        rank = record.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < len(self.measurements):
            return None
        measurement = self.measurements[rank]
        if measurement is None or "switch_s" in record or "emulated_tflops" in record \
                or "emulated_slowdown" in record:
            return None
        plan = self.plan_of(int(record.get("plan_version", -1)))
        if plan is None:
            return None
        ratio = stage_ratio(record, plan, measurement)
        if ratio is None:
            return None
        ratios = self._ratios[rank]
        ratios.append(ratio)
        del ratios[:-self.confirm]
        if len(ratios) < self.confirm:
            return None
        high, low = 1.0 + self.band, 1.0 / (1.0 + self.band)
        if not (all(r > high for r in ratios) or all(r < low for r in ratios)):
            return None
        factor = statistics.median(ratios)
        corrected = _scaled(measurement, factor, plan.microbatch_size)
        self.measurements[rank] = corrected
        ratios.clear()
        self.corrections.append((rank, factor))
        return rank, corrected
