"""A launch's output on its agent: one copy, capped at ``[launch] output_bytes`` (the
oldest dropped, a marker line in its place in what is sent), so one launch's flood
never fails another's start, even on a small file system (a tmpfs mounted by the
test, as root; skipped elsewhere). torchrun is played by a stand-in that starts the
launcher's rank command as rank 0; the runner, rankio and the ranks are real."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hetpilot.agents.launcher import Launcher
from hetpilot.agents.output import OutputReader, OutputWriter
from hetpilot.v1 import agent_pb2

from .helpers import wait_until
from .sandbox import small_fs

pytestmark = pytest.mark.timeout(120)

STAND_IN = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], env=dict(os.environ, RANK="0"), start_new_session=True)
sys.exit(child.wait())
"""
LINE = "x" * 99  # 100 bytes with its newline; 108 with the "[rank0]:" prefix


def _flood(mib: int) -> str:
    return (f"import sys\nfor _ in range({mib * 1024 * 1024 // 100 // 1000}):\n"
            f"    sys.stdout.write(({LINE!r} + '\\n') * 1000)\n"
            "print('last line', flush=True)\n")


class StandIn(Launcher):
    def torchrun(self, order: Any, work: Path) -> list[str]:
        return [sys.executable, "-c", STAND_IN, *self.rank_command(order, work)]


def _order(launch_id: str, code: str) -> Any:
    return agent_pb2.LaunchOrder(launch_id=launch_id, job_id=f"j{launch_id}", nnodes=1,
                                 devices=["0"], rdzv_endpoint="127.0.0.1:1",
                                 command=[sys.executable, "-c", code])


def _ended(launcher: Launcher, launch_id: str) -> Any:
    launcher.poll()
    state = launcher.get(launch_id)
    return state is not None and not state.running and state


def test_output_is_capped_and_what_was_dropped_unsent_is_marked(tmp_path: Path) -> None:
    cap = 256 * 1024
    launcher = StandIn(tmp_path / "agent", host="h", daemon="d:1", run_as="agent",
                       output_bytes=cap)
    assert launcher.start(_order("L1", _flood(4)), {})
    state = wait_until("the flood to end", lambda: _ended(launcher, "L1"), timeout=90)
    assert state.exit_code == 0, state.reason
    written = 4 * 1024 * 1024 // 100 // 1000 * 1000 * 108 + len(b"[rank0]:last line\n")
    assert state.output_bytes() == written  # the whole output's size, offsets as ever
    assert state.output.on_disk() <= cap  # what the disk holds
    kept = state.output.read_bytes()
    assert kept.endswith(b"[rank0]:last line\n") and len(kept) >= cap // 2
    # nothing was sent yet: the first chunk says what was dropped, where, then goes on
    [(launch_id, offset, data)] = launcher.chunks()
    first = state.output.segments()[0][0]
    head, sep, rest = data.partition(b"(launch output cap: [launch] output_bytes = 262144)\n")
    assert launch_id == "L1" and rest and offset + len(head) + len(sep) == first
    assert head.lstrip(b"\n") == f"[hetpilot] {first} bytes of output dropped here on the " \
        "agent before they were sent ".encode()
    assert kept.startswith(rest)
    launcher.acked([("L1", False)], [("L1", offset, data)])
    # all of it is the daemon's now (no marker again): the launch is done
    assert launcher.chunks() == [] and state.done


def test_a_writer_keeps_at_most_its_cap_and_a_reader_finds_each_byte_by_offset(
        tmp_path: Path) -> None:
    writer = OutputWriter(tmp_path / "out", cap=64 * 1024)
    stream = bytes(range(256)) * 1024  # 256 KiB
    for i in range(0, len(stream), 5000):
        writer.write(stream[i:i + 5000])
    reader = OutputReader(tmp_path / "out")
    assert reader.end() == len(stream) and reader.on_disk() <= 64 * 1024
    segs = reader.segments()
    first = segs[0][0]
    assert reader.read(first + 100, 1000) == (first + 100, stream[first + 100:first + 1100])
    assert reader.read(len(stream), 10) == (len(stream), b"")
    assert reader.tail(50) == stream[-50:]


def test_one_launchs_flood_never_fails_anothers_start_on_a_small_disk(tmp_path: Path) -> None:
    with small_fs(tmp_path, "6m") as disk:
        launcher = StandIn(disk / "agent", host="h", daemon="d:1", run_as="agent",
                           output_bytes=1024 * 1024)
        assert launcher.start(_order("A", _flood(24)), {})  # 4x the file system
        flood = wait_until("the flood to end", lambda: _ended(launcher, "A"), timeout=100)
        assert flood.exit_code == 0, flood.reason
        assert flood.output.on_disk() <= 1024 * 1024
        assert launcher.start(_order("B", "print('hello from B')"), {})
        other = wait_until("B to end", lambda: _ended(launcher, "B"), timeout=60)
        assert other.exit_code == 0, other.reason
        assert other.output.read_bytes() == b"[rank0]:hello from B\n"
