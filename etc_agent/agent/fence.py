"""An agent cut off from the store fences itself before its lease can expire; a store outage that
every node shares is ridden through.

The rule (docs/cluster.md's partition table): only the side that reaches the store goes on. An agent
knows only that its own requests fail; what it cannot tell alone is whether the others still reach
the store (then its lease will expire, the leader will publish a generation without it, and its
workers must not train or commit anything after that) or nobody does (quorum lost, every etcd
member down: nobody can publish anything, the collectives prove the members alive, and training
goes on). So, once the store has been silent to it for ``CONFIRM_S`` and its lease was last
confirmed :func:`fence_after` seconds ago, the agent asks its peers' liveness ports
(:mod:`etc_agent.utils.liveness`, which answer with one status line):

- a peer that is not in an outage and heard the store within the last ``REACH_WINDOW_S`` seconds,
  or that serves a newer generation: this node is the one cut off; it **fences**;
- no peer answers (this host is cut off from them too), or the job has no other member: it fences;
- every peer that answers is in the outage too: a **shared outage**; the workers train on and their
  checkpoints wait for the store before they are committed (:mod:`etc_agent.agent.commits`).

Fenced, a node's workers stop training: worker-API processes hold at their next step boundary
(:class:`~etc_agent.protocol.control.AssignmentReply` ``fenced``), a plain script's processes are
frozen (SIGSTOP; they cannot pause by themselves, and killing them would fail their peers'
collectives as a crash). The fence lifts when the store answers again; the node then acts on what
the store says (the same generation: the workers go on; a newer one without it: it rejoins).

:func:`fence_verdict` is the pure decision; :class:`~etc_agent.agent.contact.StoreContact` says
how long the store has been silent; :class:`Fence` asks the peers and says what changed, once per change.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from etc_agent.agent.contact import StoreContact
from etc_agent.utils.liveness import ask_many

REACH_WINDOW_S = 2.0
"""A peer not in an outage whose last store answer is younger than this reaches the store (a
healthy agent hears it at least every second: its main loop's read of the generation,
:data:`~etc_agent.agent.genwatch.REFRESH_S`)."""

CONFIRM_S = 0.5
"""How long the store must have been known silent before the peers are asked: every agent learns of
an outage within about the same time (a request that fails, or waits ``SLOW_S``), so by then the
peers in the same outage know it too and do not vouch for a store that no longer answers."""

MAX_PEERS_ASKED = 8
"""Peers asked at once (the first members in order): enough to tell a node cut off
from a shared outage, few enough that a large job's outage does not flood every port."""

CHECK_INTERVAL_S = 0.25
"""How often the fence looks at the store's silence (a fraction of ``CONFIRM_S``; at hundreds of
agents on a host, each thread's wakes are its share of the host's cores)."""

ASK_INTERVAL_S = 0.5
"""How often the peers are asked again while the store stays silent."""

OUTAGE_END_GRACE_S = 1.0
"""After a shared outage, how long peers may hear the store before this node does without it fencing
(etcd renews every lease when a leader is elected, so this node's lease lives that long and more)."""

RELAPSE_WINDOW_S = 2.0
"""A silence that starts this soon after a shared outage ended is that outage's tail (the store's
first answers after a new leader may be followed by failed requests and reconnects, seen for a
second on two loaded cores): it gets the same grace before this node fences. The election renewed
this node's lease, so ``fence_after`` + this window + the grace stays inside a lease."""

FenceState = Literal["clear", "shared_outage", "fenced"]


def fence_after(lease_ttl_s: float) -> float:
    """The lease's age (since the keepalive that last confirmed it was sent) after which a node in
    an outage asks its peers: 60% of the lease, so that a fenced node's workers reach their step
    boundary before the lease can expire."""
    return 0.6 * lease_ttl_s


@dataclass(frozen=True)
class PeerView:
    """What one peer's liveness port said."""

    node_id: str
    heard_s: float
    """Seconds since that peer's store last answered it."""
    silent: bool
    """That peer's store is silent to it now (an outage it sees too)."""
    generation: int | None
    """The generation that peer serves."""

    @property
    def reaches_store(self) -> bool:
        return not self.silent and self.heard_s < REACH_WINDOW_S

    def to_line(self) -> bytes:
        fields = {"node": self.node_id, "heard": self.heard_s, "silent": self.silent, "gen": self.generation}
        return (json.dumps(fields) + "\n").encode()

    @classmethod
    def from_line(cls, line: bytes) -> PeerView | None:
        try:
            data = json.loads(line)
            generation = data["gen"]
            return cls(
                str(data["node"]),
                float(data["heard"]),
                bool(data["silent"]),
                None if generation is None else int(generation),
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class FenceVerdict:
    state: FenceState
    reason: str


def fence_verdict(silence_s: float, generation: int | None, peers: Mapping[str, PeerView | None]) -> FenceVerdict:
    """Whether a node whose store has been silent for ``silence_s`` (long enough to ask) fences (see
    the module's docstring). ``peers``: the peers asked, by node id, with what each said (None: no
    answer)."""
    reaching = sorted(n for n, v in peers.items() if v is not None and v.reaches_store)
    newer = sorted(
        n
        for n, v in peers.items()
        if v is not None and v.generation is not None and (generation is None or generation < v.generation)
    )
    silent = f"the store has not answered for {silence_s:.1f} s"
    if reaching:
        return FenceVerdict("fenced", f"{silent} while {', '.join(reaching)} reach it")
    if newer:
        return FenceVerdict("fenced", f"{silent} and {', '.join(newer)} serve a newer generation")
    answered = [n for n, v in peers.items() if v is not None]
    if not peers:
        return FenceVerdict("fenced", f"{silent} and no other member can vouch that nobody reaches it")
    if not answered:
        return FenceVerdict("fenced", f"{silent} and no peer answers ({', '.join(sorted(peers))})")
    return FenceVerdict("shared_outage", f"{silent}; every peer asked ({', '.join(sorted(answered))}) lost it too")


Ask = Callable[[Mapping[str, tuple[str, int]], float], dict[str, bytes | None]]


class Fence:
    """This node's fence (see the module's docstring). :meth:`check` runs in the fence's own thread
    (:meth:`watch`); it returns the state and, when it changed, says so once."""

    def __init__(
        self,
        node_id: str,
        lease_ttl_s: float,
        contact: StoreContact,
        emit: Callable[[str, dict], None],
        ask: Ask = ask_many,
    ) -> None:
        self.node_id = node_id
        self.after_s = fence_after(lease_ttl_s)
        self.contact = contact
        self._emit = emit
        self._ask = ask
        self.state: FenceState = "clear"
        self._since: float | None = None
        self._asked_at = float("-inf")
        self._ending_since: float | None = None
        self._outage_over_at: float | None = None
        """When the last shared outage ended (the store answered again)."""

    @property
    def fenced(self) -> bool:
        return self.state == "fenced"

    def status_line(self, generation: int | None) -> bytes:
        """What this node's liveness port tells a peer that asks."""
        silent = self.contact.silent_since() is not None
        return PeerView(self.node_id, round(self.contact.heard_s(), 3), silent, generation).to_line()

    def check(self, generation: int | None, peers: Sequence[tuple[str, str, int]]) -> FenceState:
        """``peers``: (node id, host, liveness port) of the other members, in member order."""
        since = self.contact.silent_since()
        silence = self.contact.silence_s()
        if since is None:
            self._change("clear", "", silence)
            return self.state
        now = self.contact.now()
        if self.state == "fenced" or now - self._asked_at < ASK_INTERVAL_S:
            return self.state  # fenced stays fenced until the store answers
        if now - since < CONFIRM_S or self.contact.lease_age_s() < self.after_s:
            return self.state
        self._asked_at = now
        asked = {node: (host, port) for node, host, port in peers[:MAX_PEERS_ASKED]}
        answers = self._ask(asked, 0.3) if asked else {}
        views = {node: PeerView.from_line(line) if line else None for node, line in answers.items()}
        verdict = fence_verdict(silence, generation, views)
        relapse = self._outage_over_at is not None and now - self._outage_over_at < RELAPSE_WINDOW_S
        if verdict.state == "fenced" and (self.state == "shared_outage" or relapse):
            # The shared outage is ending and the peers hear the store first: the store's new leader
            # renewed every lease, so this node has a whole lease to hear it too before it fences.
            self._ending_since = now if self._ending_since is None else self._ending_since
            if now - self._ending_since < OUTAGE_END_GRACE_S:
                return self.state
        self._ending_since = None
        self._change(verdict.state, verdict.reason, silence)
        return self.state

    def watch(
        self,
        stop: threading.Event,
        view: Callable[[], tuple[int | None, Sequence[tuple[str, str, int]]]],
        on_change: Callable[[FenceState], None],
    ) -> None:
        """The fence's own thread: every ``CHECK_INTERVAL_S``, :meth:`check` with ``view()`` (the
        generation served and its other members' ports); ``on_change(state)`` when the state changed.
        Not the main loop: its store reads block for their whole deadline while the store is silent."""
        while not stop.wait(CHECK_INTERVAL_S):
            before = self.state
            generation, peers = view()
            if self.check(generation, peers) != before:
                on_change(self.state)

    def _change(self, state: FenceState, reason: str, silence: float) -> None:
        if state == self.state:
            return
        previous, self.state = self.state, state
        if state == "fenced":
            self._since = self.contact.now()
            self._emit("fenced", {"reason": reason, "action": "workers stop training and commit no checkpoint"})
        elif state == "shared_outage":
            self._emit(
                "store_outage_shared",
                {"reason": reason, "action": "training goes on; checkpoints are committed once the store answers"},
            )
        elif previous == "fenced":
            held = self.contact.now() - (self._since or self.contact.now())
            self._emit("unfenced", {"after_s": round(held, 2), "action": "acting on what the store says"})
        else:
            self._outage_over_at = self.contact.now()
            self._emit("store_outage_over", {"silence_s": round(silence, 2)})


__all__ = ["Fence", "FenceVerdict", "PeerView", "fence_after", "fence_verdict"]
