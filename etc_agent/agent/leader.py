"""The leader: store-based election, and the decision of each next generation.

One agent holds the ``leader`` key (under its lease). It watches the members and the workers'
statuses and, once nothing changed for ``--reconfig-delay`` (or no later change could alter the
decision), publishes the next :class:`GenerationRecord` with compare-and-set on ``generation``.
The decision reads the store only; every agent then acts on what it reads back
(:mod:`etc_agent.agent.agent`). See ``docs/protocol.md``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from etc_agent.agent.config import AgentConfig
from etc_agent.agent.gone import GoneAgents
from etc_agent.agent.records import RecordReader, where
from etc_agent.layout.config import ParallelSpec
from etc_agent.rendezvous.records import AbandonRecord, GenerationRecord, LeaderRecord, NodeRecord, NodeStatus
from etc_agent.rendezvous.store import KeyValue, Lease, MembershipStore, StoreError, WatchEvent

JOIN_HOLD_S = 10.0
"""Longest a join waits for the switch into the current generation to finish (its migration record)."""

HAND_OVER_WAIT_S = 2.0
"""How long a departing leader waits for its own record to say ``leaving`` before its last decision."""

log = logging.getLogger("etc_agent.agent")


@dataclass
class _Nodes:
    """The node records as one read of ``nodes/`` found them, in group order. A decision works from one
    read: a record that changes meanwhile (a crashed worker's node taking itself out of the membership
    just before it reports the failure) is then seen the same way by every part of the decision."""

    records: list[NodeRecord]

    def members(self, include_leaving: bool = False, include_unready: bool = False) -> list[NodeRecord]:
        """The ready nodes that are not leaving (and those too, when asked)."""
        return [r for r in self.records if (include_leaving or not r.leaving) and (include_unready or r.ready)]

    def drop(self, node_id: str) -> None:
        """A node whose record the decision deleted."""
        self.records = [r for r in self.records if r.node_id != node_id]


@dataclass
class _Basis:
    """What the next generation is decided from: the current one as read, and what carries over."""

    current: GenerationRecord | None
    version: int
    number: int
    restart_count: int
    started: bool
    records_vanished: bool = False
    """The job's generation record is gone from the store while the job ran (its prefix wiped)."""


class Leader:
    """Election and decisions of one agent (``run_election`` is that agent's election thread)."""

    def __init__(
        self,
        store: MembershipStore,
        config: AgentConfig,
        node_id: str,
        emit: Callable[[str, dict], None],
        reader: RecordReader,
        leaving: threading.Event,
        stop_requested: threading.Event,
        lease: Callable[[], Lease | None],
        latest: Callable[[], GenerationRecord | None],
    ):
        """``lease``: the agent's current lease (it changes when the agent registers again);
        ``latest``: the newest generation the agent read (numbers are never reused)."""
        self.store, self.config, self.node_id, self.emit, self.reader = store, config, node_id, emit, reader
        self.leaving, self.stop_requested = leaving, stop_requested
        self._lease, self._latest = lease, latest
        self.is_leader = False
        self._gone = GoneAgents(node_id)
        self._holder_seen: str | None = None
        """Another agent that held the leader key at the last look."""
        self._leaseless_seen: set[str] = set()
        """Node records without a lease this leader has already logged."""
        self._vanished_since: float | None = None
        """When this leader first found the job's generation record gone (None: it never did)."""
        self._peer_failure = threading.Event()
        """Set when this node's workers report a failed collective: check whether the leader is gone."""
        self._dirty = threading.Event()
        self._spec = ParallelSpec.parse(config.parallel) if config.parallel else None
        self._model = None
        if config.model:
            from etc_agent.layout.model import ModelSpec

            self._model = ModelSpec.from_yaml(config.model)

    # ---- election --------------------------------------------------------------------
    def run_election(self) -> None:
        """Try to become leader whenever there is none; lead while holding the key."""
        while not self.stop_requested.is_set():
            try:
                if not self.leaving.is_set() and self._win():
                    self.is_leader = True
                    self.emit("leader_elected", {})
                    self._lead()
                    self.is_leader = False
                elif self._peer_failure.is_set():
                    self._peer_failure.clear()
                    if not self.leaving.is_set() and self._take_over_from_a_gone_leader():
                        continue  # the key is ours now: lead at once
                else:
                    self._learn_the_leader()
            except StoreError as err:
                self.emit("store_unreachable", {"error": str(err)})
            except Exception as err:
                self.is_leader = False
                self.emit("leader_error", {"error": f"{type(err).__name__}: {err}", "where": where(err)})
                log.exception("leader loop failed; standing for election again")
            # A leader seen but not probed yet (its node record was not there at the first look) is
            # looked at again soon: its port refuses connections only once it is dead, and a refusal
            # counts only from a port that answered before.
            unprobed = self._holder_seen is not None and not self._gone.knows(self._holder_seen)
            self._peer_failure.wait(0.2 if unprobed else max(0.2, self.config.lease_ttl / 5))

    def notify_peer_failure(self) -> None:
        """This node's workers saw a peer fail: if the leader died with it, take over now."""
        self._peer_failure.set()

    def _leader_node(self) -> tuple[KeyValue, NodeRecord] | None:
        """The leader key and its holder's node record, when another agent holds it."""
        kv = self.store.get("leader")
        if kv is None:
            return None
        holder = self.reader.parse(LeaderRecord, kv)
        if holder is None or holder.node_id == self.node_id:
            return None
        node_kv = self.store.get(f"nodes/{holder.node_id}")
        record = self.reader.parse(NodeRecord, node_kv) if node_kv is not None else None
        return (kv, record) if record is not None else None

    def _learn_the_leader(self) -> None:
        """Probe a new leader's port once (its refusals count only then); nothing to read otherwise."""
        if self._holder_seen is None or self._gone.knows(self._holder_seen):
            return
        found = self._leader_node()
        if found is not None:
            self._gone.learn([found[1]])

    def _take_over_from_a_gone_leader(self) -> bool:
        """The leader's agent is gone (:mod:`etc_agent.agent.gone`): take its key (compare-and-set,
        one agent wins) and its node out, instead of waiting for its lease."""
        found = self._leader_node()
        if found is None:
            return False
        kv, record = found
        self._gone.learn([record])
        if not self._gone.is_gone(record):
            return False
        if not self.store.compare_and_set(
            "leader", LeaderRecord(node_id=self.node_id).dumps(), kv.version, lease=self._lease()
        ):
            return False
        self.store.delete(f"nodes/{record.node_id}")
        self.emit(
            "agent_gone",
            {
                "node": record.node_id,
                "how": "the leader's liveness port refused a connection after a failure; taking over",
            },
        )
        return True

    def _win(self) -> bool:
        current = self.store.get("leader")
        record = LeaderRecord(node_id=self.node_id).dumps()
        holder = self.reader.parse(LeaderRecord, current) if current is not None else None
        self._holder_seen = holder.node_id if holder is not None and holder.node_id != self.node_id else None
        if current is None:
            if self.store.create("leader", record, lease=self._lease()):
                return True
            # Another agent won the key just now: learn who at once (its port is probed next), not a
            # fifth of a lease later, or a leader killed in the first seconds is never found gone.
            won = self.store.get("leader")
            winner = self.reader.parse(LeaderRecord, won) if won is not None else None
            self._holder_seen = winner.node_id if winner is not None and winner.node_id != self.node_id else None
            return False
        if holder is None:
            # Not a leader's record (it would have been written with a lease): take the key over.
            return self.store.compare_and_set("leader", record, current.version, lease=self._lease())
        return holder.node_id == self.node_id  # still ours (leading stopped on a store error): lead again

    def _lead(self) -> None:
        watch = self.store.watch_prefix("", self._on_event)
        try:
            self._dirty.set()
            last_decision = 0.0
            while not self.stop_requested.is_set() and not self.leaving.is_set():
                if self._dirty.wait(0.1):
                    self._quiet()
                    self.decide()
                    last_decision = time.monotonic()
                elif time.monotonic() - last_decision > 1.0:
                    self.decide()  # also without events: a watch may have missed one
                    last_decision = time.monotonic()
                leader = self.store.get("leader")
                record = self.reader.parse(LeaderRecord, leader) if leader is not None else None
                if record is None or record.node_id != self.node_id:
                    self.emit("leadership_lost", {})
                    return
        finally:
            watch.cancel()
            if self.leaving.is_set():
                try:
                    self._hand_over()
                except StoreError as err:
                    self.emit(
                        "store_unreachable", {"error": str(err), "pending": "the departing leader's last decision"}
                    )
                try:
                    self.store.delete("leader")
                except StoreError:
                    pass

    def _hand_over(self) -> None:
        """A departing leader publishes the generation without its own node before it gives up the
        key (once its record says ``leaving``), so the others go on without waiting for an election
        first; nothing when no other node carries the job on."""
        deadline = time.monotonic() + HAND_OVER_WAIT_S
        while True:
            kv = self.store.get(f"nodes/{self.node_id}")
            record = self.reader.parse(NodeRecord, kv) if kv is not None else None
            if record is None or record.leaving or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if record is None or not record.leaving:
            return
        if not any(n.node_id != self.node_id for n in self.members_now()):
            return
        self.decide()

    def _quiet(self) -> None:
        """Debounce: return once nothing changed for ``--reconfig-delay``, or at once when no later
        change can alter the decision."""
        while not self.stop_requested.is_set():
            self._dirty.clear()
            if self._settled() or not self._dirty.wait(self.config.reconfig_delay):
                return

    def _on_event(self, event: WatchEvent) -> None:
        if (
            event.key.startswith("nodes/")
            or "/status/" in event.key
            or "/abandoned/" in event.key
            or "/peer_failed/" in event.key
            or event.key.endswith("/migration")  # a join held back until the switch is done
        ):
            self._dirty.set()

    def _settled(self) -> bool:
        """Whether the next decision needs no ``--reconfig-delay`` of quiet first: the first generation
        once every node ``--nnodes`` allows has registered (no other can join), a member's worker
        failure (the survivors are stopped: waiting for more changes only lengthens their stall), and
        the end of a job whose members all reported success."""
        kv = self.store.get("generation")
        if kv is None:
            return len(self.members_now()) >= self.config.max_nodes
        current = self.reader.parse(GenerationRecord, kv)
        if current is None or current.status != "running" or not current.members:
            return False
        statuses = self.statuses(current.number)
        failed = any(s.state == "failed" and n in current.members for n, s in statuses.items())
        peer_failed = bool(self.store.get_prefix(f"generations/{current.number}/peer_failed/"))
        return failed or peer_failed or all_succeeded(current, statuses)

    def _drop_gone_agents(
        self, current: GenerationRecord, statuses: dict[str, NodeStatus], num_abandoned: int, nodes: _Nodes
    ) -> None:
        """Members whose agent is gone (:mod:`etc_agent.agent.gone`) leave now, not when their lease
        expires: their node records are deleted (and dropped from ``nodes``). ``statuses`` and
        ``num_abandoned``: what the caller read of ``current`` (failures reported in it)."""
        records = nodes.members(include_leaving=True, include_unready=True)
        self._gone.learn(records)
        evidence = (
            len(self.store.get_prefix(f"generations/{current.number}/peer_failed/"))
            + num_abandoned
            + sum(s.state == "failed" for s in statuses.values())
        )
        for node_id in self._gone.check(current.number, evidence, current.members, records):
            self.store.delete(f"nodes/{node_id}")
            nodes.drop(node_id)
            self.emit(
                "agent_gone",
                {
                    "node": node_id,
                    "generation": current.number,
                    "how": "its liveness port refused a connection after a failure (not waiting for its lease)",
                },
            )

    # ---- reading the store ------------------------------------------------------------
    def statuses(self, generation: int) -> dict[str, NodeStatus]:
        """Node id -> the status its agent reported for ``generation`` (foreign values left out)."""
        statuses = {}
        for skv in self.store.get_prefix(f"generations/{generation}/status/"):
            status = self.reader.parse(NodeStatus, skv)
            if status is not None:
                statuses[skv.key.rsplit("/", 1)[-1]] = status
        return statuses

    def _live_job(self) -> bool:
        """The workers use the worker API (they outlive generations; each node bounds its crash restarts)."""
        return self.store.get("elastic") is not None

    def members_now(self, include_leaving: bool = False, include_unready: bool = False) -> list[NodeRecord]:
        """The registered, ready nodes in group order (one read of the store)."""
        return self._read_nodes().members(include_leaving, include_unready)

    def _read_nodes(self) -> _Nodes:
        """Every node record, in group order: ``--node-rank`` hints first, then by registration."""
        nodes = []
        for kv in self.store.get_prefix("nodes/"):
            if not kv.lease:
                # Every agent registers under its lease; a record without one outlives any process
                # and is not a member (a leftover, or written by hand).
                if kv.key not in self._leaseless_seen:
                    self._leaseless_seen.add(kv.key)
                    log.warning("%s has no lease: not a member of the job (agents register under a lease)", kv.key)
                continue
            record = self.reader.parse(NodeRecord, kv)
            if record is not None:
                nodes.append((record, kv.mod_revision))
        nodes.sort(
            key=lambda item: (
                item[0].node_rank_hint if item[0].node_rank_hint is not None else 1 << 30,
                item[1],
                item[0].node_id,
            )
        )
        return _Nodes([n for n, _ in nodes])

    def _requested_spec(self) -> ParallelSpec | None:
        """A layout asked for at run time (``etc-agent reconfigure``), which wins over ``--parallel``."""
        kv = self.store.get("parallel")
        if kv is None:
            return None
        try:
            return ParallelSpec.parse(json.loads(kv.value)["spec"])
        except (ValueError, KeyError, TypeError) as err:
            self.reader.reject(kv, f"{type(err).__name__}: {err}")
            return None

    # ---- the decision -----------------------------------------------------------------
    def decide(self) -> None:
        """Publish the next generation if the store says one is due (at most one compare-and-set)."""
        basis = self._basis()
        if basis is None:
            return
        current = basis.current
        if current and current.status == "running":
            # The statuses first, then the node records: a node that reported a worker failure took
            # itself out of the membership before, so the records read after it show that too.
            statuses = self.statuses(current.number)
            nodes = self._read_nodes()
            final, reason, basis.restart_count = self._after_running(basis, statuses, nodes)
            if final is not None:
                self._publish(final, basis.version)
                return
        else:
            nodes = self._read_nodes()
            reason = (
                "enough nodes" if current else "records vanished from the store" if basis.records_vanished else "start"
            )
        alive = nodes.members()
        alive_ids = [n.node_id for n in alive]
        # Keep surviving members in their order, then newcomers.
        ordered = [n for n in (current.members if current else []) if n in alive_ids] + [
            n for n in alive_ids if not current or n not in current.members
        ]
        ordered = ordered[: self.config.max_nodes]
        devices = {n.node_id: n.num_devices for n in alive}
        if current and current.status == "running" and self._live_job():
            ordered, reason = self._keep_restarting(current, ordered, devices, reason, nodes)
        fitted = self._fit(basis, ordered, devices)
        if fitted is None:
            return
        ordered, parallel = fitted
        if current and current.status == "running" and reason is None and ordered == current.members:
            if parallel == current.parallel:
                return  # nothing to do
            reason = f"reconfigured to {parallel}"
        if reason is None:
            # Only a running current generation leaves no reason (_after_running, _keep_restarting).
            assert current is not None
            joined = [n for n in ordered if n not in current.members]
            left = [n for n in current.members if n not in ordered]
            reason = (
                ", ".join(
                    p for p in (f"{len(left)} left" if left else "", f"{len(joined)} joined" if joined else "") if p
                )
                or "membership"
            )
        if self._join_waits_for_switch(current, ordered):
            return
        if len(ordered) < self.config.min_nodes:
            if basis.records_vanished and self._within_reregistration_grace():
                return  # the node records went with the rest; their agents put them back within a lease
            if not (current and current.status == "waiting" and current.members == ordered):
                self._publish_waiting(
                    basis, ordered, devices, f"{len(ordered)} of at least {self.config.min_nodes} nodes"
                )
            return
        self._publish_running(basis, ordered, devices, parallel, reason, nodes)

    def _within_reregistration_grace(self) -> bool:
        """Whether agents whose node records vanished may still be putting them back (their keepalive
        finds the record gone within a lease's time-to-live)."""
        assert self._vanished_since is not None
        return time.monotonic() - self._vanished_since < self.config.lease_ttl + self.config.reconfig_delay

    def _basis(self) -> _Basis | None:
        """The current generation and what the next one inherits; None once the job is over."""
        kv = self.store.get("generation")
        current = self.reader.parse(GenerationRecord, kv) if kv else None
        if current and current.status in ("failed", "succeeded"):
            return None
        basis = _Basis(
            current=current,
            version=kv.version if kv else 0,
            number=(current.number + 1) if current else 0,
            restart_count=current.restart_count if current else 0,
            started=bool(current and (current.started or current.status == "running")),
        )
        latest = self._latest()
        if kv is None and latest is not None:
            # The job had a generation and the store lost it (its prefix wiped, say): a store failure,
            # not a new job. Go on after the last number this agent saw, as a job that started.
            if self._vanished_since is None:
                self._vanished_since = time.monotonic()
                self.emit(
                    "store_records_vanished",
                    {"last_generation": latest.number, "note": "the job's generation record is gone from the store"},
                )
            basis.number, basis.started = latest.number + 1, True
            basis.restart_count = latest.restart_count
            basis.records_vanished = True
            return basis
        if kv is not None and current is None:
            # Overwritten by something foreign: continue after every number the job has used, so no
            # agent ever sees an old number again; the state of the job is unknown, so say it started.
            used = [
                int(k.key.split("/")[1]) for k in self.store.get_prefix("generations/") if k.key.split("/")[1].isdigit()
            ]
            basis.number = max([*used, latest.number if latest else -1]) + 1
            basis.started = True
        return basis

    def _after_running(
        self, basis: _Basis, statuses: dict[str, NodeStatus], nodes: _Nodes
    ) -> tuple[GenerationRecord | None, str | None, int]:
        """What the statuses of a running generation call for: (a final record to publish, or None;
        the reason for a next running one, or None for a membership/layout change; the restart count)."""
        current, number, restart_count = basis.current, basis.number, basis.restart_count
        assert current is not None  # decide() calls this only for a running current generation
        abandoned = [
            r
            for r in (
                self.reader.parse(AbandonRecord, akv)
                for akv in self.store.get_prefix(f"generations/{current.number}/abandoned/")
            )
            if r is not None
        ]
        self._drop_gone_agents(current, statuses, len(abandoned), nodes)
        failed = [n for n, s in statuses.items() if s.state == "failed" and n in current.members]
        fatal = [s.message for n, s in statuses.items() if s.state == "failed" and s.fatal]
        if fatal:
            return (
                current.model_copy(update={"number": number, "status": "failed", "reason": fatal[0]}),
                None,
                restart_count,
            )
        live = self._live_job()
        if live:
            # Its agent takes a crashed worker's node out (a record with the restarting ranks) just
            # before it reports the failure: seen first, the record names the failure as well. Only
            # a crash in this generation: a restart in place is a member restarting a crash the
            # current generation already answers.
            failed += [
                n.node_id
                for n in nodes.members(include_unready=True)
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
            limit = self.config.job_restarts
            if restart_count >= limit:
                why = f"worker failure on {', '.join(failed)}; {restart_count}/{limit} restarts used"
                return (
                    current.model_copy(update={"number": number, "status": "failed", "reason": why}),
                    None,
                    restart_count,
                )
            restart_count += 1
            return (
                None,
                f"worker failure on {', '.join(failed)} (restart {restart_count}/{limit})",
                restart_count,
            )
        if abandoned:
            return None, f"generation {current.number} abandoned: {abandoned[0].reason}", restart_count
        if all_succeeded(current, statuses):
            return (
                current.model_copy(update={"number": number, "status": "succeeded", "reason": "all workers exited 0"}),
                None,
                restart_count,
            )
        return None, None, restart_count

    def _keep_restarting(
        self, current: GenerationRecord, ordered: list[str], devices: dict[str, int], reason: str | None, nodes: _Nodes
    ) -> tuple[list[str], str | None]:
        """Members restarting a crashed worker are out of the membership until it runs, so the others go
        on without them; unless the others alone cannot (fewer than --nnodes MIN, or no layout fits):
        then they stay members and the generation waits for the restarted process (a restart in place)."""
        restarting = {
            n.node_id: n
            for n in nodes.members(include_unready=True)
            if not n.ready and n.node_id in current.members and n.node_id not in ordered
        }
        if not restarting or (self._fits(ordered, devices) and self.config.migration == "live"):
            return ordered, reason
        devices.update({n: r.num_devices for n, r in restarting.items()})
        kept = [n for n in current.members if n in ordered or n in restarting]
        kept += [n for n in ordered if n not in kept]
        why = f"the others alone do not fit (--nnodes MIN {self.config.min_nodes}, --parallel)"
        if reason is None:
            return kept, None  # published already (or its failure not reported yet): nothing new
        return kept, f"{reason}; waiting for its restart in place: {why}"

    def _fits(self, ordered: list[str], devices: dict[str, int]) -> bool:
        """Whether these nodes can run a generation (enough of them, and a layout that uses them)."""
        if len(ordered) < self.config.min_nodes:
            return False
        spec = self._requested_spec() or self._spec
        if spec is None:
            return True
        from etc_agent.planner.policy import resolve_parallel

        return any(
            resolve_parallel(spec, [devices[n] for n in ordered[:count]], self._model) is not None
            for count in range(len(ordered), max(self.config.min_nodes, 1) - 1, -1)
        )

    def _fit(self, basis: _Basis, ordered: list[str], devices: dict[str, int]) -> tuple[list[str], str | None] | None:
        """The longest prefix of the members whose devices the layout uses exactly, and that layout
        (nodes after it wait as spares); None when it fits no group (a waiting generation says so)."""
        spec = self._requested_spec() or self._spec
        if spec is None or len(ordered) < self.config.min_nodes:
            return ordered, None
        from etc_agent.planner.policy import resolve_parallel

        for count in range(len(ordered), self.config.min_nodes - 1, -1):
            config = resolve_parallel(spec, [devices[n] for n in ordered[:count]], self._model) if count else None
            if config is not None:
                return ordered[:count], config.short()
        current = basis.current
        if not (current and current.status == "waiting" and current.members == ordered):
            total = sum(devices[n] for n in ordered)
            self._publish_waiting(
                basis,
                ordered,
                devices,
                f"--parallel {spec.short()} fits no group of the {len(ordered)} nodes ({total} devices)",
            )
        return None

    def _join_waits_for_switch(self, current: GenerationRecord | None, ordered: list[str]) -> bool:
        """Whether a generation that only adds nodes waits for the current one's switch to finish.

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
            or time.time() - current.published_at > JOIN_HOLD_S
            or not self._live_job()
        ):
            return False
        return self.store.get(f"generations/{current.number}/migration") is None

    def _publish_waiting(self, basis: _Basis, ordered: list[str], devices: dict[str, int], reason: str) -> None:
        self._publish(
            GenerationRecord(
                number=basis.number,
                status="waiting",
                members=ordered,
                num_devices=[devices[n] for n in ordered],
                restart_count=basis.restart_count,
                started=basis.started,
                published_at=time.time(),
                reason=reason,
            ),
            basis.version,
        )

    def _publish_running(
        self,
        basis: _Basis,
        ordered: list[str],
        devices: dict[str, int],
        parallel: str | None,
        reason: str,
        nodes: _Nodes,
    ) -> None:
        current = basis.current
        # Departing members that are still alive send their state before they exit.
        # So do members left out as spares (the layout uses fewer devices): they may hold the only
        # surviving copy of some state (a node failure took the other), and go idle after sending.
        # So do the surviving workers of a node that restarts a crashed one (registered, not ready).
        # Their restarted workers hold nothing and are left out (nobody waits for them to start).
        registered = {n.node_id: n for n in nodes.members(include_leaving=True, include_unready=True)}
        previous = current.members if current else []
        sending = {
            n: [d for d in range(r.num_devices) if d not in r.restarting]
            for n, r in registered.items()
            if n in previous and n not in ordered and (r.leaving or self.config.migration == "live")
        }
        senders = [n for n in previous if sending.get(n)]
        placement = self._place(parallel, ordered, devices, current)
        gaps = []
        if placement is not None and parallel is not None:  # _place() places only with a layout: no new check
            from etc_agent.layout.config import ParallelConfig
            from etc_agent.planner.placement import resilience_gaps

            gaps = resilience_gaps(ParallelConfig.parse(parallel), placement)
        self._publish(
            GenerationRecord(
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
                published_at=time.time(),
                placement=placement,
                not_resilient=gaps,
            ),
            basis.version,
        )
        if gaps:
            self.emit(
                "not_resilient",
                {"generation": basis.number, "placement": self.config.placement, "gaps": "; ".join(gaps)},
            )

    def _publish(self, record: GenerationRecord, version: int) -> None:
        if self.store.compare_and_set("generation", record.dumps(), version):
            self.emit(
                "generation_published",
                {
                    "generation": record.number,
                    "status": record.status,
                    "members": len(record.members),
                    "world_size": record.world_size,
                    "reason": record.reason,
                },
            )

    def _place(
        self, parallel: str | None, ordered: list[str], devices: dict[str, int], current: GenerationRecord | None
    ) -> list[str] | None:
        """Training rank -> device for a new generation (``--placement``), from the previous placement."""
        if parallel is None:
            return None
        from etc_agent.layout.config import ParallelConfig
        from etc_agent.planner.placement import live_placement

        previous, previous_config = None, None
        if current is not None and current.parallel and current.status == "running":
            previous_config = ParallelConfig.parse(current.parallel)
            order = current.placement or current.member_devices()
            previous = {device: rank for rank, device in enumerate(order)}
        names = [f"{n}:{d}" for n in ordered for d in range(devices[n])]
        return live_placement(
            ParallelConfig.parse(parallel),
            names,
            previous,
            previous_config,
            "resilience" if self.config.placement == "resilient" else "cost",
        )


def all_succeeded(gen: GenerationRecord, statuses: dict[str, NodeStatus]) -> bool:
    """Every member of ``gen`` reported success."""
    return bool(gen.members) and all(n in statuses and statuses[n].state == "succeeded" for n in gen.members)
