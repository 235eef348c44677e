"""``hetpilot daemon --listen ADDR --state-dir DIR [--config daemon.toml]``.

Exit codes: 0 stopped cleanly (SIGTERM/SIGINT), 1 failed at run time,
2 bad configuration (one line on stderr)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from .config import ConfigError, load_daemon_config
from .errors import StorageError

__all__ = ["add_arguments", "run"]


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", metavar="HOST:PORT", help="gRPC address (port 0: OS picks)")
    parser.add_argument("--state-dir", metavar="DIR", help="SQLite state and endpoints.json")
    parser.add_argument("--config", metavar="daemon.toml")
    parser.add_argument("--metrics-listen", metavar="HOST:PORT",
                        help="Prometheus address; '' turns metrics off")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_daemon_config(args.config, listen=args.listen, state_dir=args.state_dir,
                                    metrics_listen=args.metrics_listen)
        config.auth.resolved()
    except (ConfigError, OSError) as exc:
        print(f"hetpilot daemon: error: {exc}", file=sys.stderr)
        return 2
    from .server import serve

    try:
        asyncio.run(serve(config))
    except (OSError, StorageError) as exc:  # a taken port, a damaged state store
        print(f"hetpilot daemon: error: {exc}", file=sys.stderr)
        return 1
    return 0
