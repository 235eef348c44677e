"""hetpilot's planner on published per-layer profiles, against simple layouts, brute force and
the published planners' own plans.

    .venv/bin/python bench/planner_profiles.py            # 303 cases, writes bench/RESULTS-planner-profiles.md
    .venv/bin/python bench/planner_profiles.py --quick    # 20 cases, prints only
    .venv/bin/python bench/planner_profiles.py --only metis   # cases whose name contains "metis"
    .venv/bin/python bench/planner_profiles.py --hetpilot-commit HEAD   # the committed planner

About 7 minutes for all cases on the 2-core VM, 100 s of it brute force on the 4-device Metis
cases (10 layers).

Models (``bench/profiles/``, see SOURCES.md there): PipeDream's profiles of VGG16, AlexNet and
ResNet-50 (V100, fp32; with published plans) and of ResNet-18/101, ResNeXt-50/101,
DenseNet-121, Inception-v3 and SqueezeNet (no published plans), AMP's GPT-2 medium profile (V100 and T4, fp16), converted to spec
v1 so that a 15.7 TFLOP/s device reproduces the profiled V100 times; Metis' 10-layer GPT
(hidden 4096; A100, no tensor parallelism), converted so that a 312 TFLOP/s device reproduces
the profiled A100 times.

For every case it runs ``hetpilot.planner.search.make_plan`` (timed), the exhaustive
simple-layouts search (``bench/simple_layouts.py``), brute force
(``hetpilot.planner.bruteforce``) where it is small enough (4 devices and AlexNet with
parameter-free nodes merged, 8 layers, or Metis' 10-layer GPT), and the published plans that
v1 can express (PipeDream's 2 x 2-stage VGG16 and straight pipelines, AMP's GPT-2 plans for its
16-GPU V100 + T4 cluster, Metis' data-parallel x pipeline plans for its 8-A100 and its 4-T4 +
12-A100 clusters).
Everything is scored by the spec v1 reference model; the figure of merit is
hetpilot's iteration time over the best of the others.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _use_tree(argv: list[str]) -> str | None:
    """``--hetpilot-tree DIR``: import hetpilot from another copy of the repository instead
    of the editable install; ``--hetpilot-commit REV``: from commit REV of this repository,
    exported read-only with ``git archive`` (e.g. the committed planner while planner/ has
    uncommitted changes). Lays the copy out as the installed package (as
    scripts/typecheck.sh does). Read before hetpilot is first imported."""
    import atexit
    import shutil
    import tempfile

    def scratch(prefix: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=prefix))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        return path

    if "--hetpilot-commit" in argv:
        import subprocess

        rev = argv[argv.index("--hetpilot-commit") + 1]
        repo = Path(__file__).resolve().parent.parent
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", rev + "^{commit}"],
                             capture_output=True, text=True, check=True).stdout.strip()
        tree = scratch("hetpilot-commit-")
        archive = subprocess.run(["git", "-C", str(repo), "archive", sha], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        label = f"commit `{sha[:12]}` (`--hetpilot-commit {rev}`, exported with git archive)"
    elif "--hetpilot-tree" in argv:
        tree = Path(argv[argv.index("--hetpilot-tree") + 1]).resolve()
        label = f"`{tree}` (`--hetpilot-tree`)"
    else:
        return None
    pkg = scratch("hetpilot-tree-") / "hetpilot"
    pkg.mkdir()
    for f in (tree / "hetpilot").iterdir():
        (pkg / f.name).symlink_to(f)
    for name in ("planner", "sim", "daemon", "agents", "trainer", "client", "adapt", "demo"):
        if (tree / name).is_dir():
            (pkg / name).symlink_to(tree / name)
    (pkg / "v1").symlink_to(tree / "proto" / "hetpilot" / "v1")
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()
                        and "editable" not in getattr(f, "__name__", "").lower()]
    sys.path.insert(0, str(pkg.parent))
    return label


TREE = _use_tree(sys.argv)

from hetpilot.planner import serde  # noqa: E402
from hetpilot.planner.bruteforce import brute_force  # noqa: E402
from hetpilot.planner.refmodel import evaluate, stage_memory_mb  # noqa: E402
from hetpilot.planner.search import make_plan  # noqa: E402
from hetpilot.planner.types import (  # noqa: E402
    Cluster,
    Device,
    Group,
    Job,
    Link,
    Model,
    Network,
    Plan,
    Stage,
)
from simple_layouts import device_order, search  # noqa: E402

ROOT = Path(__file__).resolve().parent
PROFILES = ROOT / "profiles"
THRESHOLD = 1.02

V100 = 15.7
"""TFLOP/s of the profiling V100 (the converter's T_ref): reproduces the profiled times."""
MEMORY_GB = 16.0
"""V100 16 GB (PipeDream's cluster A, AWS p3.8xlarge) and T4 16 GB (g4dn)."""
NVLINK_MEMORY_GB = 32.0
"""The fast devices of NVLink-class hosts (``hier300/25``): V100 32 GB (DGX-1, p3dn)."""


A100 = 312.0
"""TFLOP/s declared for Metis' profiling A100 (convert.py's A100_TFLOPS, the fp16/bf16 dense
tensor-core datasheet rate): reproduces Metis' profiled times."""
METIS_T4 = 65.0
"""The slow device of the Metis cases: a T4 (Metis' own heterogeneous results pair the A100 with
T4s), at its fp16 tensor-core datasheet rate: 312 / 65 = 4.8x slower than the A100. Metis
publishes no T4 profile and its README gives no ratio, so this is an assumption (SOURCES.md)."""
GIB = 1.073741824
"""GB (10^9 bytes) per GiB: Metis' cluster files give memory in GiB and bandwidth in GiB/s."""
A100_MEMORY_GB = 80 * GIB
T4_MEMORY_GB = 15 * GIB
"""Metis' clusterfile: A100 80, T4 15 (GiB)."""


def _t4() -> float:
    return float(json.loads((PROFILES / "amp-gpt2-medium.times.json").read_text())["T4_tflops"])


# -- models and jobs ------------------------------------------------------------

@dataclass(frozen=True)
class ModelCase:
    key: str
    file: str
    per_device_batch: int | None  # global = per_device_batch * devices; None: fixed global
    global_batch: int
    micro: int
    slow_tflops: Callable[[], float]
    fast_tflops: float = V100
    fast_memory_gb: float | None = None  # None: the network's (16 GB, 32 GB on hier300/25)
    slow_memory_gb: float = MEMORY_GB


MODELS = [
    # PipeDream's per-worker minibatches (driver_configs): VGG16 64, AlexNet 256, ResNet-50 128;
    # microbatches of a quarter of that, so a replica runs 4 and a 4-stage pipeline 16.
    ModelCase("vgg16", "pipedream-vgg16.json", 64, 0, 16, lambda: V100 / 2),
    ModelCase("alexnet", "pipedream-alexnet.json", 256, 0, 64, lambda: V100 / 2),
    ModelCase("resnet50", "pipedream-resnet50.json", 128, 0, 32, lambda: V100 / 2),
    # AMP's heterogeneous-cluster experiment: global batch 32, microbatch 1; slow = its T4.
    ModelCase("gpt2", "amp-gpt2-medium.json", None, 32, 1, _t4),
]
# PipeDream's other image-classification profiles (bench/profiles/SOURCES.md): no published
# plans; per-worker minibatch = the profiled one (the only batch PipeDream gives for them),
# microbatches of a quarter of it, slow = half speed, as for the three above.
MORE_PIPEDREAM = [
    ModelCase(key, f"pipedream-{key}.json", batch, 0, batch // 4, lambda: V100 / 2)
    for key, batch in (("resnet18", 256), ("resnet101", 64), ("resnext50", 128),
                       ("resnext101", 64), ("densenet121", 64), ("inception_v3", 128),
                       ("squeezenet1_0", 256))
]
COARSE_ALEXNET = ModelCase("alexnet-coarse", "pipedream-alexnet-coarse.json", 256, 0, 64,
                           lambda: V100 / 2)
# Metis' GPT: global batch 128 (every Metis result and its README), microbatch 2 (SOURCES.md:
# the profiled batch the work comes from; the largest at which a replica fits an A100-80GB by
# Metis' memory figures, and Metis' own pick for its best plan without tensor parallelism);
# A100 80 GiB, slow = T4 15 GiB at the assumed METIS_T4.
METIS = ModelCase("metis-gpt3", "metis-gpt3.json", None, 128, 2, lambda: METIS_T4,
                  fast_tflops=A100, fast_memory_gb=A100_MEMORY_GB, slow_memory_gb=T4_MEMORY_GB)


def load_model(mc: ModelCase) -> Model:
    return serde.model_from_dict(json.loads((PROFILES / mc.file).read_text()))


def job_for(mc: ModelCase, devices: int) -> Job:
    batch = mc.per_device_batch * devices if mc.per_device_batch else mc.global_batch
    return Job(global_batch=batch, microbatch_size=mc.micro, schedules=("1f1b", "gpipe"))


# -- clusters -------------------------------------------------------------------

@dataclass(frozen=True)
class Net:
    key: str
    per_host: int  # devices per host (1: every device on its own host)
    intra: float
    inter: float
    fast_memory_gb: float = MEMORY_GB


NETS = [
    Net("flat8", 1, 8.0, 8.0),
    Net("flat25", 1, 25.0, 25.0),
    Net("hier300/25", 4, 300.0, 25.0, NVLINK_MEMORY_GB),
    Net("hier100/8", 4, 100.0, 8.0),
]
LATENCY_US = 10.0


def make_cluster(n: int, net: Net, slow: float | None, mc: ModelCase | None = None) -> Cluster:
    """n devices, host-major; with ``slow``, the second half (by host order) runs at it. The
    model case sets the fast devices' speed and memory and the slow ones' memory (default:
    V100 16 GB, 32 GB on NVLink hosts, slow ones 16 GB)."""
    fast = mc.fast_tflops if mc is not None else V100
    fast_memory = (mc.fast_memory_gb if mc is not None and mc.fast_memory_gb is not None
                   else net.fast_memory_gb)
    slow_memory = mc.slow_memory_gb if mc is not None else MEMORY_GB
    devices = []
    for i in range(n):
        host = i // net.per_host
        is_slow = slow is not None and i >= n // 2
        devices.append(Device(id=f"h{host}:{i % net.per_host}", host=f"h{host}",
                              tflops=slow if slow is not None and is_slow else fast,
                              memory_gb=slow_memory if is_slow else fast_memory))
    return Cluster(devices=tuple(devices),
                   network=Network(intra_host_gbps=net.intra, inter_host_gbps=net.inter,
                                   latency_us=LATENCY_US))


def amp_cluster() -> Cluster:
    """AMP's heterogeneous cluster (src/het_cluster.py): three p3.8xlarge hosts (4 V100,
    170 Gbit/s inside, 10 Gbit/s out) and one g4dn.12xlarge (4 T4, 50 Gbit/s inside and out;
    the slower end, 10, bounds its links to the others)."""
    t4 = _t4()
    devices = [Device(id=f"p3-{h}:{i}", host=f"p3-{h}", tflops=V100, memory_gb=MEMORY_GB)
               for h in range(3) for i in range(4)]
    devices += [Device(id=f"g4:{i}", host="g4", tflops=t4, memory_gb=MEMORY_GB) for i in range(4)]
    g4 = [f"g4:{i}" for i in range(4)]
    links = tuple(Link(a=a, b=b, gbps=50.0) for i, a in enumerate(g4) for b in g4[i + 1:])
    return Cluster(devices=tuple(devices),
                   network=Network(intra_host_gbps=170.0, inter_host_gbps=10.0,
                                   latency_us=LATENCY_US, device_links=links))


def metis_cluster(hosts: list[tuple[str, int]]) -> Cluster:
    """A cluster of Metis' clusterfile (results/): hosts in Metis' rank order, each ``(type,
    devices)``; A100 312 TFLOP/s, 80 GiB, 46 GiB/s inside a host; T4 METIS_T4, 15 GiB, 50 GiB/s
    inside; 10 GiB/s between hosts (the clusterfile's inter_bandwidth; Metis' own
    ``get_inter_bandwidth`` returns the intra figure instead, a bug we do not copy)."""
    spec = {"A100": (A100, A100_MEMORY_GB), "T4": (METIS_T4, T4_MEMORY_GB)}
    devices, links = [], []
    for h, (kind, count) in enumerate(hosts):
        tflops, memory = spec[kind]
        ids = [f"{kind.lower()}-{h}:{i}" for i in range(count)]
        devices += [Device(id=d, host=f"{kind.lower()}-{h}", tflops=tflops, memory_gb=memory)
                    for d in ids]
        if kind == "T4":
            links += [Link(a=a, b=b, gbps=50 * GIB * 8) for i, a in enumerate(ids)
                      for b in ids[i + 1:]]
    return Cluster(devices=tuple(devices),
                   network=Network(intra_host_gbps=46 * GIB * 8, inter_host_gbps=10 * GIB * 8,
                                   latency_us=LATENCY_US, device_links=tuple(links)))


METIS_CLUSTERS = [
    # (name, naming the results/ file the cluster comes from; hosts in Metis' rank order)
    ("Metis' 8 x A100 (homo_cost_model)", [("A100", 4), ("A100", 4)]),
    ("Metis' 4 x A100 + 4 x T4 (het_search_space)", [("A100", 4), ("T4", 4)]),
    ("Metis' 4 x T4 + 12 x A100 (hetero_cost_model)",
     [("T4", 4), ("A100", 4), ("A100", 4), ("A100", 4)]),
]


def pipedream_a(n: int) -> Cluster:
    """PipeDream's cluster A: hosts of 4 V100 on PCIe (taken as 100 Gbit/s), 10 Gbit/s Ethernet."""
    return make_cluster(n, Net("pipedreamA", 4, 100.0, 10.0), None)


# -- cases ----------------------------------------------------------------------

@dataclass
class Case:
    name: str
    cluster: Cluster
    model_case: ModelCase
    job: Job
    brute: bool = False
    published: list[dict[str, Any]] = field(default_factory=list)


def _published() -> list[dict[str, Any]]:
    return [p for p in json.loads((PROFILES / "published_plans.json").read_text())
            if p["expressible"]]


def cases(quick: bool, only: str | None = None) -> list[Case]:
    """All cases (or the quick subset), keeping those whose name contains ``only``."""
    out = _all_cases(quick)
    return [c for c in out if only is None or only.lower() in c.name.lower()]


def _all_cases(quick: bool) -> list[Case]:
    pub = _published()
    out = []
    sizes = [4, 16] if quick else [4, 8, 16]
    nets = [NETS[1], NETS[2]] if quick else NETS
    models = [MODELS[0], MODELS[3]] if quick else [*MODELS, *MORE_PIPEDREAM]
    for mc in models:
        for n in sizes:
            for net in nets:
                for hetero in ("homog", "half-slow"):
                    slow = mc.slow_tflops() if hetero == "half-slow" else None
                    cluster = make_cluster(n, net, slow)
                    if mc.key == "gpt2":
                        published = [p for p in pub if p["model"] == "amp-gpt2-medium"
                                     and p["workers"] == n]
                    else:
                        published = [p for p in pub if p["model"] == f"pipedream-{mc.key}"
                                     and _fits_workers(p, n)]
                    out.append(Case(f"{mc.key} / {n} / {net.key} / {hetero}", cluster, mc,
                                    job_for(mc, n), published=published))
    if not quick:
        gpt2 = MODELS[3]
        out.append(Case("gpt2 / 16 / AMP's V100+T4 cluster", amp_cluster(), gpt2,
                        job_for(gpt2, 16),
                        published=[p for p in pub if p["model"] == "amp-gpt2-medium"]))
        for mc, n in ((MODELS[0], 4), (MODELS[0], 16), (MODELS[1], 4)):
            out.append(Case(f"{mc.key} / {n} / PipeDream cluster A", pipedream_a(n), mc,
                            job_for(mc, n),
                            published=[p for p in pub if p["model"] == f"pipedream-{mc.key}"
                                       and _fits_workers(p, n)]))
    if not quick:
        for n in (4, 8, 16):
            for net in NETS:
                for hetero in ("homog", "half-slow"):
                    slow = METIS.slow_tflops() if hetero == "half-slow" else None
                    out.append(Case(f"{METIS.key} / {n} / {net.key} / {hetero}",
                                    make_cluster(n, net, slow, METIS), METIS, job_for(METIS, n),
                                    brute=n == 4,  # 10 layers: 4 to 25 s each
                                    published=[p for p in pub if p["model"] == METIS.file[:-5]
                                               and p["workers"] == n]))
        for name, hosts in METIS_CLUSTERS:
            cluster = metis_cluster(hosts)
            n = len(cluster.devices)
            out.append(Case(f"{METIS.key} / {n} / {name}", cluster, METIS, job_for(METIS, n),
                            published=[p for p in pub if p["model"] == METIS.file[:-5]
                                       and p["workers"] == n]))
    brute_nets = nets
    for net in brute_nets:
        for hetero in ("homog", "half-slow"):
            slow = COARSE_ALEXNET.slow_tflops() if hetero == "half-slow" else None
            out.append(Case(f"alexnet-coarse / 4 / {net.key} / {hetero}", make_cluster(4, net, slow),
                            COARSE_ALEXNET, job_for(COARSE_ALEXNET, 4), brute=True))
    return out


def _fits_workers(plan: dict[str, Any], n: int) -> bool:
    """A published PipeDream plan applies to the cluster with its number of workers."""
    return bool(plan["workers"] == n)


def published_plan(case: Case, entry: dict[str, Any], model: Model) -> Plan | None:
    """A published layout in v1: rank r on the r-th device in host-major order, equal
    samples per group, the job's microbatch, 1f1b, recompute only where memory needs it."""
    devs = device_order(case.cluster)
    starts = [*entry["stage_starts"], model.num_layers]
    groups_ranks = entry["groups_ranks"]
    k = len(groups_ranks)
    total = case.job.microbatches
    if k > total:
        return None
    base, extra = divmod(total, k)
    micro = case.job.microbatch_size
    groups = []
    for g, ranks in enumerate(groups_ranks):
        m = base + (1 if g < extra else 0)
        stages = []
        for j, r in enumerate(ranks):
            d = devs[r]
            stage = Stage(device=d.id, layers=(starts[j], starts[j + 1]))
            flight = min(len(ranks) - j, m)
            if stage_memory_mb(model, stage, micro, flight) > 1000.0 * d.memory_gb:
                stage = Stage(device=d.id, layers=stage.layers, recompute=True)
            stages.append(stage)
        groups.append(Group(samples=m * micro, stages=tuple(stages)))
    return Plan(microbatch_size=micro, schedule="1f1b", groups=tuple(groups))


# -- running --------------------------------------------------------------------

@dataclass
class Row:
    case: Case
    hetpilot_s: float
    plan_s: float
    hetpilot_label: str
    simple_s: float
    simple_label: str
    simple_search_s: float
    families: dict[str, float]
    brute_s: float | None = None
    brute_search_s: float | None = None
    published: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def others(self) -> float:
        vals = [self.simple_s, *self.published.values()]
        if self.brute_s is not None:
            vals.append(self.brute_s)
        return min(vals)

    @property
    def ratio(self) -> float:
        return self.hetpilot_s / self.others

    @property
    def winner(self) -> str:
        best = self.others
        if self.brute_s is not None and self.brute_s <= best * (1 + 1e-9) and \
                self.brute_s < self.simple_s * (1 - 1e-9):
            return "brute force"
        for name, t in self.published.items():
            if t <= best * (1 + 1e-9) and t < self.simple_s * (1 - 1e-9):
                return f"published: {name}"
        return self.simple_label


def describe(plan: Plan, cluster: Cluster) -> str:
    """K groups x stages, with the hosts each group spans."""
    host = {d.id: d.host for d in cluster.devices}
    shapes = Counter(len(g.stages) for g in plan.groups)
    shape = " + ".join(f"{c}x{s}st" for s, c in sorted(shapes.items()))
    spans = {len({host[s.device] for s in g.stages}) for g in plan.groups}
    cuts = sorted({tuple(s.layers[0] for s in g.stages[1:]) for g in plan.groups})
    return (f"{shape} {plan.schedule}, hosts/group {'/'.join(map(str, sorted(spans)))}, "
            f"cuts {'; '.join(str(list(c)) for c in cuts)}")


def run_case(case: Case) -> Row:
    model = load_model(case.model_case)
    cluster, job = case.cluster, case.job
    t0 = time.perf_counter()
    error = None
    try:
        plan = make_plan(cluster, model, job)
        took = time.perf_counter() - t0
        ev = evaluate(cluster, model, plan, job.global_batch)
        if not ev.valid or ev.iteration_s is None:
            raise RuntimeError(f"hetpilot's plan is invalid: {ev.error}")
        ours, label = ev.iteration_s, describe(plan, cluster)
    except Exception as exc:  # a planner under change may fail: report, do not stop
        took = time.perf_counter() - t0
        ours, label, error = math.inf, "error", f"{type(exc).__name__}: {exc}"
    t0 = time.perf_counter()
    simple = search(cluster, model, job)
    simple_took = time.perf_counter() - t0
    row = Row(case, ours, took, label, simple.iteration_s, simple.label, simple_took,
              simple.per_layout, error=error)
    if case.brute:
        t0 = time.perf_counter()
        row.brute_s, _ = brute_force(cluster, model, job)
        row.brute_search_s = time.perf_counter() - t0
    for entry in case.published:
        plan_p = published_plan(case, entry, model)
        name = _pub_name(entry)
        if plan_p is None:
            continue
        ev = evaluate(cluster, model, plan_p, job.global_batch)
        row.published[name] = ev.iteration_s if ev.valid and ev.iteration_s else math.inf
    return row


def _pub_name(entry: dict[str, Any]) -> str:
    if entry["model"] == "metis-gpt3":
        return f"Metis dp{entry['dp']} pp{entry['pp']}"
    if entry["model"] == "amp-gpt2-medium":
        k = len(entry["groups_ranks"])
        return f"AMP dp{k} pp{len(entry['groups_ranks'][0])}"
    k = len(entry["groups_ranks"])
    s = len(entry["groups_ranks"][0])
    return f"PipeDream {k}x{s}-stage"


# -- report ---------------------------------------------------------------------

def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    return "OOM" if math.isinf(x) else f"{x:.4f}"


def provenance() -> str:
    """Which planner ran: the file imported and, in a git checkout, its commit and changes."""
    import subprocess

    import hetpilot.planner.search as mod

    where = Path(mod.__file__).resolve().parent.parent
    if TREE is not None:
        return f"hetpilot imported from {TREE}"
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--",
                                "planner"], capture_output=True, text=True,
                               check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return f"hetpilot imported from `{where}`"
    changed = [line[3:] for line in dirty if line.strip()]
    return (f"hetpilot from the working tree at commit `{head}`"
            + (f", with uncommitted changes to {', '.join(changed)}" if changed else ""))


def report(rows: list[Row], wall: float, command: str, quick: bool, only: str | None = None) -> str:
    scope = "quick subset" if quick else "all cases"
    if only:
        scope += f" whose name contains {only!r}"
    ratios = [r.ratio for r in rows if math.isfinite(r.ratio)]
    over = [r for r in rows if r.ratio > THRESHOLD]
    worst = max(rows, key=lambda r: r.ratio)
    within = sum(1 for r in rows if r.ratio <= THRESHOLD)
    geo = statistics.geometric_mean(ratios) if ratios else math.nan
    lines = [
        "# hetpilot on published profiles: against simple layouts, brute force and published plans",
        "",
        f"Date: {datetime.date.today().isoformat()}. Command: `{command}` ({scope}; "
        f"wall time {wall:.0f} s on the 2-core VM, CPU only). Planner: {provenance()}.",
        "",
        "Models are the published per-layer profiles converted to spec v1 (`bench/profiles/`,",
        "SOURCES.md): PipeDream's VGG16, AlexNet and ResNet-50 (V100, fp32) and AMP's GPT-2 medium",
        "(V100 and T4, fp16); PipeDream's profiles of ResNet-18/101, ResNeXt-50/101, DenseNet-121,",
        "Inception-v3 and SqueezeNet 1.0 too (no published plans; one layer per single-tensor cut",
        "point, so DenseNet and Inception cut only between dense blocks and modules). A device of 15.7 TFLOP/s reproduces the profiled V100 times; *slow*",
        "devices run at half that for the PipeDream models and at AMP's measured T4 speed",
        f"({_t4():.2f} TFLOP/s) for GPT-2. Devices have 16 GB (V100, T4), the fast ones of "
        "`hier300/25` 32 GB (NVLink V100 servers). Networks: `flat8`/`flat25` one",
        "device per host, 8 or 25 Gbit/s between any two; `hier300/25` and `hier100/8` hosts of 4",
        "(300 or 100 Gbit/s inside a host, 25 or 8 between hosts); latency 10 us. *half-slow*: the",
        "second half of the hosts (of the devices, for 4 devices on one host) is slow. Jobs:",
        "PipeDream's per-worker minibatch times the devices (VGG16 64, AlexNet 256, ResNet-50 128;",
        "the profiled minibatch for the others: ResNet-18 and SqueezeNet 256, ResNeXt-50 and",
        "Inception-v3 128, ResNet-101, ResNeXt-101 and DenseNet-121 64)",
        "in microbatches of a quarter of it; GPT-2 AMP's global batch 32 in microbatches of 1.",
        "Metis' GPT (`metis-gpt3`, 10 layers, hidden 4096; Metis' A100 profile without tensor",
        f"parallelism): A100 at {A100:.0f} TFLOP/s (reproduces the profiled times) with 80 GiB; "
        f"*slow* is a T4 at {METIS_T4:.0f}",
        "TFLOP/s (an assumed 4.8x, the fp16 datasheet ratio) with 15 GiB; Metis' global batch 128",
        "in microbatches of 2; the same four networks, and Metis' own clusters (hosts of 4, 46",
        "GiB/s inside an A100 host, 50 inside a T4 host, 10 GiB/s between hosts).",
        "",
        "*others* is the best of: the exhaustive simple-layouts search (`bench/simple_layouts.py`:",
        "K identical pipelines of at most 4 stages, every cut, group-major and stage-major",
        "placement, 1f1b and gpipe, even or speed-proportional samples, recompute only where",
        "memory needs it), brute force (`planner/bruteforce.py`, only on the 4-device AlexNet cases",
        "with parameter-free nodes merged, 8 layers, and the 4-device Metis cases, 10 layers) and",
        "the published plans that v1 can express.",
        "All times are reference-model iteration times (spec v1 section 5).",
        "",
        "## Summary",
        "",
        f"- cases: **{len(rows)}**; hetpilot within {THRESHOLD:.2f}x of the best other: "
        f"**{within}**; over {THRESHOLD:.2f}x: **{len(over)}**",
        f"- worst ratio hetpilot / best other: **{worst.ratio:.3f}x** ({worst.case.name}; "
        f"winner: {worst.winner})",
        f"- geometric mean of the ratio: **{geo:.3f}x**; best ratio {min(ratios):.3f}x",
        f"- hetpilot planning time: median {statistics.median(r.plan_s for r in rows):.2f} s, "
        f"max {max(r.plan_s for r in rows):.2f} s; simple-layouts search: median "
        f"{statistics.median(r.simple_search_s for r in rows):.2f} s, max "
        f"{max(r.simple_search_s for r in rows):.2f} s",
    ]
    errors = [r for r in rows if r.error]
    if errors:
        lines.append(f"- make_plan failed on {len(errors)} cases: "
                     + "; ".join(f"{r.case.name}: {r.error}" for r in errors[:5]))
    fam = Counter(_family_of(r) for r in over)
    if over:
        lines += ["", "Cases over the threshold, by the layout that beats hetpilot:", ""]
        lines += [f"- {k}: {v}" for k, v in fam.most_common()]
        by_model = Counter(r.case.model_case.key for r in over)
        lines += ["", "By model: " + ", ".join(f"{k} {v}" for k, v in by_model.most_common())]
        by_net = Counter(r.case.name.split(" / ")[2] for r in over)
        lines += ["By network: " + ", ".join(f"{k} {v}" for k, v in by_net.most_common())]
        by_n = Counter(r.case.name.split(" / ")[1] for r in over)
        lines += ["By devices: " + ", ".join(f"{k} {v}" for k, v in sorted(by_n.items(),
                                                                            key=lambda kv:
                                                                            int(kv[0])))]
        lines += ["", "The ten worst:", "",
                  "| case | ratio | hetpilot's plan | what beats it |", "|---|---:|---|---|"]
        for r in sorted(over, key=lambda r: -r.ratio)[:10]:
            lines.append(f"| {r.case.name} | {r.ratio:.3f}x | {r.hetpilot_label} | "
                         f"{r.winner} |")
    amp = [r for r in rows if "AMP's" in r.case.name]
    if amp and amp[0].published:
        measured = {"AMP dp4 pp4": 1.47, "AMP dp2 pp8": 1.28, "AMP dp1 pp16": 1.52}
        lines += ["", "AMP's own plans on AMP's cluster, reference model against the times AMP "
                  "measured (`src/results/het_cluster_results.txt`): " + "; ".join(
                      f"{k} {v:.3f} s (measured {measured[k]:.2f} s)"
                      for k, v in amp[0].published.items() if k in measured) + "."]
    metis = [r for r in rows if r.case.model_case.key == METIS.key and "Metis'" in r.case.name
             and r.published]
    own = [(r, p) for r in metis for p in r.case.published
           if p["source"].rsplit("/", 1)[1] in r.case.name and _pub_name(p) in r.published]
    if own:
        lines += ["", "Metis' own plans on the clusters it costed them for, reference model against "
                  "the cost Metis' cost model predicts (`results/`): " + "; ".join(
                      f"{_pub_name(p)} {_fmt(r.published[_pub_name(p)])} s (Metis "
                      f"{p['metis_cost_ms'] / 1000:.3f} s) on {r.case.name.split(' / ')[2]}"
                      for r, p in own) + "."]
    lines += [
        "",
        "## Per case",
        "",
        "Ratio = hetpilot / best other (above 1: hetpilot is slower). Simple-layout labels:",
        "K groups, S stages, family (`dp` = replicas, `pipeline` = one group, `group-major`,",
        "`stage-major`), schedule, sample split, device subset, cut points.",
        "",
        "| case | hetpilot (s) | plan (s) | hetpilot's plan | simple layouts (s) | best simple "
        "layout | stage-major best (s) | group-major best (s) | brute force (s) | published (s) "
        "| ratio |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        pub = "; ".join(f"{k} {_fmt(v)}" for k, v in r.published.items())
        ratio = f"**{r.ratio:.3f}x**" if r.ratio > THRESHOLD else f"{r.ratio:.3f}x"
        lines.append(
            f"| {r.case.name} | {_fmt(r.hetpilot_s)} | {r.plan_s:.2f} | {r.hetpilot_label} | "
            f"{_fmt(r.simple_s)} | {r.simple_label} | {_fmt(r.families.get('stage-major'))} | "
            f"{_fmt(r.families.get('group-major'))} | {_fmt(r.brute_s)} | {pub} | "
            f"{ratio} |")
    lines += ["", "## Published plans", "",
              *published_notes(), ""]
    return "\n".join(lines)


def _family_of(row: Row) -> str:
    w = row.winner
    if w.startswith(("published", "brute")):
        return w
    return w.split()[2]


def published_notes() -> list[str]:
    out = []
    for p in json.loads((PROFILES / "published_plans.json").read_text()):
        tag = "expressible, evaluated" if p["expressible"] else f"not expressible: {p['why']}"
        out.append(f"- `{p['source']}` ({p.get('note', '')}): {tag}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=None, metavar="SUBSTRING",
                        help="run only the cases whose name contains SUBSTRING (ignoring case); "
                             "writes no markdown unless --out is given")
    parser.add_argument("--out", default=None,
                        help="markdown output (default: bench/RESULTS-planner-profiles.md for the"
                             " full run, none for --quick)")
    parser.add_argument("--json", default=None, help="also write per-case results as JSON")
    parser.add_argument("--hetpilot-tree", default=None,
                        help="import hetpilot from this copy of the repository")
    parser.add_argument("--hetpilot-commit", default=None,
                        help="import hetpilot from this commit of the repository (git archive "
                             "into a temporary directory), e.g. HEAD")
    args = parser.parse_args()
    command = " ".join([".venv/bin/python bench/planner_profiles.py", *sys.argv[1:]])
    # import cvxpy and warm the planner's caches on a tiny case, so plan times are per case
    warm = cases(True)[0]
    make_plan(warm.cluster, load_model(warm.model_case), warm.job)
    t0 = time.perf_counter()
    rows = []
    selected = cases(args.quick, args.only)
    if not selected:
        parser.error(f"no case name contains {args.only!r}")
    for case in selected:
        row = run_case(case)
        rows.append(row)
        print(f"{row.ratio:7.3f}x  hetpilot {_fmt(row.hetpilot_s)} ({row.plan_s:.2f} s)  "
              f"others {_fmt(row.others)}  {case.name}  [{row.winner}]", flush=True)
    wall = time.perf_counter() - t0
    text = report(rows, wall, command, args.quick, args.only)
    out = args.out or (None if args.quick or args.only else
                       str(ROOT / "RESULTS-planner-profiles.md"))
    if out:
        Path(out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps([{
            "case": r.case.name, "hetpilot_s": r.hetpilot_s, "plan_s": r.plan_s,
            "simple_s": r.simple_s, "simple_label": r.simple_label, "brute_s": r.brute_s,
            "published": r.published, "ratio": r.ratio, "families": r.families,
            "hetpilot_plan": r.hetpilot_label, "error": r.error} for r in rows], indent=1))
    print(text)


if __name__ == "__main__":
    main()
