"""The generation protocol's shared vocabulary: a node's phases in a generation, its role, exit codes.

Agent and worker both follow one state table (``docs/protocol.md``); :class:`PhaseTracker` holds
the current phase of one side and refuses a transition the table does not have, so that a path
that is not in the protocol fails where it starts instead of somewhere later.

=========== ====================================================================================
phase       meaning
=========== ====================================================================================
running     training in generation g
pending     a newer generation g' is published; the ranks agree at the next step boundary
migrating   leaving g for g': arrive, form groups, build, exchange versions, migrate, carry state
recovering  a peer failed (mid-step or mid-switch): groups torn down, waiting for the next generation
departing   this node is not in g' but sends its shards there, then its workers exit
spare       not a member: warm workers waiting, or none
finished    the last step is done (the job succeeded)
failed      the job cannot go on (state lost, a fatal error, restarts used up)
=========== ====================================================================================
"""

from __future__ import annotations

import enum
import logging
from typing import Literal

log = logging.getLogger("etc_agent.protocol")

RESTART_EXIT = 75
"""A worker's exit code after it saved its state for a checkpoint-based switch (EX_TEMPFAIL)."""

Role = Literal["member", "sender", "spare", "joiner"]
"""A node's part in a generation: a member trains (a joiner is a member whose workers hold no state
yet); a sender only sends what it holds, then its workers exit; a spare waits."""


class Phase(str, enum.Enum):
    RUNNING = "running"
    PENDING = "pending"
    MIGRATING = "migrating"
    RECOVERING = "recovering"
    DEPARTING = "departing"
    SPARE = "spare"
    FINISHED = "finished"
    FAILED = "failed"


_LIVE = frozenset(
    {Phase.PENDING, Phase.MIGRATING, Phase.RECOVERING, Phase.DEPARTING, Phase.SPARE, Phase.FINISHED, Phase.FAILED}
)

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.SPARE: frozenset({Phase.MIGRATING, Phase.DEPARTING, Phase.FINISHED, Phase.FAILED}),
    Phase.RUNNING: frozenset({Phase.PENDING, Phase.RECOVERING, Phase.DEPARTING, Phase.FINISHED, Phase.FAILED}),
    Phase.PENDING: _LIVE - {Phase.PENDING},
    Phase.MIGRATING: _LIVE - {Phase.PENDING} | {Phase.RUNNING},
    Phase.RECOVERING: _LIVE - {Phase.PENDING, Phase.RECOVERING},
    Phase.DEPARTING: frozenset({Phase.SPARE, Phase.MIGRATING, Phase.FINISHED, Phase.FAILED}),
    Phase.FINISHED: frozenset(),
    Phase.FAILED: frozenset(),
}
"""Phase -> the other phases it may go to (``docs/protocol.md`` explains each edge); staying in a
phase (a newer generation, same phase) is always allowed. PENDING -> SPARE: the new generation
leaves this node out; MIGRATING -> DEPARTING: a sender's state is on its way; DEPARTING -> SPARE: a
member the layout left out sent its state and its node waits; DEPARTING -> MIGRATING: such a
node is taken back into the next layout; -> FINISHED from a switch or a
recovery: the job ended before this process got in."""


class PhaseTracker:
    """One side's current phase and generation; every change goes through :meth:`to`."""

    def __init__(self, who: str, phase: Phase = Phase.SPARE):
        self.who = who
        self.phase = phase
        self.generation: int | None = None

    def to(self, phase: Phase, generation: int | None = None) -> None:
        assert phase == self.phase or phase in TRANSITIONS[self.phase], (
            f"{self.who}: no transition {self.phase.value} -> {phase.value} in the protocol"
        )
        if phase != self.phase or generation != self.generation:
            log.debug("%s: %s -> %s (generation %s)", self.who, self.phase.value, phase.value, generation)
        self.phase = phase
        if generation is not None:
            self.generation = generation
