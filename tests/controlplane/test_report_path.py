"""The agent report's per-report path (issue 37.9): its quick JSON and its quick value
checks say exactly what the generic ones say."""

from __future__ import annotations

import json
import math

import pytest
from hetpilot.daemon import convert
from hetpilot.daemon.records import AgentReport, DeviceReport, LinkReport, _plain
from hetpilot.planner.errors import ValidationError
from hetpilot.v1 import agent_pb2


def _report() -> AgentReport:
    return AgentReport(
        agent_id="host-7", seq=41, unix_ms=1_700_000_000_123,
        devices=(DeviceReport(index="0", tflops=312.5, memory_total_gb=80.0,
                              memory_free_gb=12.25, utilization=0.75, colocated_processes=2,
                              colocated_load=0.5, emulated=True, probe_dtype="bfloat16",
                              probe_shape="4096x4096x4096"),
                 DeviceReport(index="gpu1", tflops=0.0)),
        links=(LinkReport(peer_host="host-8", gbps=100.0, rtt_us=12.5),))


def test_a_report_s_json_is_the_generic_json_and_reads_back() -> None:
    report = _report()
    assert json.loads(report.to_json()) == _plain(report)
    assert AgentReport.from_json(report.to_json()) == report
    # what an older daemon wrote (the generic encoder's spacing) still reads
    assert AgentReport.from_json(json.dumps(_plain(report))) == report


def _proto() -> agent_pb2.AgentReport:
    return agent_pb2.AgentReport(
        agent_id="host-7", seq=41, unix_ms=1_700_000_000_123,
        devices=[agent_pb2.DeviceReport(index="0", tflops=312.5, memory_total_gb=80.0,
                                        memory_free_gb=12.25, utilization=0.75,
                                        colocated_processes=2, colocated_load=0.5,
                                        emulated=True, probe_dtype="bfloat16",
                                        probe_shape="4096x4096x4096"),
                 agent_pb2.DeviceReport(index="gpu1", tflops=0.0)],
        links=[agent_pb2.LinkReport(peer_host="host-8", gbps=100.0, rtt_us=12.5)])


def test_a_valid_report_converts_to_its_record() -> None:
    assert convert.report_from_proto(_proto()) == _report()


@pytest.mark.parametrize(("field", "value"), [
    ("devices[1].tflops", math.nan), ("devices[1].tflops", math.inf),
    ("devices[1].tflops", -1.0), ("devices[1].tflops", 2e6),
    ("devices[1].memory_total_gb", 1e7), ("devices[1].memory_free_gb", -0.5),
    ("devices[1].utilization", 1.5), ("devices[1].utilization", math.nan),
    ("devices[1].colocated_load", -math.inf),
    ("devices[1].index", ""), ("devices[1].index", "a:b"), ("devices[1].index", "a b"),
    ("devices[1].probe_dtype", "b float"), ("devices[1].probe_shape", "-x"),
    ("links[0].peer_host", ""), ("links[0].peer_host", "h/1"),
    ("links[0].gbps", math.nan), ("links[0].gbps", 1e7),
    ("links[0].rtt_us", -1.0), ("links[0].rtt_us", 2e9),
])
def test_each_bad_value_of_a_report_is_refused_naming_its_field(field: str,
                                                                value: object) -> None:
    req = _proto()
    part, attr = field.split(".")
    kind, index = part.rstrip("]").split("[")
    setattr(getattr(req, kind)[int(index)], attr, value)
    with pytest.raises(ValidationError) as caught:
        convert.report_from_proto(req)
    assert caught.value.field == field


@pytest.mark.parametrize(("field", "value"), [
    ("tflops", 1e6), ("memory_total_gb", 1e6), ("utilization", 1.0), ("colocated_load", 0.0),
    ("utilization", -0.0), ("index", "x" * 128), ("probe_dtype", ""),
])
def test_values_at_the_bounds_are_taken(field: str, value: object) -> None:
    req = _proto()
    setattr(req.devices[0], field, value)
    assert getattr(convert.report_from_proto(req).devices[0], field) == value
