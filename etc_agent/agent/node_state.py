"""One node's state, in one place: its phase in the generation it serves, whether the leader may
place it, and whether it is leaving. Every "may this node do X now?" asks :class:`NodeState`, and
every change goes through :class:`NodeStateMachine`, which checks it against the tables below.

A node's state has three parts, each with its own table.

**Phase** (the generation protocol's, :data:`etc_agent.protocol.phases.TRANSITIONS`): running,
pending, migrating, recovering, departing, spare, finished, failed. Leaving ``running`` for anything
but a recovery, a departure or the end goes through ``pending`` (a newer generation was seen);
``finished`` and ``failed`` are final: a later record only confirms them.

**Readiness** (what the node record's ``ready``, ``restarting`` and ``crashed_in`` say):

=========== =============================================================== =====================
readiness   meaning                                                         goes to
=========== =============================================================== =====================
ready       the leader may place this node                                  warming, restarting
warming     joining a running elastic job: its workers start before it      ready
            registers as ready, so the running ranks do not wait for them
restarting  crashed local ranks restart as standby processes; the node is   ready, restarting
            out of the membership until each of them said hello             (more ranks crashed)
=========== =============================================================== =====================

**Lifecycle** (signals and the end of the agent's run):

=========== =============================================================== =====================
lifecycle   meaning                                                         goes to
=========== =============================================================== =====================
serving     in the job, or waiting to be                                    leaving
leaving     a planned departure (the first SIGTERM/SIGINT): announced in    stopping
            the node record; the workers stop once the leader published
            the generation without this node
stopping    a second signal: stop everything now (a store host too)         (final)
=========== =============================================================== =====================

Apart from these, ``closed`` is set once the agent's run ends (from any lifecycle): its threads stop.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import signal
import threading
from dataclasses import dataclass

from etc_agent.protocol.phases import TRANSITIONS, Phase

log = logging.getLogger("etc_agent.agent")


class Readiness(str, enum.Enum):
    READY = "ready"
    WARMING = "warming"
    RESTARTING = "restarting"


class Lifecycle(str, enum.Enum):
    SERVING = "serving"
    LEAVING = "leaving"
    STOPPING = "stopping"


READINESS_TRANSITIONS: dict[Readiness, frozenset[Readiness]] = {
    Readiness.READY: frozenset({Readiness.WARMING, Readiness.RESTARTING}),
    Readiness.WARMING: frozenset({Readiness.READY}),
    Readiness.RESTARTING: frozenset({Readiness.READY, Readiness.RESTARTING}),
}
LIFECYCLE_TRANSITIONS: dict[Lifecycle, frozenset[Lifecycle]] = {
    Lifecycle.SERVING: frozenset({Lifecycle.LEAVING}),
    Lifecycle.LEAVING: frozenset({Lifecycle.STOPPING}),
    Lifecycle.STOPPING: frozenset(),
}
_ANY_TIME = frozenset({Phase.RUNNING, Phase.RECOVERING, Phase.DEPARTING, Phase.FINISHED, Phase.FAILED})
"""Phases a running node goes to directly; any other goes through PENDING first."""


@dataclass(frozen=True)
class NodeState:
    """A snapshot of one node's state (see the module's tables)."""

    phase: Phase = Phase.SPARE
    generation: int | None = None
    """The generation the phase is in."""
    readiness: Readiness = Readiness.READY
    restarting: frozenset[int] = frozenset()
    """Local ranks restarted after a crash whose new process has not said hello yet."""
    crashed_in: int | None = None
    """The generation of the latest crash restart (in the node record while restarting)."""
    lifecycle: Lifecycle = Lifecycle.SERVING
    cause: signal.Signals | None = None
    """The first signal that asked this node to leave (reported when that ends an unfinished job)."""
    asked_to_leave: bool = False
    """The departure began with the workers' launcher's request (sidecar mode; no signal of the
    agent's own): the agent's first signal after it is still a first one, not a "stop now"."""
    closed: bool = False
    """The agent's run ended: its threads stop."""

    @property
    def ready(self) -> bool:
        """Whether the leader may place this node (the node record's ``ready``)."""
        return self.readiness == Readiness.READY

    @property
    def leaving(self) -> bool:
        return self.lifecycle != Lifecycle.SERVING

    @property
    def stopping_now(self) -> bool:
        """A second signal came: nothing waits any more."""
        return self.lifecycle == Lifecycle.STOPPING

    @property
    def stop_requested(self) -> bool:
        """The agent's threads (keepalive, election) end."""
        return self.closed or self.stopping_now

    @property
    def done(self) -> bool:
        """The node's workers are done for good (the job finished or failed)."""
        return self.phase in (Phase.FINISHED, Phase.FAILED)


class NodeStateMachine:
    """The current :class:`NodeState` of one node; the only place it changes.

    Threads that wait on the state (the keepalive and election loops, etcrun's store host) wait on
    the events :attr:`leaving_event`, :attr:`stop_event` and :attr:`hard_stop_event`, which mirror
    it. Transitions come from the main loop, control-channel threads and the signal handler (which
    runs in the main thread between two bytecodes, hence the reentrant lock)."""

    def __init__(self, who: str):
        self.who = who
        self._state = NodeState()
        self._lock = threading.RLock()
        self.leaving_event = threading.Event()
        self.stop_event = threading.Event()
        self.hard_stop_event = threading.Event()

    @property
    def state(self) -> NodeState:
        return self._state

    def _set(self, new: NodeState) -> NodeState:
        old = self._state
        assert new.phase == old.phase or new.phase in TRANSITIONS[old.phase], (
            f"{self.who}: no transition {old.phase.value} -> {new.phase.value} in the protocol"
        )
        assert new.readiness == old.readiness or new.readiness in READINESS_TRANSITIONS[old.readiness], (
            f"{self.who}: no transition {old.readiness.value} -> {new.readiness.value}"
        )
        assert new.lifecycle == old.lifecycle or new.lifecycle in LIFECYCLE_TRANSITIONS[old.lifecycle], (
            f"{self.who}: no transition {old.lifecycle.value} -> {new.lifecycle.value}"
        )
        assert old.closed <= new.closed, f"{self.who}: a closed node does not reopen"
        if (new.phase, new.generation) != (old.phase, old.generation):
            log.debug("%s: %s -> %s (generation %s)", self.who, old.phase.value, new.phase.value, new.generation)
        self._state = new
        if new.leaving:
            self.leaving_event.set()
        if new.stopping_now:
            self.hard_stop_event.set()
        if new.stop_requested:
            self.stop_event.set()
        return new

    def move(self, phase: Phase, generation: int | None) -> None:
        """This node's phase for ``generation``; from ``running`` through ``pending`` where the
        protocol has it; a final phase stays (the store's final record only confirms it)."""
        with self._lock:
            state = self._state
            if state.done:
                return
            if state.phase == Phase.RUNNING and phase not in _ANY_TIME:
                state = self._set(dataclasses.replace(state, phase=Phase.PENDING, generation=generation))
            self._set(dataclasses.replace(state, phase=phase, generation=generation))

    def warming(self) -> None:
        with self._lock:
            self._set(dataclasses.replace(self._state, readiness=Readiness.WARMING))

    def warmed(self) -> None:
        """The warm start is over (its workers said hello, or it gave up): the node may be placed."""
        with self._lock:
            if self._state.readiness == Readiness.WARMING:
                self._set(dataclasses.replace(self._state, readiness=Readiness.READY))

    def restarting(self, local_ranks: set[int], generation: int) -> None:
        """``local_ranks`` crashed in ``generation`` and restart: out of the membership until they run."""
        with self._lock:
            state = self._state
            self._set(
                dataclasses.replace(
                    state,
                    readiness=Readiness.RESTARTING,
                    restarting=state.restarting | frozenset(local_ranks),
                    crashed_in=generation,
                )
            )

    def rejoined(self) -> NodeState:
        """The state with every restarted rank back (the caller publishes it, then :meth:`commit`s it)."""
        return dataclasses.replace(self._state, readiness=Readiness.READY, restarting=frozenset(), crashed_in=None)

    def commit(self, new: NodeState) -> None:
        with self._lock:
            self._set(new)

    def leave(self, cause: signal.Signals | None = None, asked: bool = False) -> bool:
        """A planned departure; a second request (a second signal) stops everything now. ``asked``:
        the workers' launcher asked (:class:`~etc_agent.protocol.control.Leave`), which never
        escalates, and after which the agent's own first signal is still a first one: a pod's
        termination signals the agent's and the workers' containers together, in either order.
        Returns whether this started the departure."""
        with self._lock:
            state = self._state
            if state.lifecycle == Lifecycle.SERVING:
                self._set(dataclasses.replace(state, lifecycle=Lifecycle.LEAVING, cause=cause, asked_to_leave=asked))
                return True
            if cause is None:
                return False
            if state.lifecycle == Lifecycle.LEAVING and state.asked_to_leave and state.cause is None:
                self._set(dataclasses.replace(state, cause=cause))
                return False
            self._set(dataclasses.replace(state, lifecycle=Lifecycle.STOPPING, cause=state.cause or cause))
            return False

    def close(self) -> None:
        with self._lock:
            self._set(dataclasses.replace(self._state, closed=True))
