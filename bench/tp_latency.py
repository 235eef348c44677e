"""CPU time of `hetpilot plan` with and without the tensor-parallel search, side by side.

    .venv/bin/python bench/tp_latency.py                      # 64, 256 and 1024 devices
    .venv/bin/python bench/tp_latency.py --devices 1024 --repeat 3
    .venv/bin/python bench/tp_latency.py --pythonpath DIR   # and another copy, in turn

The cluster has five kinds in uneven counts (H100, A100, V100, A10G, T4 at
25/22/22/16/15% of the devices, 8 per host; `planner/catalog.py` profiles) and
the model is llama-13b with tensor-parallel keys (Megatron's all-reduces: one
after the embedding, two per block, one for the head, each of one activation,
splitting up to 8 ways). Each run is a fresh `hetpilot plan` process on one
core, start-up included (CPU = user + system of the child); the median is reported.
With ``--pythonpath DIR`` each run of this checkout alternates with one of the copy
of the package in DIR (laid out as installed: DIR/hetpilot/planner, ...), side by
side on the same machine, and the row says whether both wrote the same plan.

Start-up includes compiling the package's sources when the environment sets
PYTHONDONTWRITEBYTECODE (as this VM does), which an installed package does not
pay; ``--cached-bytecode`` lets the runs write and read ``__pycache__`` (one
untimed run per side first), as after ``pip install``.
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
from pathlib import Path

from hetpilot.planner import catalog, serde

MIX = (("H100", 0.25), ("A100", 0.22), ("V100", 0.22), ("A10G", 0.16), ("T4", 0.15))


#: With ``--kind-scale``: per-kind layer factors (spec 2 ``kind_scale``) of the shape
#: Sailor's profiles have (the head dearer on the older kinds, blocks slightly cheaper,
#: the head's split further from ideal); made up for timing, not measured.
HEAD_SCALE = {"V100": 2.0, "T4": 2.2, "A10G": 1.5, "A100": 1.3, "H100": {"1": 1.0, "2": 1.2, "4": 1.5, "8": 2.0}}
BLOCK_SCALE = {"V100": 0.95, "T4": 0.93, "A10G": {"1": 0.97, "2": 1.05}}


def write_inputs(folder: Path, devices: int, kind_scale: bool = False) -> tuple[Path, Path]:
    hosts = devices // 8
    counts = [max(1, round(hosts * share)) for _, share in MIX]
    counts[0] += hosts - sum(counts)
    kinds = [kind for (kind, _), n in zip(MIX, counts, strict=True) for _ in range(n)]
    cluster = catalog.make_cluster([(kind, 8) for kind in kinds])
    model = serde.model_to_dict(catalog.MODELS["llama-13b"]())
    last = len(model["layers"]) - 1
    for i, layer in enumerate(model["layers"]):
        layer.update(tp_comm_mb=model["layers"][0]["out_mb"], tp_max=8,
                     tp_allreduces=2 if 0 < i < last else 1)
        if kind_scale and i > 0:
            layer["kind_scale"] = HEAD_SCALE if i == last else BLOCK_SCALE
    data = serde.cluster_to_dict(cluster)
    if kind_scale:
        host_kind = dict(zip(cluster.hosts, kinds, strict=True))
        for dev in data["devices"]:
            dev["kind"] = host_kind[dev["host"]]
    paths = folder / "cluster.json", folder / "model.json"
    paths[0].write_text(json.dumps(data))
    paths[1].write_text(json.dumps(model))
    return paths


def _one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def cpu_seconds(command: list[str], cwd: str, pythonpath: str | None = None,
                cached_bytecode: bool = False) -> float:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if cached_bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, cwd=cwd, env=env, preexec_fn=_one_core, capture_output=True,
                   check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", default="64,256,1024")
    parser.add_argument("--batch-per-device", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pythonpath", help="also time the copy of hetpilot in this folder, in turn")
    parser.add_argument("--cached-bytecode", action="store_true",
                        help="let the runs write and read __pycache__ (one untimed run per side "
                             "first): start-up as an installed package pays it")
    parser.add_argument("--kind-scale", action="store_true",
                        help="devices name their kind and layers carry made-up kind_scale "
                             "factors (HEAD_SCALE, BLOCK_SCALE)")
    args = parser.parse_args()
    sides = {"": None}
    if args.pythonpath:
        sides = {"other_": str(Path(args.pythonpath).resolve()), "": None}
    for n in (int(x) for x in args.devices.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            cluster, model = write_inputs(Path(tmp), n, args.kind_scale)
            row: dict[str, object] = {"devices": n}
            for label, extra in (("v1", []), ("tp", ["--tensor-parallel"])):
                runs: dict[str, list[float]] = {side: [] for side in sides}
                plans = {}
                for attempt in range(args.repeat + args.cached_bytecode):
                    for side, path in sides.items():
                        out = Path(tmp) / f"{side}plan.json"
                        command = [sys.executable, "-m", "hetpilot", "plan", "--cluster",
                                   str(cluster), "--model", str(model), "--batch",
                                   str(n * args.batch_per_device), "--microbatch", "1",
                                   "--out", str(out), *extra]
                        seconds = cpu_seconds(command, tmp, path, args.cached_bytecode)
                        if attempt or not args.cached_bytecode:  # the first run writes the cache
                            runs[side].append(seconds)
                        plans[side] = json.loads(out.read_text())
                for side in sides:
                    row[f"{side}{label}_cpu_s"] = round(statistics.median(runs[side]), 3)
                plan = plans[""]
                row[f"{label}_iteration_s"] = plan["predicted"]["iteration_s"]
                row[f"{label}_max_degree"] = max(len(s.get("devices", [0])) for g in plan["groups"]
                                                 for s in g["stages"])
                if args.pythonpath:
                    row[f"{label}_same_plan"] = plans["other_"] == plan
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
