"""``hetpilot daemon --listen ADDR --state-dir DIR [--config daemon.toml] [--insecure-local]``.

Exit codes: 0 stopped cleanly (SIGTERM/SIGINT), 1 failed at run time,
2 bad configuration (one line on stderr)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from .config import ConfigError, DaemonConfig, load_daemon_config
from .errors import StorageError

__all__ = ["add_arguments", "run"]


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    defaults = DaemonConfig()
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help="gRPC address (port 0: OS picks); default: the config's listen, "
                             f"else {defaults.listen}")
    parser.add_argument("--state-dir", metavar="DIR",
                        help="SQLite state, endpoints.json and keys; default: the config's "
                             f"state_dir, else {defaults.state_dir}")
    parser.add_argument("--config", metavar="daemon.toml")
    parser.add_argument("--metrics-listen", metavar="HOST:PORT",
                        help="Prometheus address; '' turns metrics off")
    parser.add_argument("--log-level", default="INFO", help="default: %(default)s")
    parser.add_argument("--insecure-local", action="store_true",
                        help="one-machine trial: NO AUTHENTICATION (every caller is owner "
                             "'anonymous' and may act as any agent or trainer); a loopback "
                             "--listen only. Without it and without tokens in the config, the "
                             "first start makes tokens in the state dir")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_daemon_config(args.config, listen=args.listen, state_dir=args.state_dir,
                                    metrics_listen=args.metrics_listen,
                                    insecure_local=args.insecure_local or None)
        config.auth.resolved()
    except (ConfigError, OSError) as exc:
        print(f"hetpilot daemon: error: {exc}", file=sys.stderr)
        return 2
    from .server import serve
    from .sqlite_schema import SchemaError

    try:
        asyncio.run(serve(config))
    except (OSError, StorageError, SchemaError) as exc:
        # a taken port; a damaged, unopenable or newer (schema) state store
        print(f"hetpilot daemon: error: {exc}", file=sys.stderr)
        return 1
    return 0
