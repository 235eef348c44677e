"""For ``bench/controlplane_profile.py --preload``: the daemon commits each agent
report in its own transaction on the event loop, as it did before group commit. The
baseline of the side-by-side runs in RESULTS-controlplane.md (issue 37.9)."""

from hetpilot.daemon.membership import Membership, Peers
from hetpilot.daemon.records import AgentReport


async def _one_commit_each(self: Membership, report: AgentReport, registration: str) -> Peers:
    return self.report(report, registration)


Membership.report_committed = _one_commit_each  # type: ignore[method-assign]
