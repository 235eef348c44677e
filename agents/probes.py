"""Device discovery and measurement.

Order: declared emulated devices (``--emulate``) when given; else CUDA devices
through torch (imported lazily, only here) with NVML for utilisation and
co-located processes when pynvml is installed; else the CPU as one device.
Speed is a short matmul probe: numpy on the CPU, torch.cuda on a GPU. Each
device says what its probe ran (``probe_dtype``, ``probe_shape`` as
"m x k x n"), because a probe's TFLOP/s means little without them: an H100's
4096^3 bfloat16 matmul runs 10x faster than a float32 GPT-2 layer. The daemon
plans with the job's own measured layer times where the trainer sends them
(:mod:`hetpilot.daemon.measured_fit`); the probe ranks devices until then.

The CUDA probe ran once on an H100 (430 TFLOP/s in bfloat16 on 4096^3,
bench/RESULTS-gpu.md); the NVML path has not run on a GPU and follows NVML's
documentation.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .config import AgentConfig
from .cpustat import CpuMeter, meminfo_gb

__all__ = ["CPU_PROBE_N", "CUDA_PROBE_N", "DeviceState", "cpu_matmul_tflops", "discover",
           "refresh"]

CPU_PROBE_N = 384
"""Side of the CPU probe's square float32 matmul."""
CUDA_PROBE_N = 4096
"""Side of the CUDA probe's square matmul (bfloat16 where supported, else float16)."""


def _shape(n: int) -> str:
    return f"{n}x{n}x{n}"


@dataclass(frozen=True, kw_only=True)
class DeviceState:
    index: str
    name: str
    kind: str
    """"cpu", "cuda" or "emulated"."""
    tflops: float
    memory_total_gb: float
    memory_free_gb: float
    utilization: float = 0.0
    colocated_processes: int = 0
    colocated_load: float = 0.0
    price_per_hour: float = 0.0
    power_watts: float = 0.0
    probe_dtype: str = ""
    """The dtype of the matmul probe behind ``tflops`` (empty: declared, emulated)."""
    probe_shape: str = ""
    """Its shape, "m x k x n" as "4096x4096x4096"."""

    @property
    def emulated(self) -> bool:
        return self.kind == "emulated"


def cpu_matmul_tflops(n: int = CPU_PROBE_N, seconds: float = 0.2) -> float:
    """Sustained float32 TFLOP/s of numpy matmul on this CPU."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm up
    iters, t0 = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return 2 * n**3 * iters / elapsed / 1e12


def _cuda_devices(config: AgentConfig) -> list[DeviceState]:
    """CUDA devices through torch (lazy import); ``tests/trainer/test_gpu.py`` on a GPU."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        dtype = _cuda_probe_dtype(torch)
        out.append(DeviceState(index=str(i), name=props.name, kind="cuda",
                               tflops=_cuda_matmul_tflops(torch, i, dtype),
                               memory_total_gb=total / 1e9, memory_free_gb=free / 1e9,
                               price_per_hour=config.price_per_hour,
                               power_watts=config.power_watts,
                               probe_dtype=str(dtype).removeprefix("torch."),
                               probe_shape=_shape(CUDA_PROBE_N)))
    return out


def _cuda_probe_dtype(torch: Any) -> Any:
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _cuda_matmul_tflops(torch: Any, index: int, dtype: Any, n: int = CUDA_PROBE_N,
                        seconds: float = 0.5) -> float:
    dev = torch.device("cuda", index)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    torch.cuda.synchronize(dev)
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        iters += 1
        torch.cuda.synchronize(dev)
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def _nvml_update(devices: list[DeviceState]) -> list[DeviceState]:
    """Utilisation, memory and foreign processes from NVML when pynvml exists. Untested here."""
    try:
        import pynvml
    except ImportError:
        return devices
    try:
        pynvml.nvmlInit()
        out = []
        me = os.getpid()
        for d in devices:
            h = pynvml.nvmlDeviceGetHandleByIndex(int(d.index))
            util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            procs = [p for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid != me]
            out.append(replace(d, utilization=util, memory_total_gb=mem.total / 1e9,
                               memory_free_gb=mem.free / 1e9, colocated_processes=len(procs),
                               colocated_load=util if procs else 0.0))
        return out
    except Exception:  # NVML missing or failing: keep what torch said
        return devices
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _cpu_device(config: AgentConfig, meter: CpuMeter) -> DeviceState:
    total, free = meminfo_gb()
    d = DeviceState(index="0", name=f"cpu x{os.cpu_count() or 1}", kind="cpu",
                    tflops=cpu_matmul_tflops(), memory_total_gb=total, memory_free_gb=free,
                    price_per_hour=config.price_per_hour, power_watts=config.power_watts,
                    probe_dtype="float32", probe_shape=_shape(CPU_PROBE_N))
    return _with_load(d, meter)


def _with_load(d: DeviceState, meter: CpuMeter) -> DeviceState:
    cpu = meter.read()
    return replace(d, utilization=cpu.utilization, colocated_load=cpu.colocated_load,
                   colocated_processes=cpu.colocated_processes)


def discover(config: AgentConfig, meter: CpuMeter | None = None) -> list[DeviceState]:
    """The host's devices with a first measurement (blocking: run in a thread).

    ``meter`` keeps a CPU host's load statistics between reports (a new one,
    measuring from now, when not given)."""
    if config.emulate:
        out, i = [], 0
        for e in config.emulate:
            for _ in range(e.count):
                out.append(DeviceState(index=str(i), name="emulated", kind="emulated",
                                       tflops=e.tflops, memory_total_gb=e.memory_gb,
                                       memory_free_gb=e.memory_gb,
                                       price_per_hour=e.price_per_hour,
                                       power_watts=e.power_watts))
                i += 1
        return out
    cuda = _cuda_devices(config)
    if cuda:
        return _nvml_update(cuda)
    return [_cpu_device(config, meter or CpuMeter(config.job_pattern))]


def refresh(devices: list[DeviceState], config: AgentConfig, *,
            reprobe: bool, meter: CpuMeter | None = None) -> list[DeviceState]:
    """Cheap updates (memory, load since the last report) every report; the
    matmul probe when ``reprobe``."""
    if not devices or devices[0].kind == "emulated":
        return devices
    if devices[0].kind == "cuda":
        return discover(config) if reprobe else _nvml_update(devices)
    if meter is None:
        raise ValueError("refresh: a CPU host needs the meter its last report read")
    total, free = meminfo_gb()
    d = devices[0]
    tflops = cpu_matmul_tflops() if reprobe else d.tflops
    return [_with_load(replace(d, tflops=tflops, memory_total_gb=total, memory_free_gb=free), meter)]
