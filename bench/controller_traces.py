"""Controller trace library: does the Lyapunov controller spend its budget where it buys speed?

    .venv/bin/python bench/controller_traces.py [--quick] [--traces N] [--slots N]
        [--only 0,5,...] [--md bench/RESULTS-controller.md] [--plots bench/img/controller]
        [--json out.json]

A library of seeded random price traces (issue 17), each a scenario for the
simulator (``hetpilot.sim``: the same engine, policies and search cache as
``hetpilot sim`` and ``bench/sim_compare.py``):

- four cluster mixes: ``mixed12`` (2 H100, 4 A100, 4 V100, 2 A10G on four hosts,
  slow links to the A10G host; a GPT-2-medium-sized model), ``spot16`` (two
  H100 spot zones, an A100 and a V100 host; the same model), ``mid8`` (A100,
  V100 and L4 hosts; BERT-large), ``demo4`` (the demo's EMULATED 4 devices,
  speeds 4:4:2:1 and $3/3/2/1 per hour; a small MLP);
- four price shapes for the swinging hosts: ``ou`` (mean-reverting spot
  price, a new price every slot), ``steps`` (a new level every 10-40 slots,
  0.3x-1.7x of list), ``daily`` (a 48-slot cycle, +-60%, with noise) and
  ``spikes`` (0.7x of list with 3-6x spikes of 2-8 slots);
- the swinging hosts are the fastest tier's (each host its own zone), or on
  the second half of the library every host;
- budgets tight, mid and loose (0.3x, 0.5x, 0.75x the list price of the whole
  cluster, never below the cheapest plan);
- the job's V cycles through 0.1, 1, 10 and 100 (the contract's units:
  ``V*T`` seconds against ``Q*c`` ($/h)^2).

For each trace the policies are ``lyapunov`` with the default V (the job
giving none: ``V = 0``), ``lyapunov`` with the trace's explicit V,
``budget-greedy`` (the fastest plan that fits the budget each slot),
``static`` (the plan budget-greedy makes at slot 0, kept) and the offline
oracle (:mod:`hetpilot.sim.oracle`, the bound of ``bench/sim_oracle.py``:
knows every price in advance, switches for free, time-shares within a
slot). Iteration times are with switching time charged (the simulator's
``effective_iteration_s``). Plan versions are counted per 100 slots.

``--quick``: 8 of the traces (every mix and every shape twice), 120 slots
each, for a check in about a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetpilot.planner.catalog import make_cluster, transformer
from hetpilot.planner.controller import Controller, ControllerConfig, planner_search
from hetpilot.planner.types import Cluster, Device, Job, Layer, Link, Model, Network
from hetpilot.sim.engine import SlotRecord, simulate, summarize
from hetpilot.sim.oracle import OracleBound, lagged_bound, oracle_bound
from hetpilot.sim.policies import CachedSearch
from hetpilot.sim.scenario import Event, Scenario, Timeline

KIND = "price_per_hour"
SHAPES = ("ou", "steps", "daily", "spikes")
BUDGET_LEVELS = {"tight": 0.3, "mid": 0.5, "loose": 0.75}
JOB_VS = (0.1, 1.0, 10.0, 100.0)
QUICK = (0, 5, 10, 15, 3, 6, 9, 12)
"""``--quick``: every mix and every shape twice, each budget level."""
DEFAULT_V = 0.0
"""What the bench passes for "the job gives no V" (the daemon's and the file's 0)."""


# -- cluster mixes -----------------------------------------------------------------------

@dataclass(frozen=True)
class Mix:
    name: str
    cluster: Cluster
    model: Model
    global_batch: int
    microbatch_size: int
    iterations_per_slot: int
    fast_hosts: tuple[str, ...]
    """The fastest tier's hosts (each its own spot zone)."""


def _mlp() -> Model:
    """The demo's digits MLP (64-128-128-10), profiled analytically per sample."""
    def lin(name: str, i: int, o: int) -> Layer:
        f = 2 * i * o / 1e9
        return Layer(name=name, fwd_gflop=f, bwd_gflop=2 * f, out_mb=4 * o / 1e6,
                     act_mb=4 * (i + o) / 1e6, param_mb=4 * (i * o + o) / 1e6)
    relu = Layer(name="relu", fwd_gflop=128 / 1e9, bwd_gflop=128 / 1e9, out_mb=512 / 1e6,
                 act_mb=512 / 1e6, param_mb=0.0)
    return Model(name="digits-mlp", optimizer_factor=3.0,
                 layers=(lin("fc1", 64, 128), relu, lin("fc2", 128, 128), relu, lin("fc3", 128, 10)))


def _demo_cluster() -> Cluster:
    """The demo's EMULATED devices: speeds 4:4:2:1, $3/3/2/1 per hour, 10 Gbit/s links."""
    devices = []
    for host, tflops, count, price, watts in (("hostA", 1e-4, 2, 3.0, 300.0),
                                              ("hostB", 5e-5, 1, 2.0, 250.0),
                                              ("hostC", 2.5e-5, 1, 1.0, 150.0)):
        for i in range(count):
            devices.append(Device(id=f"{host}:{i}", host=host, tflops=tflops, memory_gb=16.0,
                                  price_per_hour=price, power_watts=watts))
    links = tuple(Link(a=a, b=b, gbps=10.0, latency_us=50.0)
                  for a, b in (("hostA", "hostB"), ("hostA", "hostC"), ("hostB", "hostC")))
    return Cluster(devices=tuple(devices), network=Network(
        intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=50.0, host_links=links))


def mixes() -> dict[str, Mix]:
    gpt_m = transformer("gpt-1024x24", hidden=1024, blocks=24, seq=1024, heads=16, vocab=50257)
    bert = transformer("bert-large", hidden=1024, blocks=24, seq=512, heads=16, vocab=30522)
    return {
        "mixed12": Mix("mixed12", make_cluster([("H100", 2), ("A100", 4), ("V100", 4), ("A10G", 2)],
                                               slow_links=[(0, 3, 25.0), (1, 3, 25.0)]),
                       gpt_m, 256, 4, 200, ("h0",)),
        "spot16": Mix("spot16", make_cluster([("H100", 4), ("H100", 4), ("A100", 4), ("V100", 4)]),
                      gpt_m, 256, 4, 200, ("h0", "h1")),
        "mid8": Mix("mid8", make_cluster([("A100", 2), ("V100", 2), ("L4", 4)]),
                    bert, 128, 4, 200, ("h0",)),
        "demo4": Mix("demo4", _demo_cluster(), _mlp(), 64, 4, 50, ("hostA",)),
    }


# -- price traces ------------------------------------------------------------------------

def price_multipliers(shape: str, rng: random.Random, slots: int) -> list[float]:
    """Per-slot multiplier of a host's list price; slot 0 is at 1.0 (list)."""
    out = [1.0]
    if shape == "ou":
        x = 1.0
        for _ in range(1, slots):
            x += 0.15 * (1.0 - x) + rng.gauss(0.0, 0.18)
            x = min(max(x, 0.25), 2.5)
            out.append(x)
    elif shape == "steps":
        level, left = 1.0, rng.randint(10, 40)
        for _ in range(1, slots):
            left -= 1
            if left <= 0:
                level, left = rng.uniform(0.3, 1.7), rng.randint(10, 40)
            out.append(level)
    elif shape == "daily":
        period, phase = 48, rng.uniform(0, 2 * math.pi)
        base = math.sin(phase)
        for t in range(1, slots):
            x = 1.0 + 0.6 * (math.sin(2 * math.pi * t / period + phase) - base) + rng.gauss(0, 0.05)
            out.append(min(max(x, 0.2), 2.0))
    elif shape == "spikes":
        left, height = 0, 1.0
        for _ in range(1, slots):
            if left <= 0 and rng.random() < 0.04:
                left, height = rng.randint(2, 8), rng.uniform(3.0, 6.0)
            out.append(0.7 * height if left > 0 else 0.7)
            left -= 1
    else:
        raise ValueError(shape)
    return out


@dataclass(frozen=True)
class Trace:
    index: int
    mix: str
    shape: str
    hosts: str
    """``fast`` (the fastest tier's hosts swing) or ``all``."""
    level: str
    budget: float
    V: float
    scenario: Scenario
    prices: dict[str, list[float]] = field(default_factory=dict)
    """Host -> $/h of each of its devices, per slot."""

    @property
    def name(self) -> str:
        return f"{self.index:02d}-{self.mix}-{self.shape}-{self.hosts}-{self.level}"


def make_trace(index: int, slots: int, mix: Mix, cheapest: float) -> Trace:
    """Trace ``index`` of the library (deterministic in ``index`` and ``slots``)."""
    rng = random.Random(f"hetpilot/controller-traces/{index}")
    shape = SHAPES[(index // 4) % 4]
    hosts = "fast" if index < 16 else "all"
    level = tuple(BUDGET_LEVELS)[(index + index // 4) % 3]
    V = JOB_VS[(index + index // 3) % 4]
    list_total = sum(d.price_per_hour for d in mix.cluster.devices)
    budget = round(max(BUDGET_LEVELS[level] * list_total, 1.15 * cheapest), 2)
    swing = mix.fast_hosts if hosts == "fast" else tuple(dict.fromkeys(d.host for d in mix.cluster.devices))
    list_price = {d.host: d.price_per_hour for d in mix.cluster.devices}
    events: list[Event] = []
    prices: dict[str, list[float]] = {}
    for host in swing:
        mult = price_multipliers(shape, rng, slots)
        prices[host] = [round(list_price[host] * m, 3) for m in mult]
        for t in range(1, slots):
            if prices[host][t] != prices[host][t - 1]:
                for d in mix.cluster.devices:
                    if d.host == host:
                        events.append(Event(slot=t, device=d.id,
                                            set_fields={KIND: prices[host][t]}))
    events.sort(key=lambda e: e.slot)
    job = Job(global_batch=mix.global_batch, microbatch_size=mix.microbatch_size,
              schedules=("1f1b", "gpipe"), budgets={KIND: budget}, V=V)
    sc = Scenario(cluster=mix.cluster, model=mix.model, job=job, slots=slots,
                  events=tuple(events), iterations_per_slot=mix.iterations_per_slot)
    return Trace(index, mix.name, shape, hosts, level, budget, V, sc, prices)


def issue_trace(slots: int, mix: Mix) -> Trace:
    """Issue 17's trace: the mixed cluster whose fastest tier (the H100 host)
    has a mean-reverting spot price, budget $10/h, V = 10."""
    rng = random.Random("hetpilot/controller-traces/issue-17")
    list_price = {d.host: d.price_per_hour for d in mix.cluster.devices}
    mult = price_multipliers("ou", rng, slots)
    prices = {"h0": [round(list_price["h0"] * m, 3) for m in mult]}
    events = [Event(slot=t, device=d.id, set_fields={KIND: prices["h0"][t]})
              for t in range(1, slots) if prices["h0"][t] != prices["h0"][t - 1]
              for d in mix.cluster.devices if d.host == "h0"]
    job = Job(global_batch=mix.global_batch, microbatch_size=mix.microbatch_size,
              schedules=("1f1b", "gpipe"), budgets={KIND: 10.0}, V=10.0)
    sc = Scenario(cluster=mix.cluster, model=mix.model, job=job, slots=slots,
                  events=tuple(events), iterations_per_slot=mix.iterations_per_slot)
    return Trace(-1, mix.name, "ou", "fast", "issue", 10.0, 10.0, sc, prices)


def diagnose(slots: int) -> None:
    """Why V = 10 loses to budget-greedy on issue 17's trace: where its plans sit
    on the cost/time frontier, how often the queue empties, what it forgets."""
    mix = mixes()["mixed12"]
    search = CachedSearch(planner_search, size=512)
    tr = issue_trace(slots, mix)
    tl = Timeline(tr.scenario)
    ctl = Controller(tr.scenario.model, tr.scenario.job,
                     ControllerConfig(iterations_per_slot=tr.scenario.iterations_per_slot),
                     search=search)
    bound = oracle_bound(tl, ctl.candidates, slots, KIND)
    cands = ctl.candidates(tl.truth(0))
    pts = sorted({(round(c.costs[KIND], 2), round(c.iteration_s, 4)) for c in cands})
    cheapest, fastest = pts[0][0], min(pts, key=lambda p: p[1])[0]
    print(f"issue 17 trace: {mix.name}, h0 (2 H100) mean-reverting spot, budget $10/h, "
          f"{slots} slots, {len(cands)} candidates per slot (cheapest ${cheapest}/h, "
          f"fastest at ${fastest}/h)")
    print(f"oracle: T {bound.iteration_s:.4f} s at ${bound.cost:.2f}/h "
          f"(rate {bound.multiplier:.4f} s per $/h)")
    for label, policy, V in (("lyapunov V=10", "lyapunov", None),
                             ("lyapunov V=1000", "lyapunov", 1000.0),
                             ("lyapunov default", "lyapunov", DEFAULT_V),
                             ("budget-greedy", "budget-greedy", None),
                             ("static", "static", None)):
        row, recs = run_policy(tr, tl, search, policy, V)
        costs = [r.costs.get(KIND, 0.0) for r in recs]
        q, lost, empty = 0.0, 0.0, 0
        for c in costs:  # the contract's queue from the true costs, and what its floor drops
            nxt = q + c - tr.budget
            if nxt < 0:
                lost += -nxt
                empty += 1
            q = max(nxt, 0.0)
        near = sum(1 for c in costs if abs(c - tr.budget) <= 0.2 * tr.budget)
        low = sum(1 for c in costs if c <= 0.5 * tr.budget)
        high = sum(1 for c in costs if c >= 1.5 * tr.budget)
        print(f"{label:17s} T {row['T']:.4f} s  spend {row['spend']:.3f} of the budget  "
              f"{row['versions_per_100']:.0f} versions/100 slots  slots at <=50% of the budget "
              f"{low}, within 20% {near}, >=150% {high}; the contract's queue (from the true "
              f"costs) empties in {empty} slots, dropping ${lost / len(costs):.2f}/h of unspent "
              "budget on average")
    # issue 17's flapping: the demo's cluster at a $4/h budget, prices constant
    demo = mixes()["demo4"]
    search = CachedSearch(planner_search, size=64)
    job = Job(global_batch=demo.global_batch, microbatch_size=demo.microbatch_size,
              schedules=("1f1b", "gpipe"), budgets={KIND: 4.0}, V=10.0)
    sc = Scenario(cluster=demo.cluster, model=demo.model, job=job, slots=100,
                  iterations_per_slot=demo.iterations_per_slot)
    tr = Trace(-2, "demo4", "constant", "-", "flapping", 4.0, 10.0, sc, {})
    tl = Timeline(sc)
    print("demo cluster (speeds 4:4:2:1, $3/3/2/1 per hour), budget $4/h, constant prices, 100 slots:")
    for label, policy, V in (("lyapunov V=10", "lyapunov", None), ("lyapunov V=100", "lyapunov", 100.0),
                             ("lyapunov default", "lyapunov", DEFAULT_V),
                             ("budget-greedy", "budget-greedy", None)):
        row, recs = run_policy(tr, tl, search, policy, V)
        first = " ".join(f"{r.costs.get(KIND, 0.0):g}" for r in recs[:14])
        print(f"{label:17s} T {row['T']:.4f} s  spend {row['spend']:.3f}  "
              f"{row['versions_per_100']:.0f} versions/100 slots  $/h of the first 14 slots: {first}")


# -- running ------------------------------------------------------------------------------

@dataclass
class Row:
    trace: str
    mix: str
    shape: str
    hosts: str
    level: str
    budget: float
    job_V: float
    runs: dict[str, dict[str, Any]]
    oracle: OracleBound
    wall_s: float
    lagged: OracleBound | None = None
    """The lag-matched reference (:func:`hetpilot.sim.oracle.lagged_bound`)."""


def run_policy(tr: Trace, tl: Timeline, search: CachedSearch, policy: str,
               V: float | None) -> tuple[dict[str, Any], list[SlotRecord]]:
    recs = list(simulate(tr.scenario, policy, V=V, timeline=tl, search=search))
    s = summarize(recs)
    versions = sum(1 for r in recs if r.switched)  # the first plan included
    return {
        "T": s["avg_effective_iteration_s"],
        "spend": s[f"avg_{KIND}"] / tr.budget,
        "tail_spend": s[f"tail_avg_{KIND}"] / tr.budget,
        "versions_per_100": 100.0 * versions / len(recs),
        "max_Q": s["max_queues"].get(KIND, 0.0),
    }, recs


def run_trace(tr: Trace, search: CachedSearch,
              policies: Sequence[tuple[str, str, float | None]]) -> tuple[Row, dict[str, list[SlotRecord]]]:
    t0 = time.perf_counter()
    tl = Timeline(tr.scenario)
    runs: dict[str, dict[str, Any]] = {}
    records: dict[str, list[SlotRecord]] = {}
    for label, policy, V in policies:
        runs[label], records[label] = run_policy(tr, tl, search, policy, V)
    ctl = Controller(tr.scenario.model, tr.scenario.job,
                     ControllerConfig(iterations_per_slot=tr.scenario.iterations_per_slot),
                     search=search)
    bound = oracle_bound(tl, ctl.candidates, tr.scenario.slots, KIND)
    lagged = lagged_bound(tl, ctl.candidates, tr.scenario.slots, KIND)
    return Row(tr.name, tr.mix, tr.shape, tr.hosts, tr.level, tr.budget, tr.V, runs, bound,
               time.perf_counter() - t0, lagged), records


def cheapest_plan(mix: Mix, search: CachedSearch) -> float:
    job = Job(global_batch=mix.global_batch, microbatch_size=mix.microbatch_size,
              budgets={KIND: 1.0}, V=10.0)
    ctl = Controller(mix.model, job, search=search)
    return min(c.costs[KIND] for c in ctl.candidates(mix.cluster))


# -- reporting ------------------------------------------------------------------------------

def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def markdown(rows: Sequence[Row], main: str, explicit: str) -> str:
    out = []
    head = ["trace", "budget $/h", "job V", f"{main}: spend/budget (tail)", "T s",
            "vs greedy", "vs static", "vs oracle", "vs lag-matched", "versions/100",
            f"{explicit}: spend/budget", "vs greedy", "versions/100",
            "greedy spend/budget", "greedy T s", "static spend/budget", "static T s",
            "oracle T s (spend/budget)", "lag-matched T s (vs oracle)"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for r in rows:
        m, e = r.runs[main], r.runs.get(explicit)
        g, s = r.runs["budget-greedy"], r.runs["static"]
        o = r.oracle
        cells = [r.trace, f"{r.budget:g}", f"{r.job_V:g}",
                 f"{m['spend']:.3f} ({m['tail_spend']:.3f})", f"{m['T']:.4f}",
                 f"{g['T'] / m['T']:.3f}x", f"{s['T'] / m['T']:.3f}x",
                 f"{(m['T'] / o.iteration_s - 1) * 100:+.1f}%",
                 "-" if r.lagged is None else f"{(m['T'] / r.lagged.iteration_s - 1) * 100:+.1f}%",
                 f"{m['versions_per_100']:.0f}"]
        if e is not None:
            cells += [f"{e['spend']:.3f}", f"{g['T'] / e['T']:.3f}x", f"{e['versions_per_100']:.0f}"]
        else:
            cells += ["-", "-", "-"]
        cells += [f"{g['spend']:.3f}", f"{g['T']:.4f}", f"{s['spend']:.3f}", f"{s['T']:.4f}",
                  f"{o.iteration_s:.4f} ({o.cost / r.budget:.3f})",
                  "-" if r.lagged is None else
                  f"{r.lagged.iteration_s:.4f} ({(r.lagged.iteration_s / o.iteration_s - 1) * 100:+.1f}%)"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def targets(rows: Sequence[Row], label: str) -> dict[str, Any]:
    """The issue's targets for policy ``label``."""
    spend_ok, not_slower, speedups, vs_oracle, versions = [], [], [], [], []
    for r in rows:
        m, g = r.runs[label], r.runs["budget-greedy"]
        within = abs(m["spend"] - 1.0) <= 0.02
        # below the budget is fine where the oracle itself cannot spend it
        under_ok = m["spend"] < 1.0 and (not r.oracle.binding
                                         or r.oracle.cost / r.budget < 0.98 + 1e-9)
        spend_ok.append(within or under_ok)
        not_slower.append(m["T"] <= g["T"] * (1 + 1e-9))
        speedups.append(g["T"] / m["T"])
        vs_oracle.append(m["T"] / r.oracle.iteration_s - 1.0)
        versions.append(m["versions_per_100"])
    return {
        "traces": len(rows),
        "spend_within_2pct": sum(spend_ok),
        "spend_failures": [r.trace for r, ok in zip(rows, spend_ok, strict=True) if not ok],
        "not_slower_than_greedy": sum(not_slower),
        "slower_than_greedy": [r.trace for r, ok in zip(rows, not_slower, strict=True) if not ok],
        "geomean_speedup_vs_greedy": geomean(speedups),
        "min_speedup_vs_greedy": min(speedups),
        "mean_gap_to_oracle": statistics.fmean(vs_oracle),
        "median_gap_to_oracle": statistics.median(vs_oracle),
        "max_gap_to_oracle": max(vs_oracle),
        "mean_gap_to_oracle_by_shape": {
            shape: statistics.fmean(g for r, g in zip(rows, vs_oracle, strict=True) if r.shape == shape)
            for shape in dict.fromkeys(r.shape for r in rows)},
        "mean_lagged_over_oracle": statistics.fmean(
            r.lagged.iteration_s / r.oracle.iteration_s - 1.0 for r in rows if r.lagged is not None)
        if any(r.lagged is not None for r in rows) else None,
        "mean_gap_to_lagged": statistics.fmean(
            r.runs[label]["T"] / r.lagged.iteration_s - 1.0 for r in rows if r.lagged is not None)
        if any(r.lagged is not None for r in rows) else None,
        "spend_range": (min(r.runs[label]["spend"] for r in rows),
                        max(r.runs[label]["spend"] for r in rows)),
        "median_versions_per_100": statistics.median(versions),
        "max_versions_per_100": max(versions),
    }


def plots(rows: Sequence[Row], records: dict[str, dict[str, list[SlotRecord]]],
          traces: dict[str, Trace], out_dir: Path, main: str, explicit: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dev dependency
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    x = range(len(rows))
    for label, marker in ((main, "o"), (explicit, "x"), ("static", "s")):
        if label not in rows[0].runs:
            continue
        ax1.plot(x, [r.runs["budget-greedy"]["T"] / r.runs[label]["T"] for r in rows], marker,
                 label=label)
        ax2.plot(x, [r.runs[label]["spend"] for r in rows], marker, label=label)
    ax1.plot(x, [r.runs["budget-greedy"]["T"] / r.oracle.iteration_s for r in rows], "_",
             ms=14, color="k", label="oracle")
    ax2.plot(x, [r.runs["budget-greedy"]["spend"] for r in rows], "^", label="budget-greedy")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("speed-up over\nbudget-greedy")
    ax2.axhspan(0.98, 1.02, color="green", alpha=0.15)
    ax2.set_ylabel("average spend / budget")
    ax2.legend(fontsize=8, ncol=4)
    ax2.set_xticks(list(x), [r.trace for r in rows], rotation=70, fontsize=7)
    ax1.legend(fontsize=8, ncol=5)
    ax1.set_title("Controller trace library")
    fig.tight_layout()
    path = out_dir / "library.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    # one trace over time: price, spend, iteration time
    pick = max(rows, key=lambda r: r.runs["budget-greedy"]["T"] / r.runs[main]["T"]).trace
    recs, tr = records[pick], traces[pick]
    fig, axes = plt.subplots(3, 1, figsize=(11, 7), sharex=True)
    for host, series in tr.prices.items():
        axes[0].plot(series, lw=1, label=f"{host} $/h per device")
    axes[0].legend(fontsize=8)
    axes[0].set_ylabel("price")
    for label in (main, explicit, "budget-greedy"):
        if label in recs:
            axes[1].plot([r.costs.get(KIND, 0.0) for r in recs[label]], lw=1, label=label)
            axes[2].plot([r.effective_iteration_s for r in recs[label]], lw=1, label=label)
    axes[1].axhline(tr.budget, color="red", lw=0.8, label="budget")
    axes[1].set_ylabel("$/h")
    axes[1].legend(fontsize=8)
    axes[2].set_ylabel("iteration s")
    axes[2].set_xlabel("slot")
    axes[0].set_title(f"trace {pick}")
    fig.tight_layout()
    path = out_dir / "trace.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def frontier_plot(out: Path) -> Path | None:
    """docs/controller.md's figure: one slot of issue 17's trace as the
    controller sees it. Every candidate's (cost rate, iteration time), their
    lower convex hull (the frontier), the budget, and the line of slope
    ``-lambda`` that touches the frontier at the budget: ``lambda = Q / V`` is
    the exchange rate in seconds per $/h that the default V learns."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dev dependency
        return None
    from hetpilot.planner.candidates import budget_multiplier, frontier

    mix = mixes()["mixed12"]
    tr = issue_trace(2, mix)
    ctl = Controller(tr.scenario.model, tr.scenario.job,
                     ControllerConfig(iterations_per_slot=tr.scenario.iterations_per_slot),
                     search=CachedSearch(planner_search, size=64))
    cands = ctl.candidates(Timeline(tr.scenario).truth(0))
    pts = [(c.costs[KIND], c.iteration_s) for c in cands]
    fc, ft = frontier(pts)
    lam = budget_multiplier([(fc, ft)], tr.budget)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", ms=4, color="grey", alpha=0.6,
            label="candidate plans")
    ax.plot(fc, ft, "-o", color="C0", label="frontier (lower convex hull)")
    ax.axvline(tr.budget, color="red", lw=0.9, label=f"budget ${tr.budget:g}/h")
    if lam:
        k = int(((fc - tr.budget) ** 2 + 0 * ft).argmin())
        # the line T + lam * c = const through the frontier's point nearest the budget
        xs = [fc[0], fc[-1]]
        ax.plot(xs, [ft[k] - lam * (x - fc[k]) for x in xs], "--", color="C1",
                label=f"T + {lam:.3f} c = const: lambda = Q/V = {lam:.3f} s per $/h")
    ax.set_xlabel("cost rate $/h")
    ax.set_ylabel("iteration time s (reference model)")
    ax.set_ylim(0, max(ft) * 1.15)
    ax.set_title("One slot of issue 17's trace (mixed12): what V trades")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 traces of 120 slots")
    ap.add_argument("--traces", type=int, default=24)
    ap.add_argument("--slots", type=int, default=300)
    ap.add_argument("--only", help="comma list of trace indices")
    ap.add_argument("--default-V", type=float, default=DEFAULT_V, dest="default_v",
                    help="V passed for the job that gives none (default 0: the controller's default)")
    ap.add_argument("--no-explicit", action="store_true", help="skip the run at the job's own V")
    ap.add_argument("--md", help="write the tables to this markdown file")
    ap.add_argument("--plots", help="write PNG plots into this folder")
    ap.add_argument("--json", help="write every number to this JSON file")
    ap.add_argument("--diagnose", action="store_true",
                    help="only the issue-17 trace, with why V = 10 loses (diagnosis numbers)")
    ap.add_argument("--frontier-plot", metavar="PNG",
                    help="only docs/controller.md's figure of one slot's frontier and exchange rate")
    args = ap.parse_args(argv)
    if args.frontier_plot:
        print(f"wrote {frontier_plot(Path(args.frontier_plot))}")
        return 0
    if args.diagnose:
        diagnose(args.slots)
        return 0
    n, slots = (len(QUICK), 120) if args.quick else (args.traces, args.slots)
    indices = [int(i) for i in args.only.split(",")] if args.only else (
        list(QUICK) if args.quick else list(range(n)))
    main_label, explicit_label = "lyapunov default V", "lyapunov job V"
    policies: list[tuple[str, str, float | None]] = [(main_label, "lyapunov", args.default_v)]
    if not args.no_explicit:
        policies.append((explicit_label, "lyapunov", None))
    policies += [("budget-greedy", "budget-greedy", None), ("static", "static", None)]
    mx = mixes()
    searches = {name: CachedSearch(planner_search, size=512) for name in mx}
    cheapest = {name: cheapest_plan(m, searches[name]) for name, m in mx.items()}
    rows: list[Row] = []
    records: dict[str, dict[str, list[SlotRecord]]] = {}
    traces: dict[str, Trace] = {}
    t_all = time.perf_counter()
    for i in indices:
        mix = mx[tuple(mx)[i % 4]]
        tr = make_trace(i, slots, mix, cheapest[mix.name])
        row, recs = run_trace(tr, searches[mix.name], policies)
        rows.append(row)
        records[tr.name], traces[tr.name] = recs, tr
        m, g = row.runs[main_label], row.runs["budget-greedy"]
        e = row.runs.get(explicit_label)
        print(f"{tr.name}: budget {tr.budget:g} V {tr.V:g} | default V: spend {m['spend']:.3f} "
              f"T {m['T']:.4f} ({g['T'] / m['T']:.3f}x greedy, "
              f"{(m['T'] / row.oracle.iteration_s - 1) * 100:+.1f}% oracle, "
              + (f"{(m['T'] / row.lagged.iteration_s - 1) * 100:+.1f}% lag-matched, "
                 if row.lagged is not None else "")
              + f"{m['versions_per_100']:.0f} v/100)"
              + (f" | job V: spend {e['spend']:.3f} {g['T'] / e['T']:.3f}x greedy" if e else "")
              + f" | greedy spend {g['spend']:.3f} | {row.wall_s:.1f} s", flush=True)
    wall = time.perf_counter() - t_all
    summary = {label: targets(rows, label) for label, _, _ in policies if label.startswith("lyapunov")}
    table = markdown(rows, main_label, explicit_label)
    print()
    print(table)
    print()
    for label, tg in summary.items():
        print(f"{label}: {json.dumps(tg)}")
    print(f"wall {wall:.0f} s")
    if args.plots:
        for p in plots(rows, records, traces, Path(args.plots), main_label, explicit_label):
            print(f"wrote {p}")
    if args.md:
        Path(args.md).write_text(table + "\n\n" + "\n".join(
            f"- {label}: {json.dumps(tg)}" for label, tg in summary.items()) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "rows": [{**{k: v for k, v in vars(r).items() if k not in ("oracle", "lagged")},
                      "oracle": vars(r.oracle),
                      "lagged": None if r.lagged is None else vars(r.lagged)} for r in rows],
            "targets": summary, "wall_s": wall}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
