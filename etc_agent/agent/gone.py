"""The leader's check for member agents that are gone, by their liveness ports.

A node whose agent was SIGKILLed (its workers die with it) stays registered until its lease
expires, ``--lease-ttl`` seconds, and the survivors wait for it. When the survivors' workers report
a failed collective (``generations/<n>/peer_failed/<node>``), a failed status or an abandoned
generation, the leader connects to every member's liveness port
(:mod:`etc_agent.utils.liveness`): a member whose port refused the connection is gone and its node
record is deleted at once, so the next generation goes on without it.

A refusal counts only from a node whose port accepted a connection before (the leader probes each
node once when it first sees it): a firewall that rejects the port from the start never makes a
live node look gone, and such nodes are left to their leases as before.

The leader itself may be the agent that died: every other agent learns the leader's port the same
way, and when its own workers report a failed collective it probes the leader; a gone leader's
key is taken over with compare-and-set (one agent wins), and the new leader goes on as above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from etc_agent.rendezvous.records import NodeRecord
from etc_agent.utils.liveness import Probe, probe

PROBE_TIMEOUT_S = 0.5
"""A probe that has no answer within this says nothing (a host gone altogether: the lease decides)."""


class GoneAgents:
    """Which member agents are gone (one per leader; not thread-safe: the leader's thread only)."""

    def __init__(self, node_id: str, prober: Callable[[str, int, float], Probe] = probe):
        self.node_id = node_id
        self._probe = prober
        self._reachable: set[str] = set()
        """Nodes whose port accepted a connection: only their refusals count."""
        self._seen: set[str] = set()
        self._checked: tuple[int, int] | None = None
        """(generation, evidence count) of the last check: each new piece of evidence checks again."""

    def learn(self, records: Iterable[NodeRecord]) -> None:
        """Probe each node seen for the first time (once), to know whose refusals to trust later."""
        for record in records:
            if record.node_id in self._seen or record.node_id == self.node_id or record.probe_port is None:
                continue
            self._seen.add(record.node_id)
            if self._probe(record.host, record.probe_port, PROBE_TIMEOUT_S) == "alive":
                self._reachable.add(record.node_id)

    def knows(self, node_id: str) -> bool:
        """Whether that node was probed once already."""
        return node_id in self._seen

    def is_gone(self, record: NodeRecord) -> bool:
        """One node, now (an agent that is not the leader asks this of the leader)."""
        return (
            record.node_id in self._reachable
            and record.probe_port is not None
            and self._probe(record.host, record.probe_port, PROBE_TIMEOUT_S) == "gone"
        )

    def check(self, generation: int, evidence: int, members: list[str], records: Iterable[NodeRecord]) -> list[str]:
        """The members of ``generation`` that are gone, given ``evidence`` reports of a failure in it
        (none: nothing to check; the same count as last time: checked already)."""
        if evidence == 0 or self._checked == (generation, evidence):
            return []
        self._checked = (generation, evidence)
        by_id = {r.node_id: r for r in records}
        gone = []
        for node_id in members:
            record = by_id.get(node_id)
            if node_id == self.node_id or record is None or record.probe_port is None:
                continue
            if node_id in self._reachable and self._probe(record.host, record.probe_port, PROBE_TIMEOUT_S) == "gone":
                gone.append(node_id)
        return gone
