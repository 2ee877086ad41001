"""The leader's decision of the next generation, as a pure function of one read of the store.

The leader (:mod:`etc_agent.agent.leader`) reads what the decision needs in one place into a
:class:`~etc_agent.agent.snapshot.Snapshot` (plain frozen data), :func:`decide` turns it into a :class:`Decision` (plain data:
publish this record, wait, drop these gone agents, or nothing), and the leader writes that back in
one place. The record is published with compare-and-set on the version of ``generation`` the
snapshot read, so a decision made on a snapshot that another leader's publication made stale is
never written. Nothing here touches the store, the clock or the log. See ``docs/protocol.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from etc_agent.agent.layoutfit import fits
from etc_agent.agent.ready import LayoutChoice, LayoutInputs, LayoutQuestion
from etc_agent.agent.snapshot import Snapshot, members, ordered_nodes
from etc_agent.layout.config import ParallelSpec
from etc_agent.rendezvous.records import GenerationRecord, NodeRecord, NodeStatus

JOIN_HOLD_S = 10.0
"""Longest a join waits for the switch into the current generation to finish (its migration record)."""


@dataclass(frozen=True)
class Decision:
    """What the leader does: delete ``drop``'s node records, then publish ``record`` (when there is
    one) with compare-and-set on ``generation`` at ``version``; ``wait_until``: nothing is due before
    that wall-clock time unless the store changes; ``why``: why nothing is published."""

    record: GenerationRecord | None = None
    version: int = 0
    drop: tuple[str, ...] = ()
    wait_until: float | None = None
    why: str = ""

    @property
    def failed(self) -> str | None:
        """The reason, when this decision declares the job failed."""
        return self.record.reason if self.record is not None and self.record.status == "failed" else None


@dataclass(frozen=True)
class _Basis:
    """What the next generation is decided from: the current one as read, and what carries over."""

    current: GenerationRecord | None
    number: int
    restart_count: int
    started: bool
    records_vanished: bool = False
    """The job's generation record is gone from the store while the job ran (its prefix wiped)."""


def all_succeeded(gen: GenerationRecord, statuses: Mapping[str, NodeStatus]) -> bool:
    """Every member of ``gen`` reported success."""
    return bool(gen.members) and all(n in statuses and statuses[n].state == "succeeded" for n in gen.members)


def failure_evidence(snapshot: Snapshot) -> int:
    """Reports of a failure in the running generation (each new one has the members probed again)."""
    failed = sum(s.state == "failed" for s in snapshot.statuses.values())
    return snapshot.num_peer_failed + len(snapshot.abandoned) + failed


def settled(snapshot: Snapshot) -> bool:
    """Whether the next decision needs no ``--reconfig-delay`` of quiet first: the first generation
    once every node ``--nnodes`` allows has registered (no other can join), a member's worker
    failure (the survivors are stopped: waiting for more changes only lengthens their stall), and
    the end of a job whose members all reported success."""
    if snapshot.generation_version == 0:
        return len(members(ordered_nodes(snapshot.nodes))) >= snapshot.settings.max_nodes
    current = snapshot.current
    if current is None or current.status != "running" or not current.members:
        return False
    failed = any(s.state == "failed" and n in current.members for n, s in snapshot.statuses.items())
    silent = any(n in current.members for n in snapshot.unreachable)
    return failed or silent or snapshot.num_peer_failed > 0 or all_succeeded(current, snapshot.statuses)


def decide(snapshot: Snapshot) -> Decision:
    """The next step of the job from what ``snapshot`` read (at most one record to publish)."""
    basis = _basis(snapshot)
    if basis is None:
        return Decision(why="the job is over")
    excluded = set(snapshot.gone) | set(snapshot.unreachable)
    records = [r for r in ordered_nodes(snapshot.nodes) if r.node_id not in excluded]
    current = basis.current
    drop = _dropped(snapshot, current)
    if current is not None and current.status == "running":
        final, reason, restart_count = _after_running(snapshot, current, basis, records)
        if final is not None:
            return Decision(record=final, version=snapshot.generation_version, drop=drop)
        basis = replace(basis, restart_count=restart_count)
    else:
        reason = "enough nodes" if current else "records vanished from the store" if basis.records_vanished else "start"
    made = replace(_next_generation(snapshot, basis, records, reason), drop=drop)
    if made.record is not None and made.record.status in ("running", "waiting") and current is not None:
        made = replace(made, record=_with_unreachable_hosts(made.record, snapshot, current))
    return made


def _dropped(snapshot: Snapshot, current: GenerationRecord | None) -> tuple[str, ...]:
    """The node records to delete: members found gone, and members found unreachable (a node that
    is not a member and went silent is only kept out; its lease decides its record)."""
    members_now = set(current.members) if current is not None and current.status == "running" else set()
    silent = tuple(n for n in snapshot.unreachable if n in members_now and n not in snapshot.gone)
    return (*snapshot.gone, *silent)


def _with_unreachable_hosts(
    record: GenerationRecord, snapshot: Snapshot, current: GenerationRecord
) -> GenerationRecord:
    """``record`` saying which members it drops as unreachable, and naming the addresses of the current members it drops as unreachable that none of
    its members shares (on one host, closing sockets by address would cut the survivors too)."""
    hosts = {r.node_id: r.host for r in ordered_nodes(snapshot.nodes)}
    silent = [n for n in snapshot.unreachable if n in current.members and n not in record.members]
    if not silent:
        return record
    kept = {hosts.get(n) for n in record.members}
    cut = sorted({hosts[n] for n in silent if n in hosts} - kept)
    reason = f"{record.reason} (unreachable: {', '.join(silent)})"
    return record.model_copy(update={"unreachable_hosts": cut, "reason": reason})


def _basis(snapshot: Snapshot) -> _Basis | None:
    """The current generation and what the next one inherits; None once the job is over."""
    current, latest = snapshot.current, snapshot.latest
    if current and current.status in ("failed", "succeeded"):
        return None
    basis = _Basis(
        current=current,
        number=(current.number + 1) if current else 0,
        restart_count=current.restart_count if current else 0,
        started=bool(current and (current.started or current.status == "running")),
    )
    if snapshot.generation_version == 0 and latest is not None:
        # The job had a generation and the store lost it (its prefix wiped, say): a store failure,
        # not a new job. Go on after the last number this agent saw, as a job that started.
        return replace(
            basis, number=latest.number + 1, started=True, restart_count=latest.restart_count, records_vanished=True
        )
    if snapshot.generation_version != 0 and current is None:
        # Overwritten by something foreign: continue after every number the job has used, so no
        # agent ever sees an old number again; the state of the job is unknown, so say it started.
        number = max([*snapshot.used_numbers, latest.number if latest else -1]) + 1
        return replace(basis, number=number, started=True)
    return basis


def _after_running(
    snapshot: Snapshot, current: GenerationRecord, basis: _Basis, records: list[NodeRecord]
) -> tuple[GenerationRecord | None, str | None, int]:
    """What the statuses of a running generation call for: (a final record to publish, or None;
    the reason for a next running one, or None for a membership/layout change; the restart count)."""
    number, restart_count, statuses = basis.number, basis.restart_count, snapshot.statuses
    failed = [n for n, s in statuses.items() if s.state == "failed" and n in current.members]
    fatal = [s.message for s in statuses.values() if s.state == "failed" and s.fatal]
    if fatal:
        return _final(current, number, "failed", fatal[0]), None, restart_count
    live = snapshot.live_job
    if live:
        # Its agent takes a crashed worker's node out (a record with the restarting ranks) just
        # before it reports the failure: seen first, the record names the failure as well. Only
        # a crash in this generation: a restart in place is a member restarting a crash the
        # current generation already answers.
        failed += [
            n.node_id
            for n in members(records, include_unready=True)
            if n.restarting
            and n.crashed_in == current.number
            and n.node_id in current.members
            and n.node_id not in failed
        ]
    if failed and live:
        # The failed node's agent restarts its worker and leaves the membership until it runs (its
        # own --max-restarts count): the next generation goes on with the others.
        return None, f"worker failure on {', '.join(failed)}", restart_count + 1
    if failed:
        limit = snapshot.settings.job_restarts
        if restart_count >= limit:
            why = f"worker failure on {', '.join(failed)}; {restart_count}/{limit} restarts used"
            return _final(current, number, "failed", why), None, restart_count
        restart_count += 1
        return None, f"worker failure on {', '.join(failed)} (restart {restart_count}/{limit})", restart_count
    if snapshot.abandoned:
        return None, f"generation {current.number} abandoned: {snapshot.abandoned[0].reason}", restart_count
    if all_succeeded(current, statuses):
        return _final(current, number, "succeeded", "all workers exited 0"), None, restart_count
    return None, None, restart_count


def _final(current: GenerationRecord, number: int, status: str, reason: str) -> GenerationRecord:
    """The record that ends the job: the current one's members and layout, under the next number."""
    return current.model_copy(update={"number": number, "status": status, "reason": reason})


def _next_generation(snapshot: Snapshot, basis: _Basis, records: list[NodeRecord], reason: str | None) -> Decision:
    """The running or waiting generation the members call for, or nothing when it is the current one."""
    settings, current = snapshot.settings, basis.current
    alive = members(records)
    alive_ids = [n.node_id for n in alive]
    # Keep surviving members in their order, then newcomers.
    ordered = [n for n in (current.members if current else []) if n in alive_ids] + [
        n for n in alive_ids if not current or n not in current.members
    ]
    ordered = ordered[: settings.max_nodes]
    devices = {n.node_id: n.num_devices for n in alive}
    if current is not None and current.status == "running" and snapshot.live_job:
        ordered, reason = _keep_restarting(snapshot, current, ordered, devices, reason, records)
    layout, ready = _layout(snapshot, ordered, devices, current)
    if layout.why_not is not None:
        if current and current.status == "waiting" and current.members == ordered:
            return Decision(why="waiting already: " + layout.why_not)
        record = _waiting(snapshot, basis, ordered, devices, layout.why_not)
        return Decision(record=record, version=snapshot.generation_version)
    ordered, parallel = list(layout.ordered), layout.parallel
    if current and current.status == "running" and reason is None and ordered == current.members:
        if parallel == current.parallel:
            return Decision(why="nothing changed")
        reason = f"reconfigured to {parallel}"
    if reason is None:
        # Only a running current generation leaves no reason (_after_running, _keep_restarting).
        assert current is not None
        joined = [n for n in ordered if n not in current.members]
        left = [n for n in current.members if n not in ordered]
        parts = (f"{len(left)} left" if left else "", f"{len(joined)} joined" if joined else "")
        reason = ", ".join(p for p in parts if p) or "membership"
    hold = _join_hold(snapshot, current, ordered)
    if hold is not None:
        return Decision(wait_until=hold, why="a join waits for the current switch to finish")
    if len(ordered) < settings.min_nodes:
        vanished_for = snapshot.vanished_for_s
        assert vanished_for is not None or not basis.records_vanished  # the leader notes when it found that
        if vanished_for is not None and basis.records_vanished and vanished_for < settings.reregistration_grace_s:
            # The node records went with the rest; their agents put them back within a lease.
            until = snapshot.now + settings.reregistration_grace_s - vanished_for
            return Decision(wait_until=until, why="agents are putting their vanished records back")
        if current and current.status == "waiting" and current.members == ordered:
            return Decision(why="waiting already for --nnodes MIN")
        why = f"{len(ordered)} of at least {settings.min_nodes} nodes"
        return Decision(record=_waiting(snapshot, basis, ordered, devices, why), version=snapshot.generation_version)
    record = _running_record(snapshot, basis, ordered, devices, parallel, reason, records)
    if parallel is not None:
        record = record.model_copy(
            update={
                "placement": list(layout.placement) if layout.placement is not None else None,
                "not_resilient": list(layout.gaps),
                "layout_ready": ready,
                "layout_seconds": 0.0 if ready else round(layout.seconds, 6),
            }
        )
    return Decision(record=record, version=snapshot.generation_version)


def _layout(
    snapshot: Snapshot, ordered: list[str], devices: dict[str, int], current: GenerationRecord | None
) -> tuple[LayoutChoice, bool]:
    """The layout for these members: the ready one with exactly these inputs, else worked out now."""
    question = _question(snapshot, ordered, devices, current)
    ready = snapshot.ready_layouts.get(question.key())
    if ready is not None:
        return ready, True
    return question.answer(), False


def _question(
    snapshot: Snapshot, ordered: list[str], devices: dict[str, int], current: GenerationRecord | None
) -> LayoutQuestion:
    settings = snapshot.settings
    return LayoutQuestion(
        _spec(snapshot),
        settings.model,
        settings.min_nodes,
        tuple(ordered),
        tuple(devices[n] for n in ordered),
        current,
        settings.resilient_placement,
    )


def _keep_restarting(
    snapshot: Snapshot,
    current: GenerationRecord,
    ordered: list[str],
    devices: dict[str, int],
    reason: str | None,
    records: list[NodeRecord],
) -> tuple[list[str], str | None]:
    """Members restarting a crashed worker are out of the membership until it runs, so the others go
    on without them; unless the others alone cannot (fewer than --nnodes MIN, or no layout fits):
    then they stay members (``devices`` gains theirs) and the generation waits for the restarted
    process (a restart in place)."""
    restarting = {
        n.node_id: n
        for n in members(records, include_unready=True)
        if not n.ready and n.node_id in current.members and n.node_id not in ordered
    }
    if not restarting:
        return ordered, reason
    settings = snapshot.settings
    if (
        fits(_spec(snapshot), settings.model, [devices[n] for n in ordered], settings.min_nodes)
        and settings.live_migration
    ):
        return ordered, reason
    devices.update({n: r.num_devices for n, r in restarting.items()})
    kept = [n for n in current.members if n in ordered or n in restarting]
    kept += [n for n in ordered if n not in kept]
    why = f"the others alone do not fit (--nnodes MIN {settings.min_nodes}, --parallel)"
    if reason is None:
        return kept, None  # published already (or its failure not reported yet): nothing new
    return kept, f"{reason}; waiting for its restart in place: {why}"


def likely_layouts(snapshot: Snapshot) -> list[tuple[list[str], dict[str, int]]]:
    """The members the next event most likely leaves, while a generation runs: each member's loss
    (in member order), the waiting spares joining as survivors would (:func:`_next_generation`'s
    order: survivors first, then newcomers). What the leader prepares ready layouts for."""
    current = snapshot.current
    if current is None or current.status != "running" or current.parallel is None:
        return []
    alive = members(ordered_nodes(snapshot.nodes))
    devices = {n.node_id: n.num_devices for n in alive}
    out = []
    for lost in current.members:
        ids = [n.node_id for n in alive if n.node_id != lost]
        ordered = [n for n in current.members if n in ids] + [n for n in ids if n not in current.members]
        out.append((ordered[: snapshot.settings.max_nodes], devices))
    return out


def prepare_layout(
    snapshot: Snapshot, ordered: list[str], devices: dict[str, int]
) -> tuple[LayoutInputs, LayoutChoice]:
    """One ready layout for ``ordered``, keyed by its inputs (run by the leader in the background)."""
    question = _question(snapshot, ordered, devices, snapshot.current)
    return question.key(), question.answer()


def _spec(snapshot: Snapshot) -> ParallelSpec | None:
    return snapshot.requested_spec if snapshot.requested_spec is not None else snapshot.settings.spec


def _join_hold(snapshot: Snapshot, current: GenerationRecord | None, ordered: list[str]) -> float | None:
    """Until when a generation that only adds nodes waits for the current one's switch to finish
    (None: it does not wait).

    A join is no emergency: published while the others are still switching into the current
    generation (a crashed worker's node whose fork-server restart said hello within 0.1 s of the
    failure), it would supersede that switch and the survivors would stall for two switches in
    a row. It comes once the current generation's migration record is there (its switch is
    done: the others train while the newcomer is brought in), or after ``JOIN_HOLD_S``.
    """
    if (
        current is None
        or current.status != "running"
        or not current.started
        or not set(current.members) < set(ordered)
        or snapshot.now - current.published_at > JOIN_HOLD_S
        or not snapshot.live_job
        or snapshot.migration_done
    ):
        return None
    return current.published_at + JOIN_HOLD_S


def _waiting(
    snapshot: Snapshot, basis: _Basis, ordered: list[str], devices: dict[str, int], reason: str
) -> GenerationRecord:
    return GenerationRecord(
        number=basis.number,
        status="waiting",
        members=ordered,
        num_devices=[devices[n] for n in ordered],
        restart_count=basis.restart_count,
        started=basis.started,
        published_at=snapshot.now,
        reason=reason,
    )


def _running_record(
    snapshot: Snapshot,
    basis: _Basis,
    ordered: list[str],
    devices: dict[str, int],
    parallel: str | None,
    reason: str,
    records: list[NodeRecord],
) -> GenerationRecord:
    current = basis.current
    # Departing members that are still alive send their state before they exit.
    # So do members left out as spares (the layout uses fewer devices): they may hold the only
    # surviving copy of some state (a node failure took the other), and go idle after sending.
    # So do the surviving workers of a node that restarts a crashed one (registered, not ready).
    # Their restarted workers hold nothing and are left out (nobody waits for them to start).
    registered = {n.node_id: n for n in records}
    previous = current.members if current else []
    sending = {
        n: [d for d in range(r.num_devices) if d not in r.restarting]
        for n, r in registered.items()
        if n in previous and n not in ordered and (r.leaving or snapshot.settings.live_migration)
    }
    senders = [n for n in previous if sending.get(n)]
    return GenerationRecord(
        number=basis.number,
        status="running",
        members=ordered,
        num_devices=[devices[n] for n in ordered],
        restart_count=basis.restart_count,
        reason=reason,
        parallel=parallel,
        senders=senders,
        sender_devices=[len(sending[n]) for n in senders],
        sender_local_ranks=[sending[n] for n in senders],
        started=basis.started,
        published_at=snapshot.now,
        probe_addresses=[_probe_address(registered.get(n)) for n in ordered],
    )


def _probe_address(record: NodeRecord | None) -> str:
    return f"{record.host}:{record.probe_port}" if record is not None and record.probe_port is not None else ""
