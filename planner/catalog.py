"""Realistic device and model profiles for examples, tests and benchmarks.

Device figures are *sustained* mixed-precision rates on transformer layers
(roughly 40-50% of the datasheet dense peak), usable memory, an on-demand
cloud price and board power. Models are profiled analytically per sample:
a transformer block does ``24 s h^2 + 4 s^2 h`` forward FLOPs, keeps
``s h (34 + 5 a s / h)`` bytes of activations (Korthikanti et al., fp16), has
``12 h^2`` fp16 parameters, and mixed-precision Adam holds 7 more bytes of
state per fp16 parameter byte (``optimizer_factor = 7``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import Cluster, Device, Layer, Link, Model, Network

__all__ = ["DEVICES", "MODELS", "DeviceKind", "make_cluster", "transformer", "vgg16"]


@dataclass(frozen=True)
class DeviceKind:
    tflops: float
    memory_gb: float
    price_per_hour: float
    power_watts: float
    intra_gbps: float
    """Device-to-device bandwidth inside one host (NVLink or PCIe)."""


DEVICES: dict[str, DeviceKind] = {
    "H100": DeviceKind(400.0, 80.0, 4.00, 700.0, 3600.0),
    "A100": DeviceKind(150.0, 80.0, 2.00, 400.0, 2400.0),
    "A100-40": DeviceKind(140.0, 40.0, 1.50, 400.0, 2400.0),
    "V100": DeviceKind(60.0, 32.0, 0.90, 300.0, 1200.0),
    "A10G": DeviceKind(35.0, 24.0, 1.00, 300.0, 200.0),
    "L4": DeviceKind(45.0, 24.0, 0.80, 72.0, 200.0),
    "RTX3090": DeviceKind(30.0, 24.0, 0.40, 350.0, 200.0),
    "T4": DeviceKind(20.0, 16.0, 0.35, 70.0, 100.0),
}


def make_cluster(
    hosts: list[tuple[str, int]],
    *,
    inter_host_gbps: float = 100.0,
    latency_us: float = 5.0,
    inter_latency_us: float = 20.0,
    slow_links: list[tuple[int, int, float]] | None = None,
) -> Cluster:
    """A cluster of hosts given as (device kind, devices per host).

    Devices on one host share its kind's intra-host bandwidth (a device link
    per pair would be O(n^2); instead each host gets ``intra_host_gbps`` of
    its kind through per-host links below). ``slow_links`` lists (host i,
    host j, Gbit/s) overrides.
    """
    devices = []
    host_links = []
    for h, (kind, count) in enumerate(hosts):
        spec = DEVICES[kind]
        for i in range(count):
            devices.append(Device(id=f"h{h}:{i}", host=f"h{h}", tflops=spec.tflops,
                                  memory_gb=spec.memory_gb, price_per_hour=spec.price_per_hour,
                                  power_watts=spec.power_watts))
    for i, j, gbps in slow_links or []:
        host_links.append(Link(a=f"h{i}", b=f"h{j}", gbps=gbps, latency_us=inter_latency_us))
    intra = min(DEVICES[kind].intra_gbps for kind, _ in hosts)
    return Cluster(
        devices=tuple(devices),
        network=Network(intra_host_gbps=intra, inter_host_gbps=inter_host_gbps,
                        latency_us=latency_us, host_links=tuple(host_links)),
    )


def transformer(name: str, *, hidden: int, blocks: int, seq: int, heads: int,
                vocab: int) -> Model:
    h, s, a = hidden, seq, heads
    block_fwd = (24 * s * h * h + 4 * s * s * h) / 1e9
    act_block = s * h * (34 + 5 * a * s / h) / 1e6
    out = 2 * s * h / 1e6
    embed = Layer(name="embed", fwd_gflop=2 * s * h / 1e9, bwd_gflop=4 * s * h / 1e9,
                  out_mb=out, act_mb=out, param_mb=2 * (vocab + s) * h / 1e6)
    layers = [embed]
    for i in range(blocks):
        layers.append(Layer(name=f"block{i}", fwd_gflop=block_fwd, bwd_gflop=2 * block_fwd,
                            out_mb=out, act_mb=act_block, param_mb=2 * 12 * h * h / 1e6))
    head_fwd = 2 * s * h * vocab / 1e9
    layers.append(Layer(name="head", fwd_gflop=head_fwd, bwd_gflop=2 * head_fwd,
                        out_mb=4 * s / 1e6, act_mb=(2 * s * h + 4 * s * vocab) / 1e6,
                        param_mb=2 * h / 1e6))
    return Model(name=name, layers=tuple(layers), optimizer_factor=7.0)


def vgg16() -> Model:
    """VGG16 on 224x224 images, fp16 activations, per layer (conv blocks + FC)."""
    cfg: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                            512, 512, 512, "M"]
    layers: list[Layer] = []
    c_in, size = 3, 224
    i = 0
    for v in cfg:
        if v == "M":
            size //= 2
            prev = layers[-1]
            layers[-1] = Layer(name=prev.name + "+pool", fwd_gflop=prev.fwd_gflop,
                               bwd_gflop=prev.bwd_gflop, out_mb=2 * c_in * size * size / 1e6,
                               act_mb=prev.act_mb, param_mb=prev.param_mb)
            continue
        c_out = int(v)  # an int: "M" entries were handled above
        flops = 2 * 9 * c_in * c_out * size * size / 1e9
        out = 2 * c_out * size * size / 1e6
        layers.append(Layer(name=f"conv{i}", fwd_gflop=flops, bwd_gflop=2 * flops, out_mb=out,
                            act_mb=2 * out, param_mb=2 * (9 * c_in * c_out + c_out) / 1e6))
        c_in = c_out
        i += 1
    for j, (n_in, n_out) in enumerate(((512 * 7 * 7, 4096), (4096, 4096), (4096, 1000))):
        layers.append(Layer(name=f"fc{j}", fwd_gflop=2 * n_in * n_out / 1e9,
                            bwd_gflop=4 * n_in * n_out / 1e9, out_mb=2 * n_out / 1e6,
                            act_mb=4 * n_out / 1e6, param_mb=2 * (n_in * n_out + n_out) / 1e6))
    return Model(name="vgg16", layers=tuple(layers), optimizer_factor=7.0)


MODELS = {
    "gpt2-small": lambda: transformer("gpt2-small", hidden=768, blocks=12, seq=1024, heads=12,
                                      vocab=50257),
    "bert-large": lambda: transformer("bert-large", hidden=1024, blocks=24, seq=512, heads=16,
                                      vocab=30522),
    "gpt2-xl": lambda: transformer("gpt2-xl", hidden=1600, blocks=48, seq=1024, heads=25,
                                   vocab=50257),
    "llama-7b": lambda: transformer("llama-7b", hidden=4096, blocks=32, seq=2048, heads=32,
                                    vocab=32000),
    "llama-13b": lambda: transformer("llama-13b", hidden=5120, blocks=40, seq=2048, heads=40,
                                     vocab=32000),
    "vgg16": vgg16,
}
