"""Agent membership: which agents registered, which are up, what they last reported,
which hosts are drained, and each agent's probe peers.

Register, report and heartbeat land here; liveness is swept on the heartbeat
timeout; drains are persisted. Host names are bound to credentials (see
:meth:`Membership.register`): the cluster token bootstraps a host, as a
kubelet's bootstrap token does; the first Register of a name binds it to the
agent's secret (only its hash is stored, in the agent's record), later ones
must carry it, and only an operator unbinds a name (:meth:`Membership.forget`). What the rest of the daemon must react to (a
host came up, registered, reported, was drained or resumed) goes to a
:class:`MembershipListener`, so this module never reaches the job loops or the
launches. Runs on the event loop thread.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol

from hetpilot.planner.errors import ValidationError

from .config import DaemonConfig
from .decode import RateLimitedLog
from .errors import FailedPrecondition, NotFound, PermissionDenied
from .group_commit import ReportCommitter
from .metrics import Metrics
from .records import AgentRecord, AgentReport, DrainRecord
from .store import Store

__all__ = ["PEERS_PER_AGENT", "Membership", "MembershipListener", "Peers", "check_secret",
           "secret_hash", "short_list"]

log = logging.getLogger("hetpilot.daemon")

PEERS_PER_AGENT = 4
"""Each agent probes this many peers (its successors in host order), so probe
traffic grows linearly with the cluster; unmeasured pairs take the defaults."""

_refusals = RateLimitedLog()
"""Refused registrations of bound names, logged once a minute per host."""

Peers = tuple[tuple[str, str], ...]
"""(host, probe address) of the peers an agent probes."""


class MembershipListener(Protocol):
    """What the daemon does when membership changes (called on the event loop)."""

    def host_up(self, host: str) -> None:
        """``host`` came up (first registration or back from silence)."""

    def registered(self, host: str) -> None:
        """``host``'s agent registered (again)."""

    def reported(self, report: AgentReport) -> None:
        """A report of a registered agent was taken."""

    def host_drained(self, host: str) -> int:
        """``host`` was drained; how many jobs were using it."""

    def host_resumed(self, host: str) -> None:
        """``host`` was resumed after a drain."""


def short_list(items: list[str], limit: int = 8) -> str:
    """Up to ``limit`` names, then how many more (a warning must stay one short line)."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _machine(probe_address: str) -> str:
    """The host part of a probe address (``10.0.0.1:7071`` -> ``10.0.0.1``)."""
    return probe_address.rpartition(":")[0] if ":" in probe_address else probe_address


_SECRET = re.compile(r"[A-Za-z0-9_.:~+/=-]{16,256}")


def check_secret(value: str) -> str:
    """A host secret as sent (RegisterRequest.host_secret): empty, or 16-256 printable
    characters without spaces. The error never echoes it."""
    if value and not _SECRET.fullmatch(value):
        raise ValidationError("host_secret", "must be 16-256 characters of A-Z a-z 0-9 "
                              f"_.:~+/=- (got {len(value)} characters)")
    return value


def secret_hash(secret: str) -> str:
    """What the store keeps of a host secret: SHA-256, hex. The secrets are random
    (32 bytes from the agent or the daemon), so a plain hash is enough."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _now_ms() -> int:
    return int(time.time() * 1000)


class Membership:
    """The live agent tables, loaded from the store and kept in step with it."""

    def __init__(self, store: Store, config: DaemonConfig, metrics: Metrics,
                 listener: MembershipListener,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.config, self.metrics = store, config, metrics
        self.listener = listener
        self.clock = clock
        self._agents: dict[str, AgentRecord] = {a.host: a for a in store.agents()}
        self._reports: dict[str, AgentReport] = store.latest_reports()
        now = clock()
        # After a restart every known agent gets restart_grace_s (at least one
        # heartbeat timeout) to come back before it counts as down.
        extra = max(0.0, config.restart_grace_s - config.heartbeat_timeout_s)
        self._last_seen: dict[str, float] = dict.fromkeys(self._agents, now + extra)
        self._up: frozenset[str] = frozenset(self._agents)
        # for `hetpilot nodes`: drained hosts (persisted), when each host entered its
        # state (wall clock; the daemon's start for those it knew) and was last heard of
        self._drained: dict[str, DrainRecord] = {d.host: d for d in store.drains()}
        self.started_ms = _now_ms()
        self._since: dict[str, int] = dict.fromkeys(self._agents, self.started_ms)
        self._heard_ms: dict[str, int] = {}
        # each host's latest registration (RegisterResponse.registration; lost on a
        # restart, when every agent's stream breaks and it registers again) and the
        # report streams open under each registration
        self._registration: dict[str, str] = {}
        self._streams: dict[tuple[str, str], int] = {}
        self.epoch = 0
        """Bumped by every change of who is up or of an agent's record (peers change)."""
        self._peers_cache: dict[str, Peers] = {}
        self._ring: tuple[list[str], dict[str, int]] | None = None
        self.metrics.agents_up.set(len(self._up))
        self.commits = ReportCommitter(store)
        """Group commit of the reports taken by :meth:`report_committed`."""

    # -- reading --------------------------------------------------------------

    @property
    def up(self) -> frozenset[str]:
        """The hosts whose agents are up."""
        return self._up

    def is_up(self, host: str) -> bool:
        return host in self._up

    def agent(self, host: str) -> AgentRecord | None:
        return self._agents.get(host)

    def latest_report(self, host: str) -> AgentReport | None:
        return self._reports.get(host)

    def hosts(self) -> list[str]:
        """Every registered host (up or not), in registration order."""
        return list(self._agents)

    def agent_table(self) -> list[tuple[AgentRecord, bool, AgentReport | None]]:
        return [(a, a.host in self._up, self._reports.get(a.host)) for a in self._agents.values()]

    def drained(self) -> Mapping[str, DrainRecord]:
        return self._drained

    def host_times(self, host: str) -> tuple[int, int]:
        """(since when the host is in its state, when it was last heard of; 0: not since
        the daemon started), wall-clock ms."""
        drain = self._drained.get(host)
        since = drain.since_ms if drain is not None else self._since.get(host, self.started_ms)
        return since, self._heard_ms.get(host, 0)

    # -- agents ---------------------------------------------------------------

    def register(self, agent: AgentRecord, previous: str = "", secret: str = "",
                 certified: bool = False) -> tuple[Peers, str, str]:
        """Register ``agent``: its peers, its new registration and the host secret the
        daemon made for it (empty unless it made one). ``previous`` is the registration
        this agent process was given last (RegisterRequest.registration); ``secret`` the
        host secret it sent; ``certified``: its client certificate names the host
        (tls.agents_by_certificate), which stands for the secret."""
        known = self._agents.get(agent.host)
        bound, made = self._bind(known, agent.host, check_secret(secret), certified)
        if (known is not None and agent.host in self._up
                and _machine(known.probe_address) != _machine(agent.probe_address)):
            # another machine under a name in use (a cloned VM, a mistyped --host): its
            # reports would stand for the first's, and the launches they do not list
            # would count as exited. An agent restarted on the same machine keeps its
            # probe address's host (its port may change); one that moved to another
            # address is taken once the first is down.
            heard = (_now_ms() - self._heard_ms.get(agent.host, _now_ms())) / 1000
            raise FailedPrecondition(
                f"host {agent.host!r} is registered by a live agent with probe address "
                f"{known.probe_address or '(none)'} (heard {heard:.1f} s ago), not "
                f"{agent.probe_address or '(none)'}: give this agent another --host, or stop "
                f"the other (it is down {self.config.heartbeat_timeout_s:g} s after its "
                "last report)")
        current = self._registration.get(agent.host, "")
        if current and previous != current and self._streams.get((agent.host, current)):
            heard = (_now_ms() - self._heard_ms.get(agent.host, 0)) / 1000
            if heard < self.config.heartbeat_timeout_s:
                # a second agent process under the same name on the same machine
                # (another user's, another state directory): both would report the
                # host, take its launch orders and count each other's launches as ended
                raise FailedPrecondition(
                    f"host {agent.host!r} has a connected agent (its report stream is open, "
                    f"heard {heard:.1f} s ago): a second agent under the same name? Stop "
                    "one, or give it another --host; a restarted agent is taken once the "
                    f"old one's stream closes or {self.config.heartbeat_timeout_s:g} s "
                    "after its last report")
        agent = AgentRecord(host=agent.host, probe_address=agent.probe_address,
                            devices=agent.devices, registered_ms=int(time.time() * 1000),
                            launches=agent.launches, secret_hash=bound)
        self.store.put_agent(agent)  # the binding with it: durable before the answer
        # a re-register of the same host, address and devices changes no one's peers
        changed = known is None or replace(known, registered_ms=0, secret_hash="") != replace(
            agent, registered_ms=0, secret_hash="")
        self._agents[agent.host] = agent
        if known is None:
            self._since[agent.host] = _now_ms()
            log.info("agent %s joined: %d device(s) (%s)%s", agent.host, len(agent.devices),
                     ", ".join(sorted({d.kind for d in agent.devices})),
                     f", probe server {agent.probe_address}" if agent.probe_address else "")
        elif changed:
            log.info("agent %s registered again with other devices or probe address "
                     "(%d device(s))", agent.host, len(agent.devices))
        self._seen(agent.host, joined=known is None)
        if changed:
            self._changed()
        self.listener.registered(agent.host)
        registration = self._registration[agent.host] = uuid.uuid4().hex
        return self.peers(agent.host), registration, made

    def _bind(self, known: AgentRecord | None, host: str, secret: str,
              certified: bool) -> tuple[str, str]:
        """(the secret hash the host's record keeps, the secret the daemon made or "").
        A bound name takes only its secret (or a certificate naming it); an unbound
        one (new, forgotten, or known from before bindings existed) is bound to the
        secret sent, or to one made here when none was."""
        bound = known.secret_hash if known is not None else ""
        if certified:
            return bound, ""  # the certificate is the credential; a binding stays as is
        if bound:
            if secret and hmac.compare_digest(secret_hash(secret), bound):
                return bound, ""
            up = "up" if host in self._up else "down"
            _refusals.warn(host, "a Register of host %s (%s) was refused: %s host secret",
                           host[:64], up, "a wrong" if secret else "no")
            raise PermissionDenied(
                f"host {host[:64]!r} is bound to the secret its agent was given at its first "
                f"registration (the host is {up}); this Register carries "
                f"{'another secret' if secret else 'none'}: the cluster token alone does "
                "not take a known host's name. An agent keeps the secret in its state dir "
                f"(host.secret); if that was lost, an operator runs `hetpilot nodes forget "
                f"{host[:64]}` and the next agent to register the name is bound to it")
        if known is not None:
            log.warning("host %s had no secret bound (registered before bindings, or "
                        "forgotten): bound now to this registration's", host)
        made = "" if secret else secrets.token_urlsafe(32)
        return secret_hash(secret or made), made

    def forget(self, host: str) -> AgentRecord:
        """Unbind ``host``'s name from its secret (an operator's act): the next agent to
        register the name is bound to it. The host's record and state stay."""
        agent = self._agents[self._known(host)]
        if agent.secret_hash:
            agent = replace(agent, secret_hash="")
            self.store.put_agent(agent)
            self._agents[host] = agent
            log.warning("host %s forgotten by an operator: the next agent to register it "
                        "is bound to the name", host)
        return agent

    def _seen(self, host: str, joined: bool = False) -> None:
        self._last_seen[host] = self.clock()
        self._heard_ms[host] = _now_ms()
        if host not in self._up:
            self._up = self._up | {host}
            if not joined:  # a new host's join is logged by register
                log.info("agent %s is back up", host)
            self._since[host] = _now_ms()
            self._changed()
            self.listener.host_up(host)

    def _registered(self, host: str, registration: str) -> AgentRecord:
        """The agent record of ``host``, if ``registration`` is its latest."""
        agent = self._agents.get(host)
        if agent is None:
            raise NotFound(f"agent {host!r} is not registered")
        current = self._registration.get(host)
        if registration != current:
            why = ("carries no registration (RegisterResponse.registration)" if not registration
                   else "is under a registration the daemon does not know (it restarted)"
                   if current is None else "is under an older registration: another Register "
                   "of the host came since (a second agent under the same name?)")
            raise FailedPrecondition(f"this message for host {host!r} {why}: register again")
        return agent

    def stream_opened(self, host: str, registration: str) -> None:
        """A report stream began reporting ``host`` under ``registration``."""
        key = (host, registration)
        self._streams[key] = self._streams.get(key, 0) + 1

    def stream_closed(self, host: str, registration: str) -> None:
        key = (host, registration)
        left = self._streams.get(key, 0) - 1
        if left > 0:
            self._streams[key] = left
        else:
            self._streams.pop(key, None)

    def report(self, report: AgentReport, registration: str) -> Peers:
        """Take a report: stored (its own commit), then applied to the tables."""
        self._check_report(report, registration)
        self.store.put_report(report)
        return self._take(report)

    async def report_committed(self, report: AgentReport, registration: str) -> Peers:
        """:meth:`report`, stored by group commit (one transaction for the reports that
        queue up meanwhile, off the event loop): returns once the report is committed,
        so an ack sent after it is as durable as one after :meth:`report`."""
        self._check_report(report, registration)
        await self.commits.put(report)
        self._registered(report.agent_id, registration)  # still (a re-register meanwhile)
        return self._take(report)

    def report_taken(self, report: AgentReport, registration: str) -> Peers:
        """Take a report into the tables without storing it: for a report whose ack can
        wait (AgentReport.ack_later). The store keeps one report per host, so a later
        commit of this host's latest report (:meth:`report_committed`,
        :meth:`commit_latest`) leaves the store as committing each would have; the
        stream does that before an ack covers this report."""
        self._check_report(report, registration)
        return self._take(report)

    async def commit_latest(self, host: str) -> None:
        """Commit ``host``'s latest report taken (reports taken by :meth:`report_taken`
        are not stored on their own)."""
        report = self._reports.get(host)
        if report is not None:
            await self.commits.put(report)

    def _check_report(self, report: AgentReport, registration: str) -> None:
        agent = self._registered(report.agent_id, registration)
        known = {d.index for d in agent.devices}
        for d in report.devices:
            if d.index not in known:
                raise ValidationError("devices.index", f"device {d.index!r} was not registered")

    def _take(self, report: AgentReport) -> Peers:
        self._reports[report.agent_id] = report
        self.listener.reported(report)
        self._seen(report.agent_id)
        self.metrics.reports.inc()
        return self.peers(report.agent_id)

    def heartbeat(self, agent_id: str, registration: str) -> Peers:
        self._registered(agent_id, registration)
        self._seen(agent_id)
        return self.peers(agent_id)

    def _changed(self) -> None:
        self.epoch += 1
        self._peers_cache.clear()
        self._ring = None
        self.metrics.agents_up.set(len(self._up))

    def peers(self, host: str) -> Peers:
        """The next PEERS_PER_AGENT up hosts after ``host`` in host order (a ring, built
        once per membership change: 2000 agents re-registering must not sort 2000 times)."""
        cached = self._peers_cache.get(host)
        if cached is None:
            if self._ring is None:
                ring = sorted(h for h in self._up if self._agents[h].probe_address)
                self._ring = (ring, {h: i for i, h in enumerate(ring)})
            ring, index = self._ring
            i = index.get(host)
            if i is not None:
                others = [ring[(i + k) % len(ring)]
                          for k in range(1, min(len(ring), PEERS_PER_AGENT + 1))]
            else:
                others = ring[:PEERS_PER_AGENT]
            cached = tuple((h, self._agents[h].probe_address) for h in others)
            self._peers_cache[host] = cached
        return cached

    def sweep(self) -> bool:
        """Mark agents silent past the heartbeat timeout down; True when any changed."""
        cutoff = self.clock() - self.config.heartbeat_timeout_s
        up = frozenset(h for h in self._up if self._last_seen.get(h, 0.0) >= cutoff)
        if up != self._up:
            for host in sorted(self._up - up):
                self._since[host] = _now_ms()
                log.info("agent %s left: silent for over %g s (heartbeat timeout); its "
                         "devices leave the next plans", host, self.config.heartbeat_timeout_s)
            self._up = up
            self._changed()
            return True
        return False

    # -- drain ----------------------------------------------------------------

    def _known(self, host: str) -> str:
        if host not in self._agents:
            raise NotFound(f"host {host[:64]!r} is not a registered agent (known: "
                           f"{short_list(sorted(self._agents)) or 'none'})")
        return host

    def drain(self, host: str, reason: str = "") -> DrainRecord:
        """Leave ``host`` out of planning from each job's next slot on (the listener
        wakes the loops whose current plan uses it). Persisted."""
        found = self._drained.get(self._known(host))
        if found is not None:
            return found
        rec = DrainRecord(host=host, since_ms=_now_ms(), reason=reason)
        self.store.put_drain(rec)
        self._drained[host] = rec
        woken = self.listener.host_drained(host)
        log.info("host %s drained%s: jobs plan without it from their next slot (%d job(s) "
                 "use it now)", host, f" ({reason})" if reason else "", woken)
        return rec

    def resume(self, host: str) -> None:
        """Plan on ``host`` again from each job's next slot."""
        if self._drained.get(self._known(host)) is None:
            return
        self.store.delete_drain(host)
        del self._drained[host]
        self._since[host] = _now_ms()
        log.info("host %s resumed: jobs may plan on it again from their next slot", host)
        self.listener.host_resumed(host)
