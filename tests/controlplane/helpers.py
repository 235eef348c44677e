"""Request builders shared by the control-plane tests and the daemon benchmarks (bench/_daemon.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetpilot.v1 import agent_pb2, common_pb2, job_pb2

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def model_json() -> str:
    return (EXAMPLES / "model.json").read_text()


def host_secret(host: str) -> str:
    """The host secret the test agents of ``host`` register with (the agent's own is
    random, in its state dir): one per name, so a test's agent that registers again
    is the same host to the daemon, as a restarted agent is."""
    return f"test-host-secret-{host}"


def register_request(host: str, n: int = 1, tflops: float = 50.0, memory_gb: float = 80.0,
                     price: float = 1.0, probe: str = "") -> agent_pb2.RegisterRequest:
    return agent_pb2.RegisterRequest(host=host, probe_address=probe,
                                     host_secret=host_secret(host), devices=[
        agent_pb2.DeviceInfo(index=str(i), name="emu", kind=common_pb2.DEVICE_KIND_EMULATED,
                             tflops=tflops, memory_gb=memory_gb, price_per_hour=price,
                             power_watts=300.0, emulated=True)
        for i in range(n)])


def report(host: str, seq: int, n: int = 1, tflops: float = 50.0,
           registration: str = "") -> agent_pb2.AgentReport:
    """A report of ``host``; ``registration`` is its Register's (RegisterResponse)."""
    return agent_pb2.AgentReport(agent_id=host, seq=seq, unix_ms=int(time.time() * 1000),
                                 registration=registration,
                                 devices=[agent_pb2.DeviceReport(
                                     index=str(i), tflops=tflops, memory_total_gb=80.0,
                                     memory_free_gb=70.0, utilization=0.1, emulated=True)
                                     for i in range(n)])


def submit_request(**kw: object) -> job_pb2.SubmitJobRequest:
    args: dict[str, object] = dict(name="t", model_json=model_json(), global_batch=64,
                                   microbatch_size=4, slot_s=0.3, v=10.0)
    args.update(kw)
    return job_pb2.SubmitJobRequest(**args)  # type: ignore[arg-type]


def wait_until(what: str, pred: Callable[[], Any], timeout: float = 30.0,
               period: float = 0.1) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out waiting for {what}; last {value!r}")
