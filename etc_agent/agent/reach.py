"""The leader's watch for hosts that went silent: every node's liveness port probed a few times a
second, and a node whose port has not answered for ``--peer-timeout`` is unreachable.

A host cut off by the network (a dead switch, a partition: packets dropped, no reset) leaves its
peers' collectives blocked until gloo's timeout, and its etcd lease runs for ``--lease-ttl`` more
seconds. Its liveness port stops answering at once, though, and the answer to a connect comes from
the kernel, not from the agent process: a busy or slow agent still answers, so only the network or
a dead host makes a port silent. The leader then drops the node from the job now (the next
generation carries its address, and the survivors' workers shut their sockets to it, which ends
their blocked collective) and does not admit it again until its port answers; the round whose
probe it answers says so (:attr:`Round.answered_again`), and the leader decides then.

Silence is measured between probes made, never by the clock alone: a prober that was not
scheduled for a while must not take its own pause for the nodes' silence. Only a node whose port
answered once counts (a firewall that drops the port from the start never makes a live node look
unreachable; such a node is left to its lease, and said so once).

Trade-off (docs/cluster.md): the shorter ``--peer-timeout``, the shorter the survivors' stall on a
silent host, and the likelier a congested network that delays connects by that long drops a live
node (it rejoins once its port answers again, at the cost of a switch).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from etc_agent.rendezvous.records import NodeRecord
from etc_agent.utils.liveness import Probe, probe_many

ProbeMany = Callable[[Mapping[str, tuple[str, int]], float], dict[str, Probe]]


def probe_interval(peer_timeout_s: float) -> float:
    """How often the ports are probed (and how long a probe waits): four probes fit in ``peer_timeout_s``."""
    return max(0.05, min(0.25, peer_timeout_s / 4))


@dataclass(frozen=True)
class Round:
    """What one probe round found."""

    never: list[NodeRecord]
    """Nodes whose ports never answered, seen for the first time now (to be said once)."""
    went_silent: bool
    """A node became unreachable since the last round."""
    answered_again: bool
    """A node that was unreachable answers again (a leader admits it at its next decision)."""


class Reachability:
    """When each node's liveness port last answered, and last did not (thread-safe: the prober's
    thread writes, the leader's reads)."""

    def __init__(
        self,
        node_id: str,
        peer_timeout_s: float,
        prober: ProbeMany = probe_many,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.node_id = node_id
        self.peer_timeout_s = peer_timeout_s
        self._probe = prober
        self._clock = clock
        self._lock = threading.Lock()
        self._last_answer: dict[str, float] = {}
        """Node id -> when its port last accepted a connection (only nodes that ever did). A node
        whose record is gone keeps its entry: registered again while still silent (cut from its
        peers, not from etcd), it stays unreachable rather than counting as new."""
        self._last_silent: dict[str, float] = {}
        """Node id -> when a probe of its port last went unanswered."""
        self._first_silent: dict[str, float] = {}
        """Node id -> the first unanswered probe since its last answer."""
        self._silent_from_start: set[str] = set()
        self._silent: set[str] = set()
        """The nodes unreachable after the last round."""

    def round(self, records: Iterable[NodeRecord]) -> Round:
        """Probe every other node's port once."""
        records = [r for r in records if r.node_id != self.node_id and r.probe_port is not None]
        if not records:
            return Round([], False, False)
        targets = {r.node_id: (r.host, r.probe_port) for r in records if r.probe_port is not None}
        # Unreachable before this round's answers: a node cut off, whose record went with its lease
        # and came back, is unreachable from its old silence until its first probe here.
        before = set(self.unreachable(targets))
        results = self._probe(targets, probe_interval(self.peer_timeout_s))
        now = self._clock()
        with self._lock:
            never = [r for r in records if self._record(r.node_id, results.get(r.node_id, "unknown"), now)]
        silent = set(self.unreachable(targets))
        with self._lock:
            went_silent = bool(silent - self._silent)
            self._silent = silent
        return Round(never, went_silent, answered_again=bool(before - silent))

    def _record(self, node_id: str, result: Probe, now: float) -> bool:
        """One probe's answer; True for a node seen never to answer, the first time."""
        if result == "alive":
            self._last_answer[node_id] = now
            self._first_silent.pop(node_id, None)
            self._silent_from_start.discard(node_id)
        elif node_id in self._last_answer:
            self._last_silent[node_id] = now
            self._first_silent.setdefault(node_id, now)
        elif node_id not in self._silent_from_start:
            self._silent_from_start.add(node_id)
            return True
        return False

    def unreachable(self, among: Iterable[str]) -> list[str]:
        """The nodes of ``among`` whose port answered once and has not for ``--peer-timeout`` (sorted)."""
        return sorted(n for n in set(among) if self.silent_for(n) > self.peer_timeout_s)

    def silent_for(self, node_id: str) -> float:
        """Seconds of observed silence of ``node_id``'s port: from its last answer to the last probe
        it left unanswered, or, where the probes paused between that answer and the first unanswered
        one, from that first unanswered probe (the pause is the prober's, not the node's). 0 when it
        answered the last probe, or never answered any."""
        with self._lock:
            answered, silent = self._last_answer.get(node_id), self._last_silent.get(node_id)
            first = self._first_silent.get(node_id)
        if answered is None or silent is None or first is None or silent <= answered:
            return 0.0
        observed_from = answered if first - answered <= 3 * probe_interval(self.peer_timeout_s) else first
        return silent - observed_from


class Prober:
    """The probe rounds of one leadership, in a thread of their own: a decision (or its quiet period)
    never delays a probe, and a slow probe never delays a decision. ``records()`` gives the nodes
    to probe; ``on_change(round)`` is called after a round in which a node went silent or answered
    again after it was unreachable; ``on_never(record)`` once per node whose port never answered."""

    def __init__(
        self,
        reach: Reachability,
        records: Callable[[], Iterable[NodeRecord]],
        on_change: Callable[[Round], None],
        on_never: Callable[[NodeRecord], None],
    ):
        self.reach = reach
        self._records, self._on_change, self._on_never = records, on_change, on_never
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etc-prober", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = probe_interval(self.reach.peer_timeout_s)
        while not self._stop.is_set():
            started = time.monotonic()
            found = self.reach.round(self._records())
            for record in found.never:
                self._on_never(record)
            if found.went_silent or found.answered_again:
                self._on_change(found)
            self._stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
