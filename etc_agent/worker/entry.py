"""Entering a generation (steps 2 and 3 of the switch, :mod:`etc_agent.worker.switch`): every process
arrives at the generation's store and forms the migration group, then the members take their
training groups, mesh and state (:mod:`etc_agent.worker.member`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from etc_agent.layout.devices import Device
from etc_agent.migrate.transport import GroupTransport
from etc_agent.protocol.control import Assignment
from etc_agent.worker.connect import gloo_group
from etc_agent.worker.context import ParallelContext
from etc_agent.worker.errors import ArrivalTimeout, JobFinished
from etc_agent.worker.genstore import GenerationStore
from etc_agent.worker.link import AgentLink
from etc_agent.worker.member import Member, ResidentPages, form_member
from etc_agent.worker.report import Clocks
from etc_agent.worker.switch_view import JobView


@dataclass
class Entry:
    """A generation being entered: the assignment, the groups formed, the state built for it."""

    assignment: Assignment
    device: Device
    clocks: Clocks
    transport: GroupTransport
    group: Any
    ctx: ParallelContext | None = None
    new_state: dict | None = None
    new_tensors: dict | None = None
    resident: ResidentPages | None = None
    """The new shards' pages being written in the background (a state built inside the switch)."""

    def wait_resident(self) -> None:
        """Before the data phase: the new shards' pages are resident (counted in the record)."""
        if self.resident is not None:
            self.clocks.touched_ahead += self.resident.wait()
            self.resident = None

    @property
    def new_rank(self) -> int | None:
        return self.assignment.rank


def arrive(job: JobView, assignment: Assignment) -> dist.Store | None:
    """Wait until every process of the generation reached its store (None: a newer generation came)."""
    store = connect_store(assignment, job.timeout_s)
    job.use_store(store)
    mark_arrived(store, assignment)
    return store if wait_for_arrivals(store, assignment, job.timeout_s, job.link) else None


def connect_store(assignment: Assignment, timeout_s: float) -> dist.Store:
    """A client of the generation's store (hosted by its first member's agent)."""
    from torch.distributed import TCPStore

    return TCPStore(
        assignment.store_addr,
        assignment.store_port,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def mark_arrived(store: dist.Store, assignment: Assignment) -> None:
    """Count this process in at the generation's store (once per process and generation)."""
    key = f"gen{assignment.generation}/arrived"
    store.set(f"{key}/{assignment.pg_rank}", "1")
    store.add(key, 1)


def wait_for_arrivals(store: dist.Store, assignment: Assignment, timeout_s: float, link: AgentLink) -> bool:
    """Wait until every process of the generation is counted in; False when a newer generation came first."""
    generation = assignment.generation
    key = f"gen{generation}/arrived"
    deadline = time.monotonic() + timeout_s
    while True:
        count = store.add(key, 0)
        if count >= assignment.pg_world_size:
            return True
        if link.newer_than(generation):
            return False
        if link.finished:
            raise JobFinished()
        if time.monotonic() > deadline:
            missing = [d for r, d in enumerate(assignment.devices) if not store.check([f"{key}/{r}"])]
            raise ArrivalTimeout(
                f"generation {generation}: {count} of {assignment.pg_world_size} processes arrived within "
                f"{timeout_s:.0f} s; missing: {', '.join(missing)}"
            )
        time.sleep(0.01)


def migration_group(
    store: dist.Store, assignment: Assignment, link: AgentLink, timeout_s: float
) -> dist.ProcessGroupGloo:
    """The generation's migration group (every member and sender, by transport rank) on its store."""
    generation = assignment.generation
    # Held here while the group forms: the C++ store calls back into this Python object.
    waits = generation_store(store, generation, link, timeout_s)
    return gloo_group(
        dist.PrefixStore(f"gen{generation}/migrate/", waits),
        assignment.pg_rank,
        assignment.pg_world_size,
        timedelta(seconds=timeout_s),
    )


def generation_store(store: dist.Store, generation: int, link: AgentLink, timeout_s: float) -> GenerationStore:
    """``store`` whose waits end when a newer generation than ``generation`` comes."""
    return GenerationStore(store, generation, lambda: newer_generation(link, generation), timeout_s)


def form(
    job: JobView,
    assignment: Assignment,
    job_store: dist.Store,
    started: float,
    prepared_group: dist.ProcessGroupGloo | None = None,
    prepared_member: Member | None = None,
) -> Entry:
    """Everyone: the migration group (``prepared_group`` when it formed while training); members
    then: the training groups and context, installed as torch's, and the state ``build(ctx)``
    returns (``prepared_member``: those made while training, :mod:`etc_agent.worker.member`).

    The migration group comes first for every process, so that a joiner's, which has no
    preparation, meets the group its peers form in the background before they stop training.
    """
    ctx = new_state = new_tensors = resident = None
    prepared = prepared_group is not None
    arrived = started if prepared else time.perf_counter()
    group = prepared_group if prepared else migration_group(job_store, assignment, job.link, job.timeout_s)
    migration_grouped = grouped = built = time.perf_counter()
    if assignment.rank is not None:
        member = prepared_member
        if member is None:
            store = generation_store(job_store, assignment.generation, job.link, job.timeout_s)
            member = form_member(job, store, assignment)
        member.install(timedelta(seconds=job.timeout_s))
        ctx = member.ctx
        grouped = time.perf_counter()
        state = member.take_state(job)
        new_state, new_tensors = state.state, state.tensors
        built = time.perf_counter()
        if member.built is None and ctx.restoring:  # built just now, to be migrated into
            resident = ResidentPages(new_tensors, job.held_tensors(), job.timeout_s)
    return Entry(
        assignment=assignment,
        device=Device.parse(assignment.device),
        clocks=Clocks(
            started,
            grouped,
            built,
            arrived=arrived,
            migration_grouped=migration_grouped,
            prepared=prepared,
            built_ahead=prepared_member is not None and prepared_member.built is not None,
            touched_ahead=prepared_member.bytes_touched if prepared_member is not None else 0,
        ),
        # GroupTransport's hint says ProcessGroup; it uses only rank/size/allgather/send/recv, which gloo has.
        transport=GroupTransport(group, "gloo"),  # type: ignore[arg-type]
        group=group,
        ctx=ctx,
        new_state=new_state,
        new_tensors=new_tensors,
        resident=resident,
    )


def newer_generation(link: AgentLink, generation: int) -> int | None:
    """The number of a generation the agent published after ``generation`` (None: none yet)."""
    newer = link.newer_than(generation)
    return newer.generation if newer is not None else None
