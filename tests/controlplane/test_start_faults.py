"""A daemon subprocess refusing a state store it cannot use at start: one line on
stderr naming the file, exit 1, no traceback, the store left as it was."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hetpilot.daemon.sqlite_store import SqliteStore

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def _daemon(state: Path, wrap: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hetpilot", "daemon", "--listen", "127.0.0.1:0",
           "--state-dir", str(state), "--metrics-listen", "", "--insecure-local"]
    return subprocess.run([*(wrap or []), *cmd], capture_output=True, text=True, timeout=60)


def _one_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hetpilot daemon: error")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_a_store_from_a_newer_daemon_is_refused_with_one_line(tmp_path: Path) -> None:
    state = tmp_path / "s"
    state.mkdir()
    SqliteStore(state / "state.db").close()
    db = sqlite3.connect(state / "state.db")
    db.execute("PRAGMA user_version=99")
    db.close()
    before = (state / "state.db").read_bytes()
    error = _one_error(_daemon(state))
    assert "schema version 99" in error and str(state / "state.db") in error
    assert (state / "state.db").read_bytes() == before


def test_a_read_only_state_dir_is_refused_naming_the_file(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-m", "true"], capture_output=True) \
        if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs unshare -m (a private mount namespace) for a read-only bind mount")
    state = tmp_path / "s"
    state.mkdir()
    SqliteStore(state / "state.db").close()  # a good store, on a file system now read-only
    (state / "trainer-token.key").write_bytes(b"k" * 32)
    script = (f'mount --bind -o ro "{state}" "{state}" && exec "$@"')
    proc = _daemon(state, ["unshare", "-m", "sh", "-c", script, "sh"])
    error = _one_error(proc)
    assert str(state / "state.db") in error and "write" in error


def test_a_second_daemon_on_the_same_state_dir_is_refused_naming_the_first(
        tmp_path: Path) -> None:
    import json
    import signal
    import time

    state = tmp_path / "s"
    cmd = [sys.executable, "-m", "hetpilot", "daemon", "--listen", "127.0.0.1:0",
           "--state-dir", str(state), "--metrics-listen", "", "--insecure-local"]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (state / "endpoints.json").exists():
            assert first.poll() is None and time.monotonic() < deadline, "first did not start"
            time.sleep(0.1)
        before = (state / "endpoints.json").read_text()
        error = _one_error(_daemon(state))
        assert f"in use by another daemon (pid {first.pid}" in error, error
        assert (state / "endpoints.json").read_text() == before  # still names the first
        assert json.loads(before)["pid"] == first.pid
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    # the lock goes with the process: a daemon started after the first stopped serves
    again = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while json.loads((state / "endpoints.json").read_text())["pid"] != again.pid:
            assert again.poll() is None and time.monotonic() < deadline, again.stderr
            time.sleep(0.1)
    finally:
        again.send_signal(signal.SIGTERM)
        again.wait(30)


@pytest.mark.parametrize(("damage", "names"), [
    ("UPDATE jobs SET body='{not json'", "a row of table jobs cannot be read"),
    ("INSERT INTO agents VALUES ('h9', '[1, 2]')", "a row of table agents cannot be read"),
    ("DROP TABLE plans", "but no table plans"),
])
def test_rows_or_tables_the_daemon_cannot_read_are_refused_with_one_line(
        tmp_path: Path, damage: str, names: str) -> None:
    # a hand-edited store passes quick_check; its rows failed with a traceback at start
    from hetpilot.daemon.records import JobRecord

    state = tmp_path / "s"
    state.mkdir()
    store = SqliteStore(state / "state.db")
    store.create_job(JobRecord(job_id="j1", owner="o", name="t", state="running",
                               global_batch=8, microbatch_size=4, schedules=("1f1b",),
                               budgets={}, V=10.0, slot_s=1.0, model_json=""))
    store.close()
    db = sqlite3.connect(state / "state.db")
    db.execute(damage)
    db.commit()
    db.close()
    before = (state / "state.db").read_bytes()
    error = _one_error(_daemon(state))
    assert str(state / "state.db") in error and names in error, error
    assert (state / "state.db").read_bytes() == before
