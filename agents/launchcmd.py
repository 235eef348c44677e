"""The command lines and environments of a launch, built from its order (an
``agent_pb2.LaunchOrder``): the runner, torchrun under it, each rank's entry
point under :mod:`hetpilot.agents.rankio`; and whether the rendezvous port is
free here. Pure but for reading ``os.environ`` and binding a port;
:mod:`hetpilot.agents.launcher` says what each variable is for."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .owner import User

__all__ = ["job_env", "port_in_use", "rank_command", "runner_command", "runner_env",
           "torchrun_command"]

_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 "MASTER_ADDR", "MASTER_PORT")
_OWN_PREFIXES = ("HETPILOT_", "TORCHELASTIC_")


def port_in_use(port: int) -> str | None:
    """Why ``port`` cannot be listened on here (on every address, with SO_REUSEADDR, as
    torchrun's c10d store does), or None when it can."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((address, port))
                sock.listen(1)
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno in (errno.EAFNOSUPPORT,
                                                           errno.EADDRNOTAVAIL):  # no IPv6
                continue
            return exc.strerror or str(exc)
    return None


def runner_command(python: str, directory: Path, *, output_cap: int, grace_s: float,
                   who: User | None, cgroups: Sequence[Path] = ()) -> list[str]:
    """:mod:`hetpilot.agents.runner` for the launch whose record is in ``directory``,
    switching to ``who`` (None: stay the agent's user), in the launch's ``cgroups``;
    torchrun's command follows."""
    command = [python, "-m", "hetpilot.agents.runner", "--exit", str(directory / "exit"),
               "--output", str(directory / "output"), "--output-bytes", str(output_cap),
               "--parent", str(os.getpid()), "--grace", str(grace_s)]
    for cgroup in cgroups:
        command += ["--cgroup", str(cgroup)]
    if who is not None:
        command += ["--uid", str(who.uid), "--gid", str(who.gid),
                    "--groups", ",".join(map(str, who.groups))]
    return command


def torchrun_command(python: str, order: Any, work: Path, local_addr: str,
                     ranks: list[str]) -> list[str]:
    """torchrun for ``order``, starting ``ranks`` (a command line) for each local rank."""
    cmd = [python, "-m", "hetpilot.agents.torchrun", "--nnodes", str(order.nnodes),
           "--nproc-per-node", str(len(order.devices)), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", order.rdzv_endpoint, "--rdzv-id", order.launch_id,
           "--rdzv-conf", f"is_host={'true' if order.rdzv_host else 'false'}",
           "--max-restarts", str(order.max_restarts), "--log-dir", str(work / "ranks")]
    if local_addr:
        cmd += ["--local-addr", local_addr]
    return [*cmd, "--no-python", *ranks]


def rank_command(python: str, order: Any, work: Path) -> list[str]:
    """What torchrun starts for each rank: the entry point under
    :mod:`hetpilot.agents.rankio` (the job's environment, prefixed lines)."""
    entry = [python, "-u", "-m", order.module] if order.module else list(order.command)
    return [python, "-m", "hetpilot.agents.rankio", str(work / "env.json"), "--",
            *entry, *order.args]


def job_env(order: Any) -> dict[str, str]:
    """The job's ``[entry.env]`` as its ranks get it: all but the variables the agent
    and torchrun set themselves."""
    return {k: v for k, v in order.env.items()
            if not k.startswith(_OWN_PREFIXES) and k not in _TORCHRUN_ENV
            and k != "CUDA_VISIBLE_DEVICES"}


def runner_env(order: Any, *, host: str, daemon: str, token: Path, devices: list[str],
               device_kinds: Mapping[str, str], tls: Mapping[str, str],
               who: User | None = None) -> dict[str, str]:
    """The runner's and torchrun's environment (the ranks get the job's on top):
    the agent's, less its own and torchrun's variables, and the launch's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_OWN_PREFIXES) and k not in _TORCHRUN_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    if who is not None:
        env.update(HOME=who.home, USER=who.name, LOGNAME=who.name)
        for key in ("XDG_RUNTIME_DIR", "XDG_STATE_HOME", "XDG_CONFIG_HOME",
                    "XDG_CACHE_HOME", "XDG_DATA_HOME", "MAIL"):
            env.pop(key, None)  # the agent's, not the user's
    env.update({
        "HETPILOT_JOB_ID": order.job_id, "HETPILOT_LAUNCH_ID": order.launch_id,
        "HETPILOT_ADDRESS": daemon, "HETPILOT_TOKEN_FILE": str(token),
        "HETPILOT_DEVICE_IDS": ",".join(f"{host}:{d}" for d in devices)})
    for key, value in tls.items():
        if who is None or key == "ca_file":  # the agent's own certificate stays its own
            env[f"HETPILOT_{key.upper()}"] = value
    if devices and all(device_kinds.get(d) == "cuda" for d in devices):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env
