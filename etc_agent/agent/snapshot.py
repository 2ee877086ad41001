"""What one read of the store gives the leader's decision (:mod:`etc_agent.agent.decision`): plain
frozen data, read in one place by :meth:`etc_agent.agent.leader.Leader._read`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from etc_agent.layout.config import ParallelSpec
from etc_agent.rendezvous.records import AbandonRecord, GenerationRecord, NodeRecord, NodeStatus

if TYPE_CHECKING:
    from etc_agent.agent.ready import LayoutChoice, LayoutInputs
    from etc_agent.layout.model import ModelSpec


@dataclass(frozen=True)
class Settings:
    """The job's settings the decision uses (from the agent's flags; they never change in a run)."""

    min_nodes: int = 1
    max_nodes: int = 1
    job_restarts: int = 0
    """``--max-restarts`` of a job whose workers do not use the worker API."""
    live_migration: bool = True
    """``--migration live`` (not ``checkpoint``)."""
    resilient_placement: bool = False
    """``--placement resilient`` (not ``fast``)."""
    spec: ParallelSpec | None = None
    """``--parallel``."""
    model: ModelSpec | None = None
    """``--model``, for an ``auto`` degree of the layout."""
    reregistration_grace_s: float = 0.0
    """How long agents whose node records vanished may take to put them back (a lease and a delay)."""


@dataclass(frozen=True)
class NodeEntry:
    """A node record registered under a lease, and the store revision it was last written at."""

    record: NodeRecord
    mod_revision: int


@dataclass(frozen=True)
class Snapshot:
    """Everything one decision reads, from one read of the store (statuses before node records: a
    node that reports a worker failure takes itself out of the membership first)."""

    settings: Settings
    now: float
    """Wall-clock time of the read (``published_at`` of the next record; the join hold)."""
    generation_version: int = 0
    """Version of the ``generation`` key read (0: absent); the publication is conditional on it."""
    current: GenerationRecord | None = None
    """The ``generation`` record (None: absent, or a foreign value when the version is not 0)."""
    latest: GenerationRecord | None = None
    """The newest generation the leader's agent read (numbers are never reused)."""
    used_numbers: tuple[int, ...] = ()
    """Generation numbers under ``generations/`` (read only when ``generation`` holds a foreign value)."""
    nodes: tuple[NodeEntry, ...] = ()
    """Every node record with a lease (a lapsed lease took its record away), in any order."""
    statuses: Mapping[str, NodeStatus] = field(default_factory=dict)
    """Node id -> its status in the current generation (read only while it runs)."""
    abandoned: tuple[AbandonRecord, ...] = ()
    num_peer_failed: int = 0
    """Workers' reports of a failed collective in the current generation."""
    migration_done: bool = False
    """The current generation's migration record exists (its switch is done)."""
    live_job: bool = False
    """Workers use the worker API (they outlive generations; each node bounds its crash restarts)."""
    requested_spec: ParallelSpec | None = None
    """A layout asked for at run time (``etc-agent reconfigure``); it wins over ``--parallel``."""
    gone: tuple[str, ...] = ()
    """Members whose agents the leader found gone (their liveness ports refused after a failure)."""
    unreachable: tuple[str, ...] = ()
    """Registered nodes whose liveness ports have not answered for ``--peer-timeout``
    (:mod:`etc_agent.agent.reach`): members leave now, the others are not admitted."""
    vanished_for_s: float | None = None
    """Seconds since the leader found the job's generation record gone from the store (None: never)."""
    ready_layouts: Mapping[LayoutInputs, LayoutChoice] = field(default_factory=dict)
    """Layout decisions the leader made ahead for likely memberships (:mod:`etc_agent.agent.ready`)."""


def ordered_nodes(entries: Sequence[NodeEntry]) -> list[NodeRecord]:
    """Node records in group order: ``--node-rank`` hints first, then by registration."""
    return [e.record for e in sorted(entries, key=_group_order)]


def _group_order(entry: NodeEntry) -> tuple[int, int, str]:
    hint = entry.record.node_rank_hint
    return (hint if hint is not None else 1 << 30, entry.mod_revision, entry.record.node_id)


def members(
    records: Sequence[NodeRecord], include_leaving: bool = False, include_unready: bool = False
) -> list[NodeRecord]:
    """The ready nodes that are not leaving (and those too, when asked)."""
    return [r for r in records if (include_leaving or not r.leaving) and (include_unready or r.ready)]
