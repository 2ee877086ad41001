"""A planned departure's outcome and the exit code it gives the departing agent (pure).

A departing agent (SIGTERM or SIGINT, whichever agent it is) marks its node record ``leaving``,
waits for the leader to publish the generation without it, and only then stops its workers
(:meth:`etc_agent.agent.agent.Agent._depart`): the survivors' restart is a membership change, never
a failure. What it saw on the way is a :class:`DepartureOutcome`; :func:`departure_verdict` turns
that into the agent's exit code, so a scheduler never records a job that this departure ended as
a success, nor a job that goes on as a failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from etc_agent.rendezvous.records import GenerationRecord

UNFINISHED_EXIT = 1
"""torchrun's agent exits 1 when a signal ends it (its ``SignalException`` is not caught)."""

AfterAck = Literal["went_on", "failed", "unknown"]
"""What followed the acknowledging generation: its members run in it (or a later generation runs or
succeeded), a later generation failed, or neither was seen within the bound."""


@dataclass(frozen=True)
class DepartureOutcome:
    """What a departing agent saw, in plain data."""

    finished: bool
    """The job finished (its marker, or a succeeded generation) before or during the departure."""
    had_workers: bool
    """This node was a member with running workers when it started leaving (it waited for the leader)."""
    acknowledged: GenerationRecord | None
    """The first generation without this node, published while it waited (None: none came)."""
    others_registered: bool
    """Another node that is not leaving was registered at the end (True when the store could not tell)."""
    after_ack: AfterAck = "unknown"
    """Only for a running acknowledging generation: what followed it."""


@dataclass(frozen=True)
class DepartureVerdict:
    exit_code: int
    reason: str
    """Why, in words (the departing agent's last event says it)."""


def departure_verdict(outcome: DepartureOutcome) -> DepartureVerdict:
    """0 when the job finished or goes on without this node; :data:`UNFINISHED_EXIT` when this
    departure left it unfinished: no other node carries it, fewer than ``--nnodes`` MIN remain, the
    job then failed, or the leader never acknowledged the departure (the others' workers then saw a
    peer vanish, a failure)."""
    ack = outcome.acknowledged
    if outcome.finished or (ack is not None and ack.status == "succeeded"):
        return DepartureVerdict(0, "the job finished")
    if outcome.had_workers and ack is None:
        if not outcome.others_registered:
            return DepartureVerdict(UNFINISHED_EXIT, "no other node carries the job on and it did not finish")
        return DepartureVerdict(
            UNFINISHED_EXIT, "no generation without this node was published in time: the others saw its workers vanish"
        )
    if ack is None:
        if outcome.others_registered:
            return DepartureVerdict(0, "other nodes carry the job on")
        return DepartureVerdict(UNFINISHED_EXIT, "no other node carries the job on and it did not finish")
    if ack.status == "waiting":
        return DepartureVerdict(
            UNFINISHED_EXIT, f"the job waits for --nnodes MIN with {len(ack.members)} node(s) left ({ack.reason})"
        )
    if ack.status == "failed":
        return DepartureVerdict(UNFINISHED_EXIT, f"the job failed: {ack.reason}")
    if outcome.after_ack == "failed":
        return DepartureVerdict(UNFINISHED_EXIT, "the job failed after this node left")
    if outcome.after_ack == "unknown" and not outcome.others_registered:
        return DepartureVerdict(UNFINISHED_EXIT, "no other node carries the job on and it did not finish")
    return DepartureVerdict(0, f"generation {ack.number} goes on with {len(ack.members)} node(s)")


def after_acknowledgement(
    ack: GenerationRecord, latest: GenerationRecord | None, reported: Mapping[str, str]
) -> AfterAck | None:
    """What followed a running acknowledging generation ``ack``, from the newest generation record
    and the states its members reported in ``ack`` (node id -> state); None: not known yet."""
    if latest is not None and latest.number > ack.number:
        return "failed" if latest.status == "failed" else "went_on"
    if ack.members and all(reported.get(n) in ("running", "succeeded") for n in ack.members):
        return "went_on"
    return None
