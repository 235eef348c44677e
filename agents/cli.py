"""``hetpilot agent --daemon ADDR [--config agent.toml] [--emulate SPEC ...]``.

Exit codes: 0 stopped by SIGTERM/SIGINT, 1 the probe port cannot be listened on
(``--probe-listen``), 2 bad configuration."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from hetpilot.flags import seconds

from .config import ConfigError, load_agent_config, parse_emulate

__all__ = ["add_arguments", "run"]


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--daemon", metavar="HOST:PORT",
                        help="daemon address (default: the config, then $HETPILOT_ADDRESS)")
    parser.add_argument("--config", metavar="agent.toml")
    parser.add_argument("--host", help="this host's name in the cluster (default: hostname)")
    parser.add_argument("--probe-listen", metavar="HOST:PORT",
                        help="link-probe server address (port 0: OS picks)")
    parser.add_argument("--token-file", help="file holding the cluster token")
    parser.add_argument("--emulate", action="append", default=[], metavar="SPEC",
                        help="declare fake devices for CPU-only test clusters: "
                             "tflops=50,memory_gb=24[,price_per_hour=1,power_watts=300,count=2]")
    parser.add_argument("--emulate-file", metavar="FILE",
                        help="EMULATED conditions (JSON, re-read before every report): device "
                             "TFLOP/s and host links to report instead of measured ones")
    parser.add_argument("--link-probe-interval", type=seconds(), metavar="S")
    parser.add_argument("--state-dir", metavar="DIR",
                        help="launch records and output (default: $STATE_DIRECTORY, else "
                             "~/.local/state/hetpilot/agent-HOST)")
    parser.add_argument("--no-launch", action="store_true",
                        help="never start job ranks here (the daemon then launches jobs with "
                             "an entry point on other hosts only)")
    parser.add_argument("--stop-grace", type=seconds(), metavar="S",
                        help="seconds between SIGTERM and SIGKILL when a launch is stopped "
                             "(default 10)")
    parser.add_argument("--run-as", choices=("owner", "agent"),
                        help="whose user launched ranks run as: their job owner's unix user "
                             "(the default; needs root) or this agent's own (hosts whose "
                             "owners trust each other); [launch] run_as")
    parser.add_argument("--launch-retention", type=seconds(zero=True), metavar="S",
                        help="seconds a launch's directory is kept after it ended and the "
                             "daemon acknowledged its exit and output (default 86400)")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        emulate = tuple(parse_emulate(s) for s in args.emulate)
        flags = dict(host=args.host, probe_listen=args.probe_listen, token_file=args.token_file,
                     emulate=emulate, link_probe_interval_s=args.link_probe_interval,
                     emulate_file=args.emulate_file, state_dir=args.state_dir,
                     launch=False if args.no_launch else None,
                     stop_grace_s=args.stop_grace,
                     launch_retention_s=args.launch_retention, run_as=args.run_as)
        config = load_agent_config(args.config, daemon=args.daemon, **flags)
        if not config.daemon:
            env = os.environ.get("HETPILOT_ADDRESS", "")
            if not env:
                raise ConfigError("no daemon address: pass --daemon or set HETPILOT_ADDRESS")
            config = load_agent_config(args.config, daemon=env, **flags)
        config.cluster_token()
        from .host_secret import HostSecret
        HostSecret(config.resolved_state_dir()).value()  # made now: a bad state dir says so
        from .launchstate import lock_state_dir
        # one agent process per state dir, held until this process ends
        held = lock_state_dir(config.resolved_state_dir()) if config.launch else None
    except (ConfigError, OSError) as exc:
        print(f"hetpilot agent: error: {exc}", file=sys.stderr)
        return 2
    from .agent import Agent, ProbeListenError

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # SIGHUP (a closed terminal) stops as SIGTERM does, not at once (its default)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await Agent(config).run(stop)

    try:
        asyncio.run(main())
    except ProbeListenError as exc:
        print(f"hetpilot agent: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if held is not None:
            held.close()
    return 0
