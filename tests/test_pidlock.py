"""The one-process-per-state-dir lock the agent and the daemon hold (hetpilot.pidlock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hetpilot.agents.launchstate import StateDirInUse, lock_state_dir

from hetpilot import pidlock

HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from hetpilot.agents.launchstate import lock_state_dir
    held = lock_state_dir(Path(sys.argv[1]))  # kept: the open file is the lock
    print("held", flush=True)
    sys.stdin.read()
""")


def test_a_second_holder_is_refused_naming_the_first_until_the_first_dies(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(StateDirInUse, match=rf"another hetpilot agent \(pid {holder.pid}\)"):
            lock_state_dir(tmp_path)
        with pytest.raises(pidlock.LockHeld) as held:
            pidlock.take(tmp_path / "agent.lock")
        assert held.value.holder == str(holder.pid)
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel lets the lock go, however it ends
        holder.wait()
    handle = pidlock.take(tmp_path / "agent.lock")
    assert (tmp_path / "agent.lock").read_text() == f"{os.getpid()}\n"
    assert (tmp_path / "agent.lock").stat().st_mode & 0o777 == 0o600
    pidlock.release(handle)
    assert (tmp_path / "agent.lock").read_text() == ""
    pidlock.release(pidlock.take(tmp_path / "agent.lock"))  # released: taken again
