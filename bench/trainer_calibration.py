"""Layer times measured in bad conditions, corrected from the job's stage timings (issue 14).

What it shows: the loop of :mod:`hetpilot.trainer.calibration`. A job's layer times are
measured once, on Attach. When that measurement does not match what the device does in
training, the plan's predicted iteration time is off for the whole run. On an H100 in
lease F, a launch-bound GPT-2 block was timed 1.7x slow at attach. Here the stage timings
bring the prediction back.

REAL CPU compute, no emulation: one rank (one thread, pinned to one core) runs the MLP of
``bench/trainer_fidelity.py`` (8 x Linear + Tanh, widths 512-1024, float32, MSE, SGD) on a
one-stage plan, batch 256 in microbatches of 32. Two conditions for the measurement on
Attach (:func:`hetpilot.trainer.speeds.measure_layer_times`, as ``hetpilot train`` takes
it):

* ``quiet``: nothing else on the core;
* ``contended``: a second process spins on the same core while the layers are timed, and
  is stopped before training starts. This is REAL contention, not emulation: the
  measurement was taken in conditions unlike the run's.

For each condition the bench fits the times as the daemon does
(:func:`hetpilot.planner.measured.fit_speeds` on the profile) and predicts the plan's
iteration time with spec 5 (:func:`hetpilot.planner.refmodel.evaluate`). It then trains
``--slots`` slots of ``--slot-iterations`` iterations, feeding each slot's record to a
:class:`~hetpilot.trainer.calibration.StageCalibration`, as rank 0 of
``hetpilot train --daemon`` does. When the calibration sends a corrected measurement, the
bench fits it again and predicts again. "Measured" is the median of the slots'
``iteration_s`` over the slots after the last correction (after the first slot, which
opens with the switch to the plan, where there was none): the machine's speed drifts
over a run, and a prediction is compared with the slots it predicts.

    .venv/bin/python bench/trainer_calibration.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hetpilot.planner.measured import DeviceTimes, effective_model, fit_speeds
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.serde import cluster_from_dict, model_from_dict, plan_from_dict
from hetpilot.trainer.calibration import StageCalibration
from hetpilot.trainer.plans import StaticPlanSource
from hetpilot.trainer.profile import profile_model
from hetpilot.trainer.runtime import Trainer, TrainerConfig
from hetpilot.trainer.speeds import as_measurement, measure_layer_times
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_fidelity import WIDTHS, dataset, make_layers

DEVICE = "cpu:0"


def _predict(measurement: dict[str, Any], prof: dict[str, Any], plan: Any, batch: int) -> float:
    profiled = model_from_dict(prof)
    fit = fit_speeds({DEVICE: DeviceTimes(measurement["microbatch"], measurement["layers"])},
                     [la.fwd_gflop for la in profiled.layers],
                     [la.bwd_gflop for la in profiled.layers])
    cluster = cluster_from_dict({
        "devices": [{"id": DEVICE, "host": "local", "memory_gb": 100.0,
                     "tflops": fit.tflops[DEVICE]}],
        "network": {"intra_host_gbps": 100.0, "inter_host_gbps": 100.0, "latency_us": 1.0}})
    return float(evaluate(cluster, effective_model(profiled, fit), plan, batch).iteration_s)


def _spinner(cpu: int) -> subprocess.Popen[bytes]:
    """A process spinning on ``cpu`` until killed."""
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def run(condition: str, args: argparse.Namespace, prof: dict[str, Any], cpu: int
        ) -> dict[str, Any]:
    micro, batch = args.micro, args.batch
    torch.manual_seed(1)
    layers = make_layers(WIDTHS)
    sample = torch.randn(micro, WIDTHS[0])
    spinner = _spinner(cpu) if condition == "contended" else None
    try:
        if spinner is not None:
            time.sleep(0.5)  # let it get going
        times = measure_layer_times(layers, sample, micro, device="cpu",
                                    loss=(nn.functional.mse_loss,
                                          torch.randn(micro, WIDTHS[-1])))
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    attach = as_measurement(times, micro, "float32")
    plan = plan_from_dict({"microbatch_size": micro, "schedule": "1f1b", "groups": [
        {"samples": batch, "stages": [{"device": DEVICE, "layers": [0, len(layers)]}]}]})
    predictions = [("attach", _predict(attach, prof, plan, batch))]
    trainer = Trainer(layers, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=1e-4),
                      dataset(batch * (args.slots * args.slot_iterations + 1), WIDTHS),
                      TrainerConfig(global_batch=batch, device_id=DEVICE),
                      plan_source=StaticPlanSource([plan]))

    def send(per_rank: list[Any]) -> None:
        predictions.append((f"after slot {len(records)}", _predict(per_rank[0], prof, plan,
                                                                   batch)))

    calibration = StageCalibration([attach], lambda v: trainer.plan, send)
    records: list[dict[str, Any]] = []

    def on_record(record: dict[str, Any]) -> None:
        records.append(record)
        calibration(record)

    trainer.fit(1, max_steps=args.slots * args.slot_iterations,
                slot_iterations=args.slot_iterations, on_record=on_record)
    # the plan ran with each prediction from the slot after it was made (the last one
    # from the slot after the last correction); the first slot opened with the switch
    since = int(predictions[-1][0].rpartition(" ")[2]) if len(predictions) > 1 else 1
    after = records[since:] or records[-1:]
    measured = statistics.median(r["iteration_s"] for r in after)
    stage = statistics.median(r["fwd_s"] + r["bwd_s"] for r in after)
    return {"condition": condition, "measured_s": measured, "measured_slots": len(after),
            "measured_all_s": statistics.median(r["iteration_s"] for r in records[1:]),
            "stage_per_microbatch_s": stage,
            "attach_per_microbatch_s": sum(f + b for f, b in times),
            "predictions": predictions, "corrections": calibration.corrections}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--slots", type=int, default=6)
    ap.add_argument("--slot-iterations", type=int, default=4)
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    cpu = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    print(f"REAL CPU compute, one rank pinned to core {cpu}; the 'contended' measurement "
          "is taken with another process spinning on that core (real contention, not "
          "emulation), stopped before training.")
    torch.manual_seed(2)
    prof = profile_model(make_layers(WIDTHS), torch.randn(args.micro, WIDTHS[0]),
                         name="calibration-mlp")
    results = [run(c, args, prof, cpu) for c in ("quiet", "contended")]
    dist.destroy_process_group()
    print("| attach measurement | per microbatch: attach / in training | corrections "
          "(factor, after slot) | predicted s: attach -> last | measured s (slots) | "
          "error: attach -> last |")
    print("|---|---|---|---|---|---|")
    for r in results:
        first, last = r["predictions"][0][1], r["predictions"][-1][1]
        fixes = ", ".join(f"{f:.3g} ({w.rpartition(' ')[2]})" for (_, f), (w, _)
                          in zip(r["corrections"], r["predictions"][1:], strict=True))
        print(f"| {r['condition']} | {r['attach_per_microbatch_s'] * 1e3:.1f} / "
              f"{r['stage_per_microbatch_s'] * 1e3:.1f} ms | {fixes or 'none'} | "
              f"{first:.4f} -> {last:.4f} | {r['measured_s']:.4f} ({r['measured_slots']}) | "
              f"{r['measured_s'] / first - 1:+.1%} -> {r['measured_s'] / last - 1:+.1%} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
