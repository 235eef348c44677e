"""hetpilot's plans scored in Sailor's own simulator, beside Sailor's planner (issue 38).

Sailor (eth-easl/sailor, the SOSP'25 artifact) ranks planners with its
simulator (``sailor/Planner/simulations/runtime_simulator.py``). Its
heterogeneous case (figure 8b, ``ae_scripts/planner/run_het.sh``): OPT-350M,
global batch 1024, fp32, the trace ``gpu_trace_heterogeneous_imbalanced.csv``
(rows of 32+96, 80+240 and 128+384 A100-40 + V100-16, four per node, one
zone). For each row this script

1. converts Sailor's inputs (its per-layer profiles measured at TP 1/2/4/8,
   its layer sizes, its network fits) to hetpilot's cluster and model
   (:func:`hetpilot_inputs`; every assumption is listed in
   bench/RESULTS-sailor.md),
2. plans with hetpilot for microbatch 1, 2, 4 and 8,
3. writes each plan in Sailor's plan form (:func:`sailor_plan`: one Sailor
   pipeline per hetpilot group, or groups of equal cuts merged as replicas),
   checks it with Sailor's memory check, times each form with Sailor's own
   functions (:func:`sailor_time`) and keeps the fastest form; over the
   microbatch sizes it reports the best in Sailor's simulator and, as
   ``own_choice``, the one hetpilot's own model rates best,
4. runs Sailor's planner on the same row and scores its plan the same way, as
   the artifact's ``simulator.py`` does.

Sailor's code is not part of hetpilot. Get it and build its planner::

    git clone https://github.com/eth-easl/sailor /some/dir/sailor   # the folder must be named sailor
    pip install -e '.[sailor]'                                        # pandas, which Sailor imports
    apt-get install libjsoncpp-dev && pip install pybind11            # for Sailor's C++ planner only
    python bench/sailor_compare.py --sailor /some/dir/sailor --build-sailor-planner

Without ``--sailor`` (or ``SAILOR_CHECKOUT``) the script says so and exits 0.
Sailor's simulator imports torch (CPU is enough).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hetpilot.planner import serde
from hetpilot.planner.errors import InfeasibleError
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.types import Cluster, Job, Model, Plan

MODEL = "OPT-350"
BATCH = 1024
ZONE = "us-central1-a"
KINDS = ("A100-40", "V100-16")
GPUS_PER_NODE = 4
SEQ, HIDDEN, FLOAT = 2048, 1024, 4  # training_config_opt_350.json, fp32
#: The all-reduce Megatron does after a split attention or MLP: one activation, per sample.
AR_MB = SEQ * HIDDEN * FLOAT / 1e6
#: Sailor's memory check: 8 (Adam) + 4 (fp32 copy) + 4 (gradients) + 4 (comm) + 4
#: (DeepSpeed's copies) bytes per 4-byte parameter, i.e. 1 + 5 in hetpilot's terms.
OPTIMIZER_FACTOR = 5.0
INTRA_HOST = ("auto", "nvlink", "inter")
REF_TFLOPS = 100.0  # A100-40's nominal rate in the converted cluster; only ratios matter


class Sailor:
    """Sailor's simulator (and optionally planner) imported from a checkout."""

    def __init__(self, checkout: Path) -> None:
        self.checkout = checkout.resolve()
        if self.checkout.name != "sailor" or not (self.checkout / "sailor" / "Planner").is_dir():
            raise SystemExit(f"--sailor: {checkout} is not a Sailor checkout in a folder named "
                             "'sailor' (Sailor finds its files as <parent>/sailor/sailor/...)")
        self.root = self.checkout.parent  # Sailor's --sailor_path
        os.environ["SAILOR_PATH"] = str(self.root)
        sys.path.insert(0, str(self.checkout))
        from sailor.Planner.simulations import runtime_simulator as rs  # type: ignore[import-not-found]

        self.rs = rs
        sim_dir = self.checkout / "sailor" / "Planner" / "simulations"
        self.training_config = json.loads((sim_dir / "configs" / "training_config_opt_350.json")
                                          .read_text())
        self.llm_info = json.loads((self.checkout / "sailor" / "Planner" / "llm_info.json")
                                   .read_text())
        self.profiles = json.loads((sim_dir / "profiles_tmp.json").read_text())
        self.sim = rs.Simulator(str(self.root), self.training_config, self.llm_info, False,
                                self.profiles, zone=ZONE)
        trace = (sim_dir / "configs" / "gpu_trace_heterogeneous_imbalanced.csv").read_text()
        head, *rows = [line.split(",") for line in trace.strip().splitlines()]
        # ",Timestamp,A100-40_us-central1-a,V100-16_us-central1-a", then one row per change
        self.rows = [{name: int(value) for name, value in zip(head[2:], r[2:], strict=True)}
                     for r in rows]

    def commit(self) -> str:
        try:
            return subprocess.run(["git", "-C", str(self.checkout), "rev-parse", "HEAD"],
                                  capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    # -- Sailor's planner -----------------------------------------------------------

    def planner(self, build: bool) -> Any:
        """Sailor's planner object, as ``simulator.py`` makes it (without its rebuild)."""
        cpp = self.checkout / "sailor" / "Planner" / "sailor_planner" / "cpp_src"
        suffix = subprocess.run([sys.executable, "-c", "import sysconfig;print(sysconfig."
                                 "get_config_var('EXT_SUFFIX'))"],
                                capture_output=True, text=True, check=True).stdout.strip()
        lib = cpp / f"libplanner{suffix}"
        if not lib.exists():
            if not build:
                return None
            includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"],
                                      capture_output=True, text=True, check=True).stdout.split()
            sources = ["planner.cpp", "training.cpp", "utils/read_json.cpp",
                       "utils/network_utils.cpp", "planner_utils.cpp"]
            cmd = ["g++", "-O2", "-fPIC", "-shared", "-std=c++17", *includes,
                   "-I/usr/include/jsoncpp", *sources, "-ljsoncpp", "-o", lib.name]
            print("building Sailor's planner:", " ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, cwd=cpp, check=True)
        sys.path.insert(0, str(cpp))
        import libplanner  # type: ignore[import-not-found]
        from sailor.Planner.sailor_planner.cpp_src.planner import (  # type: ignore[import-not-found]
            SailorPlanner,
        )

        base = self.checkout / "sailor"
        quotas = base / "Planner" / "sailor_planner" / "dummy_quotas_dict.json"
        planner = SailorPlanner.__new__(SailorPlanner)
        planner.available_gpus = sorted(json.loads(quotas.read_text()))
        planner.planner = libplanner.SailorPlanner(
            str(base / "Planner" / "sailor_planner" / "profiles" / MODEL) + "/",
            str(base / "providers" / "multizone_bandwidths_het.json"),
            str(base / "Planner" / "simulations" / "configs" / "training_config_opt_350.json"),
            str(base / "Planner" / "llm_info.json"),
            str(base / "providers" / "gcp" / "communication_cost.json"),
            True, False, str(quotas), "throughput")
        return planner

    def sailor_best(self, planner: Any, row: dict[str, int],
                    cache: Path | None = None) -> tuple[dict, float, float]:
        """Sailor's first plan that passes the memory check, as simulator.py picks it.

        With ``cache`` (a folder), the plan is read from and written to a file named by
        Sailor's commit and the row, so reruns skip Sailor's planner (minutes on big
        clusters); the plan is timed again either way."""
        path = None
        if cache is not None:
            name = "_".join(f"{k.split('_')[0]}-{v}" for k, v in sorted(row.items()))
            path = cache / f"sailor-{self.commit()[:12]}-{name}.json"
            if path.exists():
                saved = json.loads(path.read_text())
                iteration, _, _ = self.sim.simulate_iteration_time(saved["plan"])
                return saved["plan"], iteration, saved["search_s"]
        if planner is None:
            raise SystemExit("Sailor's planner library is not built and no cached plan: "
                             "add --build-sailor-planner")
        start = time.perf_counter()
        plans = planner.get_sorted_plans(
            cluster_config={**row, "max_cost": 0.0, "min_throughput": 0.0},
            training_config=self.training_config)
        search_s = time.perf_counter() - start
        for plan in plans:
            if self.sim.check_config_fits(plan):
                # Sailor's planner object, reused across clusters in one process, was seen
                # to return a plan for the previous cluster (156 A100s on 48 + 272)
                over = {k: n for k, n in plan["used_gpus"].items()
                        if n > row.get(f"{k}_{ZONE}", 0)}
                if over:
                    raise SystemExit(f"Sailor's planner returned a plan using {over} GPUs on "
                                     f"{row}: run this cluster in a process of its own")
                iteration, _, _ = self.sim.simulate_iteration_time(plan)
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps({"plan": plan, "search_s": search_s},
                                               default=list))  # pybind11's vectors
                return plan, iteration, search_s
        raise RuntimeError("no plan of Sailor's planner fits")

    # -- scoring a hetpilot plan ------------------------------------------------------

    def time_tables(self, mbs: int) -> tuple[dict, dict, dict]:
        """Per GPU kind and degree, per-layer forward, backward and update seconds
        (the tables simulate_iteration_time builds; unprofiled degrees are left out
        rather than timed as 0 s, as Sailor's loop would)."""
        fwd: dict[str, dict[int, list[float]]] = {}
        bwd: dict[str, dict[int, list[float]]] = {}
        upd: dict[str, dict[int, list[float]]] = {}
        for kind in KINDS:
            prof = self.profiles[MODEL][kind].get(str(mbs), {})
            fwd[kind], bwd[kind], upd[kind] = {}, {}, {}
            for tp, layers in prof.items():
                values = list(layers.values())
                fwd[kind][int(tp)] = [v[0] for v in values]
                bwd[kind][int(tp)] = [v[1] for v in values]
                upd[kind][int(tp)] = [v[2] for v in values]
        return fwd, bwd, upd

    def sailor_time(self, plan_dict: dict, micro: list[int]) -> float:
        """Sailor's iteration time of a plan whose pipeline i runs ``micro[i]`` microbatches.

        simulate_iteration_time gives every pipeline the same count,
        ceil(batch / (mbs * dp * pipelines)); hetpilot's groups take unequal
        shares, so each pipeline is timed by Sailor's get_time_per_pipeline
        with its own count, and the sync by Sailor's estimate_sync_time. With
        equal shares the two agree (checked in :func:`main`).
        """
        plan = self.rs.convert_homogeneous(plan_dict, self.training_config)
        fwd, bwd, upd = self.time_tables(plan.mbs)
        times = [self.sim.get_time_per_pipeline(p, plan.mbs, fwd, bwd, upd,
                                                self.sim.activation_sizes_per_layer, m)
                 for p, m in zip(plan.pipeline_list, micro, strict=True)]
        return max(times) + self.sim.estimate_sync_time(plan)


# -- conversion ---------------------------------------------------------------------------

def _bw_gbps(coeffs: list[float], mb: float) -> float:
    """Sailor's fitted bandwidth (GB/s, a polynomial in log2 MB) at ``mb``, in Gbit/s."""
    x = math.log2(mb)
    return 8.0 * sum(c * x ** (len(coeffs) - 1 - i) for i, c in enumerate(coeffs))


def _coeffs(sailor: Sailor, a: str, na: int, b: str, nb: int) -> list[float]:
    net = sailor.sim.inter_network_coeffs
    return list(net.get_zone_coeffs(ZONE, a, na, ZONE, b, nb)[0])


def _tp_comm_mb(prof_by_kind: dict[str, dict], mbs: int, gbps: float) -> float:
    """The all-reduce size (MB per sample) that makes spec 5.6's all-reduces on links of
    ``gbps`` reproduce, on average, what the profiles' TP 2 and 4 times of the
    transformer layers add over an ideal split: measured - ideal = 4 all-reduces (2
    forward, 2 backward) of 2(t-1)/t * mbs * c * 8 / (1000 gbps) s each; least squares
    over both kinds and both degrees."""
    num = den = 0.0
    for prof in prof_by_kind.values():
        one = prof.get("1")
        for t in (2, 4):
            split = prof.get(str(t))
            if one is None or split is None:
                continue
            per_mb = 4 * 2 * (t - 1) / t * mbs * 8.0 / (1000.0 * gbps)  # s per MB of c
            for k in one:
                if k in ("0", str(len(one) - 1)):
                    continue
                gap = (split[k][0] + split[k][1]) - (one[k][0] + one[k][1]) / t
                num += gap * per_mb
                den += per_mb * per_mb
    return max(num / den, 0.0) if den else AR_MB


def hetpilot_inputs(sailor: Sailor, row: dict[str, int], mbs: int, *,
                    tensor_parallel: bool, memory_margin_gb: float = 0.0,
                    link_scale: float = 1.0, intra_host: str = "auto",
                    kind_scale: bool = True) -> tuple[Cluster, Model]:
    """hetpilot's cluster and model for one trace row and microbatch size.

    ``intra_host`` is what the links inside a node run at: ``"nvlink"`` Sailor's
    intra-node fit (``intra_node_bandwidths.json``, the V100's, the slower, at four
    GPUs), ``"inter"`` the V100's inter-node fit, ``"auto"`` the first with
    ``tensor_parallel`` and the second without (bench/RESULTS-sailor.md says why).
    ``kind_scale``: devices carry their kind and layers Sailor's per-kind, per-degree
    times as ``kind_scale`` factors (:func:`_kind_scales`); else one rate per device."""
    prof = sailor.profiles[MODEL]
    info = sailor.llm_info[MODEL]["1"]
    n_layers = len(info)
    ref = prof[KINDS[0]][str(mbs)]["1"]
    layers = []
    for i in range(n_layers):
        f, b, _ = ref[str(i)]
        layer: dict[str, Any] = {
            "name": f"layer{i}",
            "fwd_gflop": f * 1000.0 * REF_TFLOPS / mbs,
            "bwd_gflop": b * 1000.0 * REF_TFLOPS / mbs,
            "out_mb": info[str(i)]["act_output_floats"] * FLOAT / 1e6,
            "act_mb": info[str(i)]["act_mem_floats"] * FLOAT / 1e6,
            "param_mb": info[str(i)]["params_floats"] * FLOAT / 1e6,
        }
        if tensor_parallel:  # tp_comm_mb is fitted below
            layer.update(tp_max=GPUS_PER_NODE,
                         tp_allreduces=1 if i == 0 else (0 if i == n_layers - 1 else 2))
        layers.append(layer)
    model = serde.model_from_dict({"name": MODEL, "optimizer_factor": OPTIMIZER_FACTOR,
                                   "layers": layers})

    def total(kind: str) -> float:
        table = prof[kind].get(str(mbs), {}).get("1")
        if table is None:  # not profiled at TP 1 (V100-16 at 8): twice the time at mbs / 2
            table = {k: [2 * v[0], 2 * v[1], v[2]]
                     for k, v in prof[kind][str(mbs // 2)]["1"].items()}
        return sum(v[0] + v[1] for v in table.values())

    devices = []
    # Sailor's check: GB of 2**30 bytes, less the 2 GB Megatron keeps at TP 1 (3 GB at TP > 1:
    # main() replans with less memory when Sailor's check refuses a plan)
    by_kind_hosts: dict[str, list[str]] = {}
    a100_gbps = link_scale * _bw_gbps(_coeffs(sailor, KINDS[0], 1, KINDS[0], 1), mbs * AR_MB)
    v100_gbps = link_scale * _bw_gbps(_coeffs(sailor, KINDS[1], 1, KINDS[1], 1), mbs * AR_MB)
    for kind in KINDS:
        count = row[f"{kind}_{ZONE}"]
        tflops = REF_TFLOPS * total(KINDS[0]) / total(kind)
        memory = int(kind.split("-")[1]) * 2**30 / 1e9 - 2.0 - memory_margin_gb
        hosts = by_kind_hosts.setdefault(kind, [])
        for h in range(count // GPUS_PER_NODE):
            host = f"{kind[0].lower()}{h}"
            hosts.append(host)
            devices += [{"id": f"{host}:{g}", "host": host, "tflops": tflops,
                         "memory_gb": memory, **({"kind": kind} if kind_scale else {})}
                        for g in range(GPUS_PER_NODE)]
    if intra_host not in INTRA_HOST:
        raise ValueError(f"intra_host: {intra_host!r} is not one of {', '.join(INTRA_HOST)}")
    if intra_host == "nvlink" or (intra_host == "auto" and tensor_parallel):
        # the links a TP group's all-reduces and the scatter-gather's all-gather run on;
        # Sailor's TP profiles measured them there, and its sends to a TP group have no gather
        intra = link_scale * _bw_gbps(list(sailor.sim.intra_network_coeffs[(KINDS[1], 4)][0]),
                                      mbs * AR_MB)
    else:
        intra = v100_gbps
    host_links = [{"a": x, "b": y, "gbps": a100_gbps}
                  for x, y in itertools.combinations(by_kind_hosts[KINDS[0]], 2)]
    # Sailor times every stage-to-stage send with its inter-node fits, also within a node;
    # inside a node "inter" takes the V100's (the slower) for either kind
    cluster = serde.cluster_from_dict({"devices": devices, "network": {
        "intra_host_gbps": intra, "inter_host_gbps": v100_gbps, "latency_us": 0.0,
        "host_links": host_links}})
    if tensor_parallel:
        comm = _tp_comm_mb({k: prof[k].get(str(mbs), {}) for k in KINDS}, mbs, intra)
        layers = [{**layer, "tp_comm_mb": comm} for layer in layers]
    if kind_scale:
        nominal = {kind: total(kind) / total(KINDS[0]) for kind in KINDS}
        layers = _kind_scales(prof, layers, mbs, nominal, intra, tensor_parallel)
    if tensor_parallel or kind_scale:
        model = serde.model_from_dict({"name": MODEL, "optimizer_factor": OPTIMIZER_FACTOR,
                                       "layers": layers})
    return cluster, model


def _kind_scales(prof: dict, layers: list[dict[str, Any]], mbs: int, nominal: dict[str, float],
                 intra_gbps: float, tensor_parallel: bool) -> list[dict[str, Any]]:
    """Layers with ``kind_scale`` (spec 2): per kind and degree, the factor that makes spec
    5.1 / 5.6's compute time of the layer equal Sailor's profiled forward + backward.

    The converted layer's nominal time on a device of ``kind`` at TP 1 is its A100 time
    times ``nominal[kind]`` (the whole-model ratio the device's tflops carry); at degree
    t a split layer's nominal compute is that over t, and its all-reduces (spec 5.6 on
    the links inside a node) come off the profiled time first, so the fitted
    ``tp_comm_mb`` keeps its part. A V100 not profiled at TP 1 for this microbatch size
    takes twice its time at mbs / 2, as :func:`hetpilot_inputs`' rate does."""
    ref = prof[KINDS[0]][str(mbs)]["1"]
    scales: list[dict[str, dict[str, float]]] = [{} for _ in layers]
    for kind in KINDS:
        tables = dict(prof[kind].get(str(mbs), {}))
        if "1" not in tables and str(mbs // 2) in prof[kind]:
            tables["1"] = {k: [2 * v[0], 2 * v[1], v[2]]
                           for k, v in prof[kind][str(mbs // 2)]["1"].items()}
        degrees = sorted(int(t) for t in tables if tensor_parallel or t == "1")
        for i, layer in enumerate(layers):
            base = (ref[str(i)][0] + ref[str(i)][1]) * nominal[kind]
            if base <= 0:
                continue
            for t in degrees:
                split = t > 1 and layer.get("tp_comm_mb") is not None and t <= layer["tp_max"]
                if t > 1 and not split:  # the layer runs whole there: degree 1's factor
                    continue
                measured = tables[str(t)][str(i)][0] + tables[str(t)][str(i)][1]
                comm = (2 * layer["tp_allreduces"] * 2 * (t - 1) / t * mbs * layer["tp_comm_mb"]
                        * 8.0 / (1000.0 * intra_gbps)) if split else 0.0
                # an all-reduce fit above the profile leaves at least a tenth of the ideal split
                factor = max(measured - comm, 0.1 * base / t) / (base / t if split else base)
                if not math.isclose(factor, 1.0, rel_tol=1e-9):
                    scales[i].setdefault(kind, {})[str(t)] = factor
    return [{**layer, "kind_scale": s} if s else layer for layer, s in zip(layers, scales, strict=True)]


def sailor_plan(plan: Plan, cluster: Cluster, *, merge: str) -> tuple[dict, list[int]]:
    """A hetpilot plan in Sailor's plan form, and each Sailor pipeline's microbatch count.

    A Sailor plan is a list of pipelines, each with data-parallel replicas per stage.
    With ``merge="none"`` each hetpilot group is a pipeline of its own (dp 1), the form
    of Sailor's FlashFlex and Oobleck ports; with ``"samples"``, groups with the same
    layer cuts and the same samples are replicas of one pipeline, the form of Sailor's
    own plans; with ``"cuts"``, groups with the same cuts are replicas of one pipeline
    whatever their samples, each pipeline running the most microbatches of its groups
    (Sailor's own rounding: its plans give every replica ``ceil(batch / (mbs * dp))``,
    so a replica may run a microbatch more than its share). Sailor's simulator times
    the forms' gradient sync differently (one ring over all pipelines, without dividing
    by the TP degree; or a ring per stage over its replicas, divided by the smallest
    degree, plus one over the pipelines).
    A stage of t devices is a replica of degree t.
    """
    merged: dict[tuple[Any, ...], list[Any]] = {}
    used = dict.fromkeys(KINDS, 0)
    for gi, group in enumerate(plan.groups):
        key = (tuple(s.layers for s in group.stages),
               0 if merge == "cuts" else group.samples, gi if merge == "none" else 0)
        merged.setdefault(key, []).append(group)
    pipelines, micro = [], []
    for (cuts, _, _), groups in merged.items():
        replicas = []
        for j in range(len(cuts)):
            stage_replicas = []
            for group in groups:
                stage = group.stages[j]
                kind = KINDS[0] if cluster.by_id[stage.device].host.startswith("a") else KINDS[1]
                used[kind] += stage.tp
                stage_replicas.append([[(kind, stage.tp, ZONE)], stage.tp])
            replicas.append(stage_replicas)
        pipelines.append({"num_stages": len(cuts),
                          "layers_per_stage": [list(range(*c)) for c in cuts],
                          "tmp_per_stage": replicas, "dp": [len(groups)] * len(cuts)})
        micro.append(max(g.samples for g in groups) // plan.microbatch_size)
    return {"pipeline_list": pipelines, "mbs": plan.microbatch_size,
            "used_gpus": {k: v for k, v in used.items() if v}}, micro


def from_sailor(splan: dict, cluster: Cluster) -> Plan:
    """Sailor's plan as a hetpilot plan: replica i of every stage forms group i (Sailor's
    replicas of a stage run in lock step); a replica of degree t takes t devices of its
    kind on one host, hosts handed out in order. The groups share the batch evenly."""
    free: dict[str, list[list[str]]] = {}
    for dev in cluster.devices:
        kind = KINDS[0] if dev.host.startswith("a") else KINDS[1]
        hosts = free.setdefault(kind, [])
        if not hosts or cluster.by_id[hosts[-1][0]].host != dev.host:
            hosts.append([])
        hosts[-1].append(dev.id)
    pipe = splan["pipeline_list"][0]
    dp = pipe["dp"][0]
    groups: list[list[dict]] = [[] for _ in range(dp)]
    start = 0
    for layers, replicas in zip(pipe["layers_per_stage"], pipe["tmp_per_stage"], strict=True):
        end = start + len(layers)
        for i, (vms, tp) in enumerate(replicas):
            kind = vms[0][0]
            host = next(h for h in free[kind] if len(h) >= tp)
            devices, host[:] = host[:tp], host[tp:]
            groups[i].append({"devices": devices, "layers": [start, end]})
        start = end
    micro = splan["mbs"]
    total = BATCH // micro  # microbatches, spread as evenly as they go (Sailor rounds up)
    return serde.plan_from_dict({"microbatch_size": micro, "schedule": "1f1b", "groups": [
        {"samples": micro * (total // dp + (1 if i < total % dp else 0)), "stages": g}
        for i, g in enumerate(groups)]})


def _profiled(sailor: Sailor, plan: Plan, cluster: Cluster) -> bool:
    prof = sailor.profiles[MODEL]
    for group in plan.groups:
        for stage in group.stages:
            kind = KINDS[0] if cluster.by_id[stage.device].host.startswith("a") else KINDS[1]
            if str(stage.tp) not in prof[kind].get(str(plan.microbatch_size), {}):
                return False
    return True


def hetpilot_best(sailor: Sailor, row: dict[str, int], micros: list[int], *,
                  tensor_parallel: bool, link_scale: float = 1.0,
                  intra_host: str = "auto", kind_scale: bool = True) -> dict[str, Any]:
    from hetpilot.planner.tpsearch import make_tp_plan

    best: dict[str, Any] = {}
    tried: list[dict[str, Any]] = []
    plan_s = 0.0
    for mbs in micros:
        for margin in (0.0, 1.0, 2.0):  # replan with less memory if Sailor's check refuses
            cluster, model = hetpilot_inputs(sailor, row, mbs, tensor_parallel=tensor_parallel,
                                             memory_margin_gb=margin, link_scale=link_scale,
                                             intra_host=intra_host, kind_scale=kind_scale)
            job = Job(global_batch=BATCH, microbatch_size=mbs, schedules=("1f1b",),
                      tensor_parallel=tensor_parallel)
            start = time.process_time()
            try:
                plan = make_tp_plan(cluster, model, job)
            except InfeasibleError as exc:  # nothing fits at this size: note it, go on
                tried.append({"mbs": mbs, "margin_gb": margin, "error": str(exc)[:120]})
                break
            finally:
                plan_s += time.process_time() - start
            own = evaluate(cluster, model, plan, BATCH).iteration_s
            as_sailor, micro = sailor_plan(plan, cluster, merge="none")
            if not _profiled(sailor, plan, cluster):
                tried.append({"mbs": mbs, "margin_gb": margin, "error": "unprofiled TP degree"})
                break
            if not sailor.sim.check_config_fits(as_sailor):
                recompute = any(s.recompute for g in plan.groups for s in g.stages)
                tried.append({"mbs": mbs, "margin_gb": margin, "fits_sailor": False,
                              "recompute": recompute})
                if recompute:  # Sailor has no recompute: less memory will not help
                    break
                continue
            per_group = sailor.sailor_time(as_sailor, micro)
            merged = sailor.sailor_time(*sailor_plan(plan, cluster, merge="samples"))
            by_cuts = sailor.sailor_time(*sailor_plan(plan, cluster, merge="cuts"))
            t = min(per_group, merged, by_cuts)
            tried.append({"mbs": mbs, "margin_gb": margin, "sailor_s": t, "hetpilot_s": own,
                          "sailor_per_group_s": per_group, "sailor_merged_s": merged,
                          "sailor_by_cuts_s": by_cuts,
                          "groups": len(plan.groups),
                          "stages": sorted({len(g.stages) for g in plan.groups}),
                          "tp": sorted({s.tp for g in plan.groups for s in g.stages})})
            if not best or t < best["sailor_s"]:
                best = {"mbs": mbs, "sailor_s": t, "hetpilot_s": own,
                        "plan": serde.plan_to_dict(plan)}
            break
    best["tried"] = tried
    best["plan_cpu_s"] = plan_s
    scored = [t for t in tried if "sailor_s" in t]
    if scored:  # without the oracle over microbatch sizes: the one hetpilot's model rates best
        own_choice = min(scored, key=lambda t: t["hetpilot_s"])
        best["own_choice"] = {"mbs": own_choice["mbs"], "sailor_s": own_choice["sailor_s"],
                              "hetpilot_s": own_choice["hetpilot_s"]}
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sailor", default=os.environ.get("SAILOR_CHECKOUT"),
                    help="a Sailor checkout (a folder named sailor); or $SAILOR_CHECKOUT")
    ap.add_argument("--rows", default="0,1,2", help="trace rows (0: 32+96, 1: 80+240, 2: 128+384)")
    ap.add_argument("--gpus", help="clusters off the trace instead of --rows: A100+V100 counts, "
                                   "multiples of 4, comma-separated (e.g. 64+64,48+176)")
    ap.add_argument("--micro", default="1,2,4,8", help="microbatch sizes hetpilot tries")
    ap.add_argument("--no-tp", action="store_true", help="plan hetpilot without tensor parallelism")
    ap.add_argument("--sailor-planner", action="store_true",
                    help="also run Sailor's planner (its library must be built)")
    ap.add_argument("--build-sailor-planner", action="store_true",
                    help="build Sailor's C++ planner first if it is not built (minutes)")
    ap.add_argument("--link-scale", type=float, default=1.0,
                    help="multiply the converted link speeds (the robustness check)")
    ap.add_argument("--intra-host", choices=INTRA_HOST, default="auto",
                    help="the links inside a node: Sailor's intra-node fit (nvlink), its "
                         "inter-node fit (inter), or nvlink with TP and inter without (auto)")
    ap.add_argument("--kind-scale", choices=("on", "off"), default="on",
                    help="layers carry Sailor's per-kind, per-degree times as kind_scale (on) "
                         "or each device one rate (off, the third round's converter)")
    ap.add_argument("--sailor-cache", type=Path,
                    help="a folder keeping Sailor's plans by commit and cluster, so reruns "
                         "skip Sailor's planner")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    if not args.sailor:
        print("sailor_compare: skipped: no Sailor checkout (pass --sailor PATH or set "
              "SAILOR_CHECKOUT; see this file's docstring for how to get one)")
        return 0
    sailor = Sailor(Path(args.sailor))
    planner = (sailor.planner(args.build_sailor_planner)
               if args.sailor_planner or args.build_sailor_planner else None)
    if (args.sailor_planner or args.build_sailor_planner) and planner is None \
            and args.sailor_cache is None:
        raise SystemExit("Sailor's planner library is not built: add --build-sailor-planner")
    results: dict[str, Any] = {"sailor_commit": sailor.commit(), "rows": []}
    micros = [int(m) for m in args.micro.split(",")]
    if args.gpus:
        cases: list[tuple[int | str, dict[str, int]]] = []
        for i, pair in enumerate(args.gpus.split(",")):
            counts = pair.split("+")
            if len(counts) != 2 or not all(c.isdigit() and int(c) % GPUS_PER_NODE == 0
                                           for c in counts):
                ap.error(f"--gpus: {pair!r} is not A100+V100 counts in multiples of "
                         f"{GPUS_PER_NODE}")
            cases.append((f"gpus{i}", {f"{k}_{ZONE}": int(c)
                                       for k, c in zip(KINDS, counts, strict=True)}))
    else:
        cases = [(r, sailor.rows[r]) for r in (int(x) for x in args.rows.split(","))]
    for r, row in cases:
        out: dict[str, Any] = {"row": r, "gpus": row}
        if args.sailor_planner or args.build_sailor_planner:
            splan, st, search_s = sailor.sailor_best(planner, dict(row), args.sailor_cache)
            stages = splan["pipeline_list"][0]
            micro = [math.ceil(BATCH / (splan["mbs"] * stages["dp"][0]))]
            again = sailor.sailor_time(splan, micro)  # our per-pipeline timing agrees
            assert math.isclose(again, st, rel_tol=1e-9), (again, st)
            cluster, model = hetpilot_inputs(sailor, row, splan["mbs"], tensor_parallel=True,
                                             intra_host=args.intra_host,
                                             kind_scale=args.kind_scale == "on")
            own = evaluate(cluster, model, from_sailor(splan, cluster), BATCH)
            out["sailor"] = {"iteration_s": st, "search_s": search_s, "mbs": splan["mbs"],
                             "in_hetpilot_model_s": own.iteration_s, "valid": own.valid,
                             "error": own.error,
                             "stages": stages["num_stages"], "dp": stages["dp"],
                             "tp": sorted({c[1] for s in stages["tmp_per_stage"] for c in s})}
        out["hetpilot"] = hetpilot_best(sailor, row, micros, tensor_parallel=not args.no_tp,
                                        link_scale=args.link_scale, intra_host=args.intra_host,
                                        kind_scale=args.kind_scale == "on")
        if "sailor" in out and "sailor_s" in out["hetpilot"]:
            out["ratio"] = out["hetpilot"]["sailor_s"] / out["sailor"]["iteration_s"]
            out["own_choice_ratio"] = (out["hetpilot"]["own_choice"]["sailor_s"]
                                       / out["sailor"]["iteration_s"])
        results["rows"].append(out)
        h = out["hetpilot"]
        print(json.dumps({"row": r, "gpus": list(row.values()),
                          "sailor_s": out.get("sailor", {}).get("iteration_s"),
                          "hetpilot_s_in_sailor": h.get("sailor_s"),
                          "hetpilot_s_own": h.get("hetpilot_s"), "mbs": h.get("mbs"),
                          "ratio": out.get("ratio"),
                          "own_choice_in_sailor": h.get("own_choice", {}).get("sailor_s"),
                          "own_choice_mbs": h.get("own_choice", {}).get("mbs"),
                          "own_choice_ratio": out.get("own_choice_ratio"),
                          "plan_cpu_s": round(h["plan_cpu_s"], 2)}),
              flush=True)
    if args.out:
        rows = ",\n".join(json.dumps(r, separators=(",", ":")) for r in results["rows"])
        Path(args.out).write_text(  # one line per row: the plans are long, the rows few
            f'{{"sailor_commit": {json.dumps(results["sailor_commit"])}, "rows": [\n{rows}\n]}}\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
