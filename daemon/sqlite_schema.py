"""The SQLite store's schema: the migrations that build it, step by step, and the
version they reach (``PRAGMA user_version``). A database written by a newer daemon
is refused (:class:`SchemaError`) rather than half understood."""

from __future__ import annotations

import re

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "TABLES", "SchemaError"]


class SchemaError(RuntimeError):
    """The database was written by a newer daemon (a higher schema version)."""


#: ``MIGRATIONS[v]`` takes a database from schema version v to v + 1. Only ever
#: append: a released step never changes, because databases out there ran it.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 0 -> 1: the original tables. Databases from before versioning have them and
    # user_version 0; IF NOT EXISTS leaves their rows alone.
    ("""CREATE TABLE IF NOT EXISTS jobs (
          seq INTEGER PRIMARY KEY AUTOINCREMENT,
          job_id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL, request_id TEXT NOT NULL,
          body TEXT NOT NULL)""",
     "CREATE INDEX IF NOT EXISTS jobs_owner_request ON jobs(owner, request_id)",
     """CREATE TABLE IF NOT EXISTS job_status (
          job_id TEXT PRIMARY KEY, status TEXT NOT NULL, controller_state TEXT NOT NULL)""",
     """CREATE TABLE IF NOT EXISTS plans (
          job_id TEXT NOT NULL, version INTEGER NOT NULL, body TEXT NOT NULL,
          PRIMARY KEY (job_id, version))""",
     "CREATE TABLE IF NOT EXISTS agents (host TEXT PRIMARY KEY, body TEXT NOT NULL)",
     "CREATE TABLE IF NOT EXISTS reports (agent_id TEXT PRIMARY KEY, body TEXT NOT NULL)",
     """CREATE TABLE IF NOT EXISTS timings (
          job_id TEXT NOT NULL, rank INTEGER NOT NULL, body TEXT NOT NULL,
          PRIMARY KEY (job_id, rank))"""),
    # 1 -> 2: each job's training progress (latest loss and eval metric). Stored
    # timings need no change: their JSON bodies gained optional keys, and the old
    # bodies read back with loss and eval_metric None.
    ("CREATE TABLE IF NOT EXISTS progress (job_id TEXT PRIMARY KEY, body TEXT NOT NULL)",),
    # 2 -> 3: layer times each device measured on a job. Stored jobs,
    # agents and reports need no change: their JSON bodies gained keys with
    # defaults (slot_iterations 0, probe_dtype / probe_shape "").
    ("""CREATE TABLE IF NOT EXISTS measurements (
          job_id TEXT NOT NULL, device_id TEXT NOT NULL, body TEXT NOT NULL,
          PRIMARY KEY (job_id, device_id))""",),
    # 3 -> 4: drained hosts. Stored jobs and slot statuses need no change:
    # their JSON bodies gained keys with defaults (started_ms, ended_ms, reason; spent,
    # updated_ms), and the new states ("succeeded", "failed") are only ever written.
    ("CREATE TABLE IF NOT EXISTS drains (host TEXT PRIMARY KEY, body TEXT NOT NULL)",),
    # 4 -> 5: launches of jobs with an entry point. Stored jobs need
    # no change: their JSON bodies gained `entry` (empty: no entry point), and agents
    # `launches` (false until the agent registers again).
    ("""CREATE TABLE IF NOT EXISTS launches (
          seq INTEGER PRIMARY KEY AUTOINCREMENT,
          launch_id TEXT UNIQUE NOT NULL, job_id TEXT NOT NULL, body TEXT NOT NULL)""",
     "CREATE INDEX IF NOT EXISTS launches_job ON launches(job_id)"),
)
SCHEMA_VERSION = len(MIGRATIONS)
"""The schema version this code writes (``PRAGMA user_version``)."""
TABLES = tuple(m[1] for step in MIGRATIONS for statement in step
               if (m := re.match(r"\s*CREATE TABLE IF NOT EXISTS (\w+)", statement)))
"""The tables the migrations create, which an open store must have."""
