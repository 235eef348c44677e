"""Plan push to the first iteration on the new plan: switching at iteration boundaries.

A real ``hetpilot train`` job (2 gloo ranks under ``torch.distributed.run``,
the demo's digits MLP, 22 iterations per epoch, ``--slot-iterations 1`` so that
every iteration closes a record with its end time) reads its plan from a file.
While it runs, this script rewrites the file with a higher version several
times (alternating even data parallelism and a 2-stage pipeline, so layers
move), noting the push time. From rank 0's records it reports, per push:

* **iteration in flight**: push -> the end of the iteration running when the
  push landed (the trainer polls before every iteration);
* **switch**: the switch itself (check, layers and optimizer state moved,
  process groups rebuilt: the record's ``switch_s``);
* **push -> end of first new iteration**: all of it, the first iteration on
  the new plan included;
* **epoch boundary (derived)**: what the same push would have cost when plans
  switched at epoch boundaries (the old runtime): push -> the end of the epoch
  the push landed in, from the same run's records, plus the same switch and
  first iteration.

Device speeds are EMULATED (target-time mode, ``--emulate-tflops``) so that an
iteration takes a stable ~0.1 s on a shared CPU; the plan file is replaced
atomically (write + rename). CPU only.

Run: .venv/bin/python bench/trainer_push.py [--pushes 6] [--tflops 2e-5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PY = sys.executable
DEVICES = ("local:0", "local:1")


def plan(version: int, pipeline: bool) -> dict[str, Any]:
    if pipeline:
        groups = [{"samples": 64, "stages": [{"device": DEVICES[0], "layers": [0, 3]},
                                             {"device": DEVICES[1], "layers": [3, 5]}]}]
    else:
        groups = [{"samples": 32, "stages": [{"device": d, "layers": [0, 5]}]} for d in DEVICES]
    return {"version": version, "microbatch_size": 4, "schedule": "1f1b", "groups": groups}


def write_atomic(path: Path, data: dict[str, Any]) -> float:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return time.time()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=6)
    ap.add_argument("--tflops", type=float, default=2e-5,
                    help="EMULATED speed of both ranks (sets the iteration time)")
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hetpilot-push-"))
    plan_file = work / "plan.json"
    write_atomic(plan_file, plan(1, pipeline=False))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "hetpilot", "train", "--model", "hetpilot.demo.digits:job",
           "--plan", str(plan_file), "--device-id", "local:{rank}", "--slot-iterations", "1",
           "--epochs", str(args.epochs), "--emulate-tflops", str(args.tflops),
           "--log-format", "json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    records: list[dict[str, Any]] = []
    pushes: list[tuple[int, float]] = []
    errors: list[str] = []
    threading.Thread(target=lambda: errors.append(proc.stderr.read() if proc.stderr else ""),
                     daemon=True).start()
    version = 1
    assert proc.stdout is not None
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        records.append(json.loads(line))
        done = len(records)
        # push every 13 iterations (not a divisor of the 22-iteration epoch: pushes land
        # at different points of an epoch), after a warm-up epoch
        if done >= 25 and (done - 25) % 13 == 0 and len(pushes) < args.pushes:
            version += 1
            pushes.append((version, write_atomic(plan_file, plan(version, version % 2 == 0))))
    proc.wait()
    if proc.returncode != 0:
        print("".join(errors)[-3000:], file=sys.stderr)
        return 1
    rows = []
    for v, at in pushes:
        first = next(r for r in records if r["plan_version"] == v)
        before = [r for r in records if r["plan_version"] < v and r["unix_s"] <= first["unix_s"]]
        epoch_end = next((r for r in records if r["closed_by"] == "epoch" and r["unix_s"] >= at),
                         None)
        # the old plan's last iteration ends, the switch runs, the first new iteration runs
        in_flight = max(0.0, before[-1]["unix_s"] - at)
        to_first = first["unix_s"] - at
        after = to_first - in_flight  # switch + first iteration (+ the poll)
        derived = (epoch_end["unix_s"] - at + after) if epoch_end else None
        rows.append((v, first["iteration_s"], first.get("switch_s", float("nan")), in_flight,
                     to_first, derived))
    its = [r["iteration_s"] for r in records if r["closed_by"] == "iterations"]
    print(f"EMULATED devices ({args.tflops:g} TFLOP/s each, target-time mode); 2 gloo ranks, "
          f"CPU; median iteration {statistics.median(its):.3f} s; 22 iterations per epoch")
    print("| push (version) | iteration in flight s | switch s | first new iteration s | "
          "push -> end of first new iteration s | epoch-boundary switching (derived) s |")
    print("|---|---|---|---|---|---|")
    for v, it, sw, wait, total, derived in rows:
        shown = f"{derived:.3f}" if derived is not None else "(run ended)"
        print(f"| {v} | {wait:.3f} | {sw:.3f} | {it:.3f} | {total:.3f} | {shown} |")
    fin = [r[5] for r in rows if r[5] is not None]
    print(f"median push -> end of first new iteration: {statistics.median(r[4] for r in rows):.3f}"
          f" s; with epoch-boundary switching (derived): "
          f"{statistics.median(fin) if fin else float('nan'):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
