"""CPU time of one `hetpilot plan` process, start-up included, pinned to one core.

    .venv/bin/python bench/planner_latency.py                    # issue 15: 1024 devices, batch 4096
    .venv/bin/python bench/planner_latency.py --devices 256 --batch 1024 --repeat 7
    .venv/bin/python bench/planner_latency.py --pythonpath DIR   # another copy of the package

The cluster is bench/planner_bench.py's latency cluster (hosts of 8 H100, A100, V100
or A10G in turn, `planner/catalog.py` profiles) and the model llama-13b (42 layers),
microbatch 1. Each run is a fresh `hetpilot plan` process on one core; its CPU time
(user + system, from getrusage of the child) and wall time are taken, and the median
of the runs reported. One more process plans in-process and says where its time went
(interpreter start-up is measured apart, with `python -c pass`) and which heavy modules
it imported: the planner must import no cvxpy where no LP needs it, and never scipy,
sklearn, torch or grpc.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hetpilot.planner import catalog, serde

KINDS = ("H100", "A100", "V100", "A10G")
HEAVY = ("cvxpy", "scipy", "sklearn", "torch", "grpc")

_BREAKDOWN = """
import json, sys, time
t0 = time.process_time()
import hetpilot.cli, hetpilot.planner.cli, hetpilot.planner.search
t1 = time.process_time()
code = hetpilot.cli.main(sys.argv[1:])
t2 = time.process_time()
heavy = sorted({m.split('.')[0] for m in sys.modules} & set(HEAVY))
print(json.dumps({"imports_s": t1 - t0, "plan_s": t2 - t1, "code": code, "heavy": heavy,
                  "planner": hetpilot.planner.search.__file__}))
""".replace("HEAVY", repr(HEAVY))


def write_inputs(folder: Path, devices: int) -> tuple[Path, Path]:
    model = catalog.MODELS["llama-13b"]()
    cluster = catalog.make_cluster([(KINDS[i % 4], 8) for i in range(devices // 8)])
    paths = folder / "cluster.json", folder / "model.json"
    paths[0].write_text(json.dumps(serde.cluster_to_dict(cluster)))
    paths[1].write_text(json.dumps(serde.model_to_dict(model)))
    return paths


def _one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def timed(command: list[str], env: dict[str, str], cwd: str) -> tuple[float, float, str]:
    """CPU seconds (user + system) and wall seconds of one process on one core.

    ``cwd`` away from the repository: ``python -c`` puts the working directory first
    on sys.path, where the checkout's hetpilot/ would shadow ``--pythonpath``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(command, env=env, cwd=cwd, preexec_fn=_one_core, capture_output=True,
                         text=True, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pythonpath", help="put this first on PYTHONPATH (another copy of hetpilot)")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.pythonpath, env.get("PYTHONPATH")]))
    script = Path(sys.executable).with_name("hetpilot")
    entry = [str(script)] if script.exists() else [sys.executable, "-m", "hetpilot"]
    with tempfile.TemporaryDirectory() as tmp:
        cluster, model = write_inputs(Path(tmp), args.devices)
        plan_args = ["plan", "--cluster", str(cluster), "--model", str(model), "--batch",
                     str(args.batch), "--microbatch", "1", "--out", str(Path(tmp) / "plan.json")]
        cpus, walls = [], []
        for _ in range(args.repeat):
            cpu, wall, _ = timed(entry + plan_args, env, tmp)
            cpus.append(cpu)
            walls.append(wall)
        start = statistics.median(timed([sys.executable, "-c", "pass"], env, tmp)[0] for _ in range(5))
        _, _, out = timed([sys.executable, "-c", _BREAKDOWN, *plan_args], env, tmp)
        parts = json.loads(out.strip().splitlines()[-1])
        plan = json.loads((Path(tmp) / "plan.json").read_text())
    print(f"`hetpilot plan`, {args.devices} devices, llama-13b (42 layers), batch {args.batch}, "
          f"microbatch 1, one core, {args.repeat} runs")
    print(f"CPU s: median {statistics.median(cpus):.3f}, min {min(cpus):.3f}, max {max(cpus):.3f} "
          f"({', '.join(f'{c:.3f}' for c in cpus)})")
    print(f"wall s: median {statistics.median(walls):.3f}, max {max(walls):.3f}")
    print(f"in one process: interpreter start-up {start:.3f} s, imports {parts['imports_s']:.3f} s, "
          f"reading, planning and writing {parts['plan_s']:.3f} s (CPU); "
          f"heavy modules imported: {', '.join(parts['heavy']) or 'none'} "
          f"(planner from {Path(parts['planner']).parent})")
    print(f"plan: {plan['schedule']}, {len(plan['groups'])} groups, predicted iteration "
          f"{plan['predicted']['iteration_s']!r} s")


if __name__ == "__main__":
    main()
