"""GPU checks (issue 14): run on a CUDA machine with ``pytest -m gpu``; never in CI
(``addopts`` deselects the ``gpu`` mark). They have not run yet: no GPU was lent to the
session that wrote them (bench/RESULTS-gpu.md)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_agent_cuda_probe_says_what_it_measured() -> None:
    from hetpilot.agents.config import AgentConfig
    from hetpilot.agents.probes import _cuda_devices

    devices = _cuda_devices(AgentConfig())
    assert devices and all(d.kind == "cuda" and d.tflops > 0 for d in devices)
    assert all(d.probe_dtype and d.probe_shape for d in devices)


def test_layer_times_on_cuda_use_the_device_clock() -> None:
    from hetpilot.trainer.examples import gpt
    from hetpilot.trainer.speeds import measure_layer_times

    spec = gpt()
    times = measure_layer_times(spec["layers"], spec["sample"], 8, device="cuda",
                                autocast_dtype=torch.bfloat16)
    assert len(times) == len(spec["layers"]) and all(f > 0 for f, _ in times)


def test_one_rank_trains_in_bfloat16_on_cuda(tmp_path: object) -> None:
    """One NCCL rank, one-stage plan, mixed precision: the loss falls, op times come from
    CUDA events, parameters stay float32."""
    import torch.distributed as dist
    from hetpilot.planner.serde import plan_from_dict
    from hetpilot.trainer.examples import gpt
    from hetpilot.trainer.launch import free_port
    from hetpilot.trainer.runtime import Trainer

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        spec = gpt()
        trainer = Trainer(spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"],
                          global_batch=spec["global_batch"], device_id="gpu:0",
                          device="cuda", dtype=torch.bfloat16)
        n = len(spec["layers"])
        trainer.switch(plan_from_dict({"microbatch_size": 4, "schedule": "1f1b", "groups": [
            {"samples": spec["global_batch"], "stages": [{"device": "gpu:0", "layers": [0, n]}]}]}))
        first = trainer.train_epoch(max_iterations=2)
        later = trainer.train_epoch(max_iterations=2)
        assert later["loss"] < first["loss"] and first["fwd_s"] > 0
        assert all(p.dtype == torch.float32 for m in trainer.held_layers.values()
                   for p in m.parameters())
    finally:
        dist.destroy_process_group()
