"""Small clusters and models built in code for planner tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from hetpilot.planner import serde
from hetpilot.planner.types import Cluster, Device, Layer, Model, Network

SPEC = Path(__file__).resolve().parents[3] / "shared" / "spec" / "examples"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> dict:
    """A spec example: from ../shared when present, else the copy in examples/."""
    path = SPEC / name if (SPEC / name).exists() else EXAMPLES / name
    return json.loads(path.read_text())


def spec_cluster() -> Cluster:
    return serde.cluster_from_dict(example("cluster.json"))


def spec_model() -> Model:
    return serde.model_from_dict(example("model.json"))


def uniform_model(n_layers: int, *, fwd: float = 10.0, out_mb: float = 1.0, act_mb: float = 10.0,
                  param_mb: float = 10.0, opt: float = 3.0) -> Model:
    return Model(name="uniform", optimizer_factor=opt, layers=tuple(
        Layer(name=f"l{i}", fwd_gflop=fwd, bwd_gflop=2 * fwd, out_mb=out_mb, act_mb=act_mb,
              param_mb=param_mb) for i in range(n_layers)))


def random_model(n_layers: int, seed: int) -> Model:
    r = random.Random(seed)
    return Model(name=f"random{seed}", optimizer_factor=7.0, layers=tuple(
        Layer(name=f"l{i}", fwd_gflop=r.uniform(5, 30), bwd_gflop=r.uniform(10, 60),
              out_mb=r.uniform(1, 20), act_mb=r.uniform(50, 400), param_mb=r.uniform(50, 600))
        for i in range(n_layers)))


def flat_cluster(tflops: list[float], *, memory_gb: float = 1000.0, hosts: list[str] | None = None,
                 intra: float = 1000.0, inter: float = 100.0, latency_us: float = 0.0) -> Cluster:
    hosts = hosts or [f"h{i}" for i in range(len(tflops))]
    return Cluster(
        devices=tuple(Device(id=f"d{i}", host=hosts[i], tflops=t, memory_gb=memory_gb,
                             price_per_hour=1.0 + i, power_watts=100.0 * (i + 1))
                      for i, t in enumerate(tflops)),
        network=Network(intra_host_gbps=intra, inter_host_gbps=inter, latency_us=latency_us),
    )
