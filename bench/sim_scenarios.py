"""Generate the scenario library in examples/scenarios/ (deterministic, seeded).

    .venv/bin/python bench/sim_scenarios.py [--out examples/scenarios] [--seed 7]

Scenarios (spec v1 section 6), all on one 12-device, 4-host cluster and a
GPT-2-medium-sized model unless said otherwise:

- spot-price.json: 500 slots on a 16-device cluster with two H100 spot
  zones; every host's price swings between 0.3x and 1.7x of its list price
  every 10-40 slots; a binding price budget.
- interference.json: 300 slots; co-located jobs slow an H100 and an A100
  host's devices for long stretches.
- link-jitter.json: 300 slots; the H100-A100 host link jitters every slot
  (log-normal around 25 Gbit/s, sometimes 1 Gbit/s) and degrades.
- failures.json: 300 slots; devices and a whole host fail and come back.
- cluster-1024.json: 1024 devices on 128 hosts of four kinds, 20 slots with
  interference, a slow link and failures (written only if under 1 MB).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

# sustained TFLOP/s, usable GB, $/h, W (the planner's catalog figures)
KINDS = {
    "H100": (400.0, 80.0, 4.0, 700.0),
    "A100": (150.0, 80.0, 2.0, 400.0),
    "V100": (60.0, 32.0, 0.9, 300.0),
    "A10G": (35.0, 24.0, 1.0, 300.0),
}


def transformer(hidden: int, blocks: int, seq: int, heads: int, vocab: int) -> dict[str, Any]:
    """Per-sample profile of a GPT-style model (the planner catalog's formulas)."""
    h, s, a = hidden, seq, heads
    fwd = (24 * s * h * h + 4 * s * s * h) / 1e9
    out = 2 * s * h / 1e6
    layers = [{"name": "embed", "fwd_gflop": 2 * s * h / 1e9, "bwd_gflop": 4 * s * h / 1e9,
               "out_mb": out, "act_mb": out, "param_mb": 2 * (vocab + s) * h / 1e6}]
    for i in range(blocks):
        layers.append({"name": f"block{i}", "fwd_gflop": fwd, "bwd_gflop": 2 * fwd, "out_mb": out,
                       "act_mb": s * h * (34 + 5 * a * s / h) / 1e6, "param_mb": 24 * h * h / 1e6})
    head = 2 * s * h * vocab / 1e9
    layers.append({"name": "head", "fwd_gflop": head, "bwd_gflop": 2 * head, "out_mb": 4 * s / 1e6,
                   "act_mb": (2 * s * h + 4 * s * vocab) / 1e6, "param_mb": 2 * h / 1e6})
    rounded = [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in lay.items()}
               for lay in layers]
    return {"name": f"gpt-{hidden}x{blocks}", "optimizer_factor": 7.0, "layers": rounded}


def cluster(hosts: list[tuple[str, int]], inter_gbps: float = 100.0,
            host_links: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices = []
    for h, (kind, count) in enumerate(hosts):
        tf, mem, price, watts = KINDS[kind]
        for i in range(count):
            devices.append({"id": f"h{h}:{i}", "host": f"h{h}", "tflops": tf, "memory_gb": mem,
                            "price_per_hour": price, "power_watts": watts})
    return {"devices": devices,
            "network": {"intra_host_gbps": 2400.0, "inter_host_gbps": inter_gbps,
                        "latency_us": 5.0, "host_links": host_links or [], "device_links": []}}


SMALL = [("H100", 2), ("A100", 4), ("V100", 4), ("A10G", 2)]
SMALL_LINKS = [{"a": "h0", "b": "h3", "gbps": 25.0, "latency_us": 30.0},
               {"a": "h1", "b": "h3", "gbps": 25.0, "latency_us": 30.0}]


def _base(slots: int, budgets: dict[str, float], V: float) -> dict[str, Any]:
    return {
        "cluster": cluster(SMALL, host_links=SMALL_LINKS),
        "model": transformer(hidden=1024, blocks=24, seq=1024, heads=16, vocab=50257),
        "job": {"global_batch": 256, "microbatch_size": 4, "schedule": ["1f1b", "gpipe"],
                "budgets": budgets, "V": V},
        "slots": slots,
        "iterations_per_slot": 200,
        "events": [],
    }


SPOT_HOSTS = [("H100", 4), ("H100", 4), ("A100", 4), ("V100", 4)]


def spot_price(rng: random.Random) -> dict[str, Any]:
    """Spot prices on their own 16-device cluster: two H100 hosts (two spot
    zones), an A100 and a V100 host. Every 10-40 slots each host's price is
    redrawn, independently, between 0.3x and 1.7x of its list price, so the
    list price (slot 0) is the mean: a plan that fits the budget at slot 0
    fits it on average. The budget ($24/h of $43.6/h) binds.

    Why not the 12-device cluster: there the best plan hardly depends on the
    prices (an oracle knowing every slot's prices in advance is at most 0.7%
    faster than the plan chosen once; ``bench/sim_oracle.py``), so no online
    policy can show anything.
    """
    sc = _base(500, {"price_per_hour": 24.0}, V=20000.0)
    sc["cluster"] = cluster(SPOT_HOSTS)
    devices = sc["cluster"]["devices"]
    list_price = {d["id"]: d["price_per_hour"] for d in devices}
    t = 0
    while True:
        t += rng.randint(10, 40)
        if t >= 500:
            break
        for host in sorted({d["host"] for d in devices}):
            scale = rng.uniform(0.3, 1.7)
            for d in devices:
                if d["host"] == host:
                    sc["events"].append({"slot": t, "device": d["id"],
                                         "price_per_hour": round(list_price[d["id"]] * scale, 2)})
    return sc


def interference(rng: random.Random) -> dict[str, Any]:
    sc = _base(300, {"price_per_hour": 20.0}, V=2000.0)
    windows = [(20, 110, "h0:0", 0.2), (60, 140, "h0:1", 0.25), (150, 260, "h0:0", 0.15),
               (120, 200, "h1:0", 0.3), (120, 200, "h1:1", 0.3), (210, 290, "h0:1", 0.2)]
    for start, end, dev, scale in windows:
        sc["events"].append({"slot": start, "device": dev, "tflops_scale": scale})
        sc["events"].append({"slot": end, "device": dev, "tflops_scale": 1.0})
    return sc


def link_jitter(rng: random.Random) -> dict[str, Any]:
    sc = _base(300, {"price_per_hour": 20.0}, V=2000.0)
    for t in range(1, 300):
        gbps = 1.0 if rng.random() < 0.1 else round(min(100.0, rng.lognormvariate(3.2, 0.6)), 2)
        if t >= 150:
            gbps = round(gbps / 5, 3)  # degraded
        sc["events"].append({"slot": t, "hosts": ["h0", "h1"], "gbps": max(gbps, 0.2)})
    return sc


def failures(rng: random.Random) -> dict[str, Any]:
    sc = _base(300, {"price_per_hour": 20.0}, V=2000.0)
    outages = [(30, 120, ["h0:1"]), (60, 200, ["h1:2"]), (130, 230, ["h0:0"]),
               (150, 220, ["h2:0", "h2:1", "h2:2", "h2:3"]), (240, 280, ["h0:1", "h1:0"])]
    for start, end, devs in outages:
        for d in devs:
            sc["events"].append({"slot": start, "device": d, "down": True})
            sc["events"].append({"slot": end, "device": d, "down": False})
    return sc


def cluster_1024(rng: random.Random) -> dict[str, Any]:
    kinds = ["H100", "A100", "V100", "A10G"]
    hosts = [(kinds[h % 4] if h % 7 else "A100", 8) for h in range(128)]
    slow = [{"a": f"h{i}", "b": f"h{i + 1}", "gbps": 10.0} for i in range(0, 128, 16)]
    sc = {
        "cluster": cluster(hosts, inter_gbps=200.0, host_links=slow),
        "model": transformer(hidden=2048, blocks=24, seq=2048, heads=16, vocab=50257),
        "job": {"global_batch": 8192, "microbatch_size": 4, "schedule": ["1f1b"],
                "budgets": {"price_per_hour": 1500.0}, "V": 20000.0},
        "slots": 20,
        "iterations_per_slot": 100,
        "events": [],
    }
    for d in rng.sample(range(1024), 32):
        sc["events"].append({"slot": 5, "device": f"h{d // 8}:{d % 8}", "tflops_scale": 0.3})
        sc["events"].append({"slot": 15, "device": f"h{d // 8}:{d % 8}", "tflops_scale": 1.0})
    for d in rng.sample(range(1024), 16):
        sc["events"].append({"slot": 10, "device": f"h{d // 8}:{d % 8}", "down": True})
    sc["events"].append({"slot": 8, "hosts": ["h0", "h64"], "gbps": 2.0})
    return sc


SCENARIOS = {
    "spot-price": spot_price,
    "interference": interference,
    "link-jitter": link_jitter,
    "failures": failures,
    "cluster-1024": cluster_1024,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="examples/scenarios")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--only", help="comma list of scenario names")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(SCENARIOS)
    for name in names:
        sc = SCENARIOS[name](random.Random(f"{args.seed}/{name}"))
        compact = name == "cluster-1024"
        text = json.dumps(sc, separators=(",", ":")) if compact else json.dumps(sc, indent=1)
        if len(text) >= 1_000_000:
            print(f"{name}: {len(text)} bytes >= 1 MB, not written (generate on the fly)")
            continue
        (out / f"{name}.json").write_text(text + "\n")
        print(f"{name}: {len(text)} bytes, {len(sc['events'])} events")


if __name__ == "__main__":
    main()
