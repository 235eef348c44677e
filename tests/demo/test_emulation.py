"""The EMULATED conditions file and its two readers: the agent's report and the trainer rank.

The demo's consistency rests on these: what an agent reports for a device or
link and what a trainer rank feels come from the same file, re-read when it
changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hetpilot.agents.config import AgentConfig, EmulatedDevice
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.serde import cluster_from_dict, model_from_dict, plan_from_dict

from hetpilot.emulation import EmulationFile, allreduce_s, write_emulation


def test_file_is_reread_on_change_and_bad_content_keeps_the_last_state(tmp_path: Path) -> None:
    path = tmp_path / "emu.json"
    emu = EmulationFile(path)
    assert emu.state().devices == {} and emu.changes == 0  # missing: nothing emulated
    write_emulation(path, {"h:0": 2.0}, [{"a": "h", "b": "g", "gbps": 5.0, "latency_us": 10}])
    assert emu.state().devices == {"h:0": 2.0}
    assert emu.state().link("g", "h") == (5.0, 10.0) and emu.state().link("g", "x") is None
    write_emulation(path, {"h:0": 0.5, "h:1": 1.0})
    assert emu.state().devices == {"h:0": 0.5, "h:1": 1.0} and emu.changes == 2
    path.write_text('{"devices": {"h:0": ')  # half-written
    assert emu.state().devices == {"h:0": 0.5, "h:1": 1.0}
    path.write_text(json.dumps({"devices": {"h:0": -1}}))  # invalid
    assert emu.state().devices["h:0"] == 0.5


def test_allreduce_time_is_spec_5_3(tmp_path: Path) -> None:
    """Two replicas on two hosts over a slow host link: the reference model's sync time."""
    param_mb = 0.1
    cluster = cluster_from_dict({
        "devices": [{"id": "a:0", "host": "a", "tflops": 1.0, "memory_gb": 1.0},
                    {"id": "b:0", "host": "b", "tflops": 1.0, "memory_gb": 1.0},
                    {"id": "c:0", "host": "c", "tflops": 1.0, "memory_gb": 1.0}],
        "network": {"intra_host_gbps": 100.0, "inter_host_gbps": 100.0, "latency_us": 0.0,
                    "host_links": [{"a": "a", "b": "b", "gbps": 0.01, "latency_us": 40.0},
                                   {"a": "b", "b": "c", "gbps": 2.0, "latency_us": 10.0},
                                   {"a": "a", "b": "c", "gbps": 2.0, "latency_us": 10.0}]}})
    model = model_from_dict({"name": "m", "layers": [
        {"name": "l", "fwd_gflop": 0.001, "out_mb": 0.001, "act_mb": 0.001,
         "param_mb": param_mb}]})
    plan = plan_from_dict({"microbatch_size": 1, "schedule": "1f1b", "groups": [
        {"samples": 1, "stages": [{"device": d, "layers": [0, 1]}]}
        for d in ("a:0", "b:0", "c:0")]})
    expected = evaluate(cluster, model, plan, 3).sync_s
    path = tmp_path / "emu.json"
    write_emulation(path, {}, [{"a": "a", "b": "b", "gbps": 0.01, "latency_us": 40},
                               {"a": "b", "b": "c", "gbps": 2.0, "latency_us": 10},
                               {"a": "c", "b": "a", "gbps": 2.0, "latency_us": 10}])
    got = allreduce_s(param_mb * 1e6, ["a", "b", "c"], EmulationFile(path).state())
    assert got == pytest.approx(expected, rel=1e-9)
    assert allreduce_s(1e6, ["a", "x"], EmulationFile(path).state()) is None  # not emulated
    assert allreduce_s(1e6, ["a", "a"], EmulationFile(path).state()) == 0.0  # same host


def test_agent_reports_the_files_speeds_and_links(tmp_path: Path) -> None:
    from hetpilot.agents.agent import Agent
    from hetpilot.agents.probes import discover

    path = tmp_path / "emu.json"
    config = AgentConfig(daemon="127.0.0.1:1", host="hostA", token="x" * 16,
                         emulate=(EmulatedDevice(tflops=4.0, memory_gb=8.0, count=2),),
                         emulate_file=str(path))
    agent = Agent(config)
    agent.devices = discover(config)
    agent.peers = {"hostB": "127.0.0.1:2", "hostC": "127.0.0.1:3"}
    agent.links = {"hostB": (9.0, 100.0), "hostC": (8.0, 100.0)}  # "measured" loopback
    report = agent.report()
    assert [d.tflops for d in report.devices] == [4.0, 4.0]  # no file yet: declared speeds
    write_emulation(path, {"hostA:1": 0.5, "hostB:0": 7.0},
                    [{"a": "hostC", "b": "hostA", "gbps": 0.01, "latency_us": 50}])
    report = agent.report()
    assert [(d.index, d.tflops, d.emulated) for d in report.devices] == [
        ("0", 4.0, True), ("1", 0.5, True)]
    assert {(x.peer_host, x.gbps, x.rtt_us) for x in report.links} == {
        ("hostB", 9.0, 100.0), ("hostC", 0.01, 100.0)}


def test_agent_without_the_file_is_unchanged() -> None:
    from hetpilot.agents.agent import Agent
    from hetpilot.agents.probes import discover

    config = AgentConfig(daemon="127.0.0.1:1", host="h", token="x" * 16,
                         emulate=(EmulatedDevice(tflops=4.0, memory_gb=8.0),))
    agent = Agent(config)
    agent.devices = discover(config)
    assert [d.tflops for d in agent.report().devices] == [4.0]


def test_trainer_rank_follows_the_file(tmp_path: Path) -> None:
    """One gloo rank: the stage's target times follow the file's speed for its device."""
    import torch
    import torch.distributed as dist
    from hetpilot.trainer.launch import free_port
    from hetpilot.trainer.plans import StaticPlanSource
    from hetpilot.trainer.runtime import Trainer, TrainerConfig

    path = tmp_path / "emu.json"
    write_emulation(path, {"h:0": 0.002})
    plan = plan_from_dict({"microbatch_size": 4, "schedule": "1f1b", "groups": [
        {"samples": 8, "stages": [{"device": "h:0", "layers": [0, 2]}]}]})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        x, y = torch.randn(32, 3), torch.randn(32, 2)
        trainer = Trainer([torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)],
                          torch.nn.functional.mse_loss,
                          lambda p: torch.optim.SGD(p, lr=0.1),
                          torch.utils.data.TensorDataset(x, y),
                          TrainerConfig(global_batch=8, device_id="h:0",
                                        layer_gflop=[(1e-6, 2e-6), (1e-6, 2e-6)],
                                        emulate_file=path),
                          plan_source=StaticPlanSource([plan]))
        assert trainer.emulate_tflops == 0.002
        trainer.poll_plan()
        trainer.train_step()
        runner = trainer._part.runner
        assert runner is not None
        fwd = 4 * 2e-6 / (1000 * 0.002)
        assert runner.fwd_target_s == pytest.approx(fwd)
        write_emulation(path, {"h:0": 0.0005})  # EMULATED slowdown, 4x
        record = trainer.train_epoch()
        assert trainer.emulate_tflops == 0.0005 and record["emulated_tflops"] == 0.0005
        assert runner.fwd_target_s == pytest.approx(4 * fwd)
        assert runner.bwd_target_s == pytest.approx(8 * fwd)
        assert record["fwd_s"] >= 4 * fwd
        with pytest.raises(ValueError, match="names no speed"):
            Trainer([torch.nn.Linear(3, 2)], torch.nn.functional.mse_loss,
                    lambda p: torch.optim.SGD(p, lr=0.1), torch.utils.data.TensorDataset(x, y),
                    TrainerConfig(global_batch=8, device_id="other:0",
                                  layer_gflop=[(1e-6, 2e-6)], emulate_file=path))
    finally:
        dist.destroy_process_group()
