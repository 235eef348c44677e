"""``hetpilot sim``: --plot checked before the run, and the progress bar on stderr."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hetpilot.planner.errors import ValidationError
from hetpilot.sim import cli as sim_cli
from hetpilot.sim import progress

from hetpilot.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = json.loads((ROOT / "examples" / "scenario.json").read_text())


def _write(tmp_path: Path, **changes: Any) -> str:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({**EXAMPLE, **changes}))
    return str(path)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make any simulation fail the test: the run must not start."""
    started: list[str] = []

    def simulate(*args: Any, **kwargs: Any) -> Any:
        started.append("simulate")
        raise AssertionError("the run started")

    monkeypatch.setattr(sim_cli, "simulate", simulate)
    return started


# -- --plot ----------------------------------------------------------------------------

def _unwritable(tmp_path: Path, kind: str) -> tuple[str, str]:
    """(path, words the error must contain)"""
    if kind == "missing folder":
        return str(tmp_path / "no" / "such" / "out.png"), "does not exist"
    if kind == "file as folder":
        (tmp_path / "f.txt").write_text("x")
        return str(tmp_path / "f.txt" / "out.png"), "not a folder"
    if kind == "folder as file":
        return str(tmp_path), "is a folder"
    if kind == "unknown format":
        return str(tmp_path / "out.xyz"), "unknown image format"
    if kind == "read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        return str(ro / "out.png"), "cannot write"
    assert kind == "read-only file system"
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    return "/proc/hetpilot-sim-test.png", "cannot write"


@pytest.mark.parametrize("kind", ["missing folder", "file as folder", "folder as file",
                                  "unknown format", "read-only folder", "read-only file system"])
def test_unwritable_plot_exits_2_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                no_run: list[str], kind: str) -> None:
    target, words = _unwritable(tmp_path, kind)
    scenario = _write(tmp_path, slots=300)  # minutes of work if it ran, for every policy
    start = time.monotonic()
    code = main(["sim", "--scenario", scenario, "--policy", "lyapunov,static,budget-greedy",
                 "--plot", target])
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    assert code == 2
    assert no_run == []
    assert elapsed < 10.0
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "--plot" in err[0] and words in err[0], err
    assert captured.out == ""


def test_unwritable_plot_is_found_before_the_sweep(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   no_run: list[str]) -> None:
    code = main(["sim", "--scenario", _write(tmp_path), "--sweep-V", "1,10",
                 "--plot", str(tmp_path / "missing" / "sweep.png")])
    assert code == 2 and no_run == []
    assert "--plot" in capsys.readouterr().err


def test_plot_probe_leaves_no_file_and_keeps_an_existing_one(tmp_path: Path) -> None:
    new = tmp_path / "new.png"
    sim_cli._check_plot(str(new))
    assert not new.exists()
    old = tmp_path / "old.png"
    old.write_bytes(b"keep me")
    sim_cli._check_plot(str(old))
    assert old.read_bytes() == b"keep me"
    sim_cli._check_plot(str(tmp_path / "no_suffix"))  # matplotlib's default format
    with pytest.raises(ValidationError) as err:
        sim_cli._check_plot(str(tmp_path / "gone" / "x.pdf"))
    assert err.value.field == "--plot"


# -- progress bar ----------------------------------------------------------------------

def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"json": False, "table": False, **kw})


def test_progress_wanted_only_for_a_person_watching_a_long_run() -> None:
    long, short = progress.MIN_STEPS, progress.MIN_STEPS - 1
    tty, pipe = _Tty(), io.StringIO()
    # stderr a terminal, stdout a file or the table: the bar is on
    assert progress.progress_wanted(_args(), long, pipe, tty)
    assert progress.progress_wanted(_args(table=True), long, tty, tty)
    # never when stderr is not a terminal, nor with --json, nor for a short run
    assert not progress.progress_wanted(_args(), long, pipe, pipe)
    assert not progress.progress_wanted(_args(table=True), long, tty, pipe)
    assert not progress.progress_wanted(_args(json=True), long, pipe, tty)
    assert not progress.progress_wanted(_args(), short, pipe, tty)
    # JSON lines printed to the same terminal as they come: no bar through them
    assert not progress.progress_wanted(_args(), long, tty, tty)
    assert not progress.progress_wanted(_args(), long, pipe, None)


def test_slot_steps_weigh_big_clusters() -> None:
    assert progress.slot_steps(300, 2, 12) == 600
    assert progress.slot_steps(20, 2, 1024) == 20 * 2 * 16


class _Recorder(progress.SlotProgress):
    made: ClassVar[list[_Recorder]] = []

    def __init__(self, total: int, enabled: bool) -> None:
        super().__init__(total, enabled)
        self.steps = 0
        _Recorder.made.append(self)

    def advance(self, steps: int = 1) -> None:
        self.steps += steps
        super().advance(steps)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> list[_Recorder]:
    _Recorder.made = []
    monkeypatch.setattr(sim_cli, "SlotProgress", _Recorder)
    monkeypatch.setattr(progress, "MIN_STEPS", 1)  # every run counts as long
    return _Recorder.made


def test_no_progress_bar_when_stderr_is_not_a_terminal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], recorder: list[_Recorder]) -> None:
    assert main(["sim", "--scenario", _write(tmp_path), "--slots", "4"]) == 0
    captured = capsys.readouterr()
    assert [r.enabled for r in recorder] == [False]
    assert recorder[0].steps == 4 == recorder[0].total
    assert captured.err == ""
    assert all(json.loads(line) for line in captured.out.splitlines())


def test_no_progress_bar_with_json_even_on_a_terminal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], recorder: list[_Recorder],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert main(["sim", "--scenario", _write(tmp_path), "--slots", "3", "--json"]) == 0
    assert [r.enabled for r in recorder] == [False]
    assert sys.stderr.getvalue() == ""  # type: ignore[attr-defined]
    capsys.readouterr()


def test_progress_bar_on_a_terminal_leaves_stdout_machine_readable(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], recorder: list[_Recorder],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert main(["sim", "--scenario", _write(tmp_path), "--slots", "3",
                 "--policy", "lyapunov,static"]) == 0
    assert [r.enabled for r in recorder] == [True]
    assert recorder[0].steps == recorder[0].total == 6
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 8 and lines[-1]["summary"] is True
