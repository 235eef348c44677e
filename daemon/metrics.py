"""Prometheus metrics of one daemon, on their own registry and port."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["Metrics"]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reports = Counter("hetpilot_reports_received", "Agent reports received", registry=r)
        self.rejected = Counter("hetpilot_requests_rejected", "Requests refused",
                                ["code"], registry=r)
        self.solve_s = Histogram("hetpilot_slot_solve_seconds", "Controller step time per slot",
                                 buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
                                 registry=r)
        self.plan_versions = Counter("hetpilot_plan_versions", "Plan versions decided",
                                     registry=r)
        self.queue = Gauge("hetpilot_queue_backlog",
                           "Largest virtual queue backlog over the jobs, per cost kind",
                           ["kind"], registry=r)
        self.queue_kinds: set[str] = set()
        self.loop_failures = Counter("hetpilot_job_loop_failures", "Job loop slots that failed",
                                     registry=r)
        self.loops_failing = Gauge("hetpilot_job_loops_failing",
                                   "Job loops whose last slot failed (retrying with back-off)",
                                   registry=r)
        self.agents_up = Gauge("hetpilot_agents_up", "Agents reporting within the timeout",
                               registry=r)
        self.jobs = Gauge("hetpilot_jobs_running", "Jobs with a control loop", registry=r)
        self._server: Any = None

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server in a thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
