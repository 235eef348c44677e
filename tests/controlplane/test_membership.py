"""Agent membership across a daemon restart, on a fake clock: the agents the
store knows get restart_grace_s to report again before they count as down."""

from __future__ import annotations

import pytest
from hetpilot.daemon.config import DaemonConfig
from hetpilot.daemon.controlplane import ControlPlane
from hetpilot.daemon.errors import PermissionDenied
from hetpilot.daemon.membership import Membership
from hetpilot.daemon.metrics import Metrics
from hetpilot.daemon.records import AgentRecord, AgentReport
from hetpilot.daemon.store import MemoryStore

from .helpers import host_secret


def _plane(now: list[float], grace: float) -> ControlPlane:
    store = MemoryStore()
    for host in ("a", "b"):
        store.put_agent(AgentRecord(host=host, probe_address="", devices=()))
    config = DaemonConfig(state_dir="/tmp", report_interval_s=0.2, heartbeat_timeout_s=1.0,
                          restart_grace_s=grace)
    return ControlPlane(store, config, clock=lambda: now[0])


def test_known_agents_stay_up_for_the_restart_grace() -> None:
    now = [100.0]
    plane = _plane(now, grace=5.0)
    assert plane.is_up("a") and plane.is_up("b")
    now[0] = 104.5  # past one heartbeat timeout, within the grace: nobody dropped yet
    assert not plane.members.sweep() and plane.is_up("a") and plane.is_up("b")
    plane.members.register(AgentRecord(host="a", probe_address="", devices=()))  # a is back
    now[0] = 105.2  # the grace is over: b, silent since the restart, is down; a is not
    assert plane.members.sweep()
    assert plane.is_up("a") and not plane.is_up("b")
    now[0] = 105.6  # a's own heartbeat timeout (1 s after it came back) rules now
    assert plane.members.sweep() and not plane.is_up("a")


def test_grace_shorter_than_the_heartbeat_timeout_means_one_timeout() -> None:
    now = [0.0]
    plane = _plane(now, grace=0.0)
    now[0] = 0.9
    assert not plane.members.sweep() and plane.is_up("b")
    now[0] = 1.1
    assert plane.members.sweep() and not plane.is_up("a") and not plane.is_up("b")


def test_peers_ring_and_identical_re_registers() -> None:
    now = [0.0]
    plane = _plane(now, grace=5.0)
    for i in range(10):
        plane.members.register(AgentRecord(host=f"h{i}", probe_address=f"h{i}:9", devices=()),
                               secret=host_secret(f"h{i}"))
    assert [h for h, _ in plane.members.peers("h8")] == ["h9", "h0", "h1", "h2"]  # the next 4, wrapped
    assert [h for h, _ in plane.members.peers("a")] == ["h0", "h1", "h2", "h3"]  # no probe address
    epoch = plane.members.epoch
    # an agent reconnecting with the same address and devices changes nobody's peers
    plane.members.register(AgentRecord(host="h3", probe_address="h3:9", devices=()),
                           secret=host_secret("h3"))
    assert plane.members.epoch == epoch
    plane.members.register(AgentRecord(host="h3", probe_address="h3:10", devices=()),
                           secret=host_secret("h3"))
    assert plane.members.epoch == epoch + 1
    assert ("h3", "h3:10") in plane.members.peers("h2")


class _Events:
    """A MembershipListener that writes down what it is told."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def host_up(self, host: str) -> None:
        self.seen.append(("up", host))

    def registered(self, host: str) -> None:
        self.seen.append(("registered", host))

    def reported(self, report: AgentReport) -> None:
        self.seen.append(("reported", report.agent_id))

    def host_drained(self, host: str) -> int:
        self.seen.append(("drained", host))
        return 0

    def host_resumed(self, host: str) -> None:
        self.seen.append(("resumed", host))


def test_membership_tells_its_listener_what_changed() -> None:
    now = [0.0]
    events = _Events()
    members = Membership(MemoryStore(), DaemonConfig(state_dir="/tmp", report_interval_s=0.2,
                                                     heartbeat_timeout_s=1.0),
                         Metrics(), events, clock=lambda: now[0])
    a = AgentRecord(host="a", probe_address="", devices=())
    _, registration, _ = members.register(a, secret=host_secret("a"))
    members.register(a, registration, secret=host_secret("a"))
    members.report(AgentReport(agent_id="a", seq=1, unix_ms=0),
                   members.register(a, secret=host_secret("a"))[1])
    members.drain("a", "fan")
    members.drain("a", "again")  # already drained: nothing new
    members.resume("a")
    members.resume("a")  # not drained: nothing new
    now[0] = 5.0
    assert members.sweep() and not members.is_up("a")
    members.heartbeat("a", members.register(a, secret=host_secret("a"))[1])
    assert events.seen == [("up", "a"), ("registered", "a"), ("registered", "a"),
                           ("registered", "a"), ("reported", "a"), ("drained", "a"),
                           ("resumed", "a"), ("up", "a"), ("registered", "a")]


def test_a_host_known_from_before_bindings_is_bound_at_its_next_register() -> None:
    """Upgrading: a host in the store without a binding is bound by its next Register
    (with the secret it sends), and from then on needs that secret, across a restart."""
    store = MemoryStore()
    store.put_agent(AgentRecord(host="old", probe_address="", devices=()))
    config = DaemonConfig(state_dir="/tmp", report_interval_s=0.2, heartbeat_timeout_s=1.0)
    members = Membership(store, config, Metrics(), _Events())
    old = AgentRecord(host="old", probe_address="", devices=())
    assert members.register(old, secret=host_secret("old"))[2] == ""  # bound as sent
    members = Membership(store, config, Metrics(), _Events())  # a daemon restart
    with pytest.raises(PermissionDenied, match="bound"):
        members.register(old)
    with pytest.raises(PermissionDenied, match="another secret"):
        members.register(old, secret=host_secret("new"))
    members.register(old, secret=host_secret("old"))
    # forgotten: the next Register binds the name again, here to a secret the daemon makes
    members.forget("old")
    made = members.register(old)[2]
    assert made and members.register(old, secret=made)[2] == ""
    with pytest.raises(PermissionDenied):
        members.register(old, secret=host_secret("old"))
