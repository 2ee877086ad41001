"""The next generation's migration plan, made while the old one still trains.

The plan depends only on every process's description (device, ranks, shard boxes:
:func:`~etc_agent.migrate.exchange.description`) and on the new layout. Once a process knows both
its old state and its new one (its state built ahead, or none: a sender), it publishes its
description on the generation's store (``gen<N>/ahead/<transport rank>``), reads everyone's and
plans (:func:`~etc_agent.migrate.exchange.plan_ahead`). Inside the stall the executor gathers the
descriptions with each process's vote for that plan and skips planning and the hash check when all
agree (:func:`~etc_agent.migrate.executor.migrate_state`); otherwise it plans as before, so a plan
ahead is only ever a head start.

Call sequence: a :class:`~etc_agent.worker.prepare.Preparation`'s thread calls
:meth:`JobPreparer.plan_ahead` after the member's groups and state (it waits for the others'
descriptions at most :data:`AHEAD_WAIT_S`, until the switch takes the preparation); a process that
enters the generation without a preparation calls it in its switch after
:func:`~etc_agent.worker.entry.form`: one that brings no state (a joiner, a spare: the others may
still train) publishes and waits at most :data:`SWITCH_WAIT_S`; one that brings state is inside
the stall already and publishes ``null``, as does a preparation the switch already waits for (a
failure's, which runs inside the stall): a plan made then would save nothing and describing would
cost the stall (:func:`publish_null`). Every process of the migration publishes exactly once,
possibly ``null``, so nobody waits for one that never will. A plan is made only for a migration
every old rank of which some process holds live (a planned change); after a failure the executor
must plan around lost ranks, and nothing is planned ahead.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from etc_agent.layout.devices import Device
from etc_agent.migrate.describe import describe_state
from etc_agent.migrate.exchange import PlanAhead, PlanInputs, description, plan_ahead
from etc_agent.protocol.control import Assignment
from etc_agent.worker.member import Member, prepare_member
from etc_agent.worker.migration import pipeline_stages
from etc_agent.worker.switch_view import JobView

AHEAD_WAIT_S = 5.0
"""How long a preparation waits for the other processes' descriptions before it gives the plan up:
it waits while its rank trains (the others train on while it prepares, and its wait ends as soon
as the switch takes it), for the members that still build their state ahead."""
SWITCH_WAIT_S = 1.0
"""The same for a process that brings no state, in its switch (a joiner: the others still train or
prepare then): only as long as their builds may take, since a process that fails after it formed
the migration group would have it wait this long before the switch finds the failure."""
POLL_S = 0.005
AHEAD_MAX_STORE_BYTES = 256 << 20
"""What every process reading everyone's description may cost the generation's store at most
(processes squared times this process's description): the store is one server, while the gather
inside the stall spreads the same bytes over the migration group; past it, nothing is planned ahead."""


def _key(generation: int, pg_rank: int) -> str:
    return f"gen{generation}/ahead/{pg_rank}"


@dataclass(frozen=True)
class OldState:
    """The state a process brings from the generation it leaves."""

    tensors: dict
    rank: int
    world_size: int


class JobPreparer:
    """What a preparation does for this job besides arriving: the member's groups and state
    (:func:`~etc_agent.worker.member.prepare_member`) and the plan ahead."""

    def __init__(self, view: JobView):
        self.view = view

    def member(self, store: dist.Store, assignment: Assignment) -> Member | None:
        return prepare_member(self.view, store, assignment)

    def plan_ahead(
        self, store: dist.Store, assignment: Assignment, member: Member | None, newer: Callable[[], bool]
    ) -> PlanAhead | None:
        """In a preparation's thread, after :meth:`member`: :func:`plan_ahead` with the state training."""
        held, ctx = self.view.held_tensors(), self.view.training_ctx()
        old = OldState(held, ctx.rank, ctx.config.world_size) if held is not None and ctx is not None else None
        new_tensors = member.built.tensors if member is not None and member.built is not None else None
        return plan_ahead_on(self.view, store, assignment, old, new_tensors, newer, AHEAD_WAIT_S)


def plan_ahead_on(
    view: JobView,
    store: dist.Store,
    assignment: Assignment,
    old: OldState | None,
    new_tensors: dict | None,
    newer: Callable[[], bool],
    wait_s: float,
) -> PlanAhead | None:
    """Publish this process's description (``new_tensors``: its new state; None for a member means
    not built yet) and plan from everyone's; None when some process could not describe itself, not
    all did within ``wait_s``, ``newer()`` turned true, or some old rank has no live holder."""
    # Already wanted in the stall (a failure's preparation runs inside it): a plan made now saves
    # nothing, and describing would cost the stall; null tells the others at once.
    mine = _publication(assignment, old, new_tensors) if not newer() else None
    encoded = json.dumps(mine)
    if mine is None or assignment.pg_world_size**2 * len(encoded) > AHEAD_MAX_STORE_BYTES:
        publish_null(store, assignment)
        return None
    store.set(_key(assignment.generation, assignment.pg_rank), encoded)
    collected = _collect(store, assignment, wait_s, newer)
    if collected is None or any(p is None for p in collected):
        return None
    published = [p for p in collected if p is not None]
    old_world_sizes = {p["old_world_size"] for p in published if p["old_world_size"] is not None}
    held = {p["description"]["old_rank"] for p in published} - {None}
    if len(old_world_sizes) != 1 or held != set(range(old_world_sizes.pop())):
        return None  # some old rank has no live holder: the executor plans around it in the stall
    config = view.config_for(assignment.parallel, assignment.world_size)
    tp = config.tp if assignment.rank is not None else 1  # as the switch passes it (a sender: 1)
    try:
        inputs = PlanInputs(tp=tp, same_keys=pipeline_stages(config))
        return plan_ahead([p["description"] for p in published], assignment.pg_rank, inputs)
    except Exception:  # noqa: BLE001 - the stall plans again and raises what belongs to the job
        return None


def publish_null(store: dist.Store, assignment: Assignment) -> None:
    """Tell the others at once that this process plans nothing ahead (they stop waiting for it)."""
    store.set(_key(assignment.generation, assignment.pg_rank), "null")


def _publication(assignment: Assignment, old: OldState | None, new_tensors: dict | None) -> dict[str, Any] | None:
    """This process's description and its old world's size; None for a member whose new state is
    not built yet."""
    if assignment.rank is not None and new_tensors is None:
        return None
    try:
        mine = description(
            Device.parse(assignment.device),
            old.rank if old is not None else None,
            assignment.rank,
            describe_state(old.tensors) if old is not None else [],
            describe_state(new_tensors) if new_tensors is not None else [],
        )
    except Exception:  # noqa: BLE001 - only a head start: the stall describes (and raises) again
        return None
    return {"description": mine, "old_world_size": old.world_size if old is not None else None}


def _collect(
    store: dist.Store, assignment: Assignment, wait_s: float, newer: Callable[[], bool]
) -> list[dict[str, Any] | None] | None:
    """Every process's publication (by transport rank), or None when not all came within ``wait_s``."""
    keys = [_key(assignment.generation, r) for r in range(assignment.pg_world_size)]
    deadline = time.monotonic() + wait_s
    while not store.check(keys):
        if time.monotonic() > deadline or newer():
            return None
        time.sleep(POLL_S)
    return [json.loads(store.get(k)) for k in keys]
