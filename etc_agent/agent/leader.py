"""The leader: store-based election, and the shell around the decision of each next generation.

One agent holds the ``leader`` key (under its lease). It watches the members and the workers'
statuses and, once nothing changed for ``--reconfig-delay`` (or no later change could alter the
decision), decides the next generation: it reads the store in one place into a
:class:`~etc_agent.agent.snapshot.Snapshot`, :func:`etc_agent.agent.decision.decide` (pure) says what
to do, and the leader writes that back in one place, publishing a :class:`GenerationRecord` with
compare-and-set on ``generation``. Every agent then acts on what it reads back
(:mod:`etc_agent.agent.agent`). See ``docs/protocol.md``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from etc_agent.agent import decision, layoutfit
from etc_agent.agent.config import AgentConfig
from etc_agent.agent.decision import Decision, failure_evidence, settled
from etc_agent.agent.gone import GoneAgents
from etc_agent.agent.reach import Prober, Reachability, Round
from etc_agent.agent.ready import ReadyLayouts
from etc_agent.agent.records import RecordReader, where
from etc_agent.agent.snapshot import Settings, Snapshot, members, ordered_nodes
from etc_agent.agent.store_read import StoreRead
from etc_agent.layout.config import ParallelSpec
from etc_agent.protocol import keys
from etc_agent.rendezvous.records import GenerationRecord, LeaderRecord, NodeRecord, NodeStatus
from etc_agent.rendezvous.store import KeyValue, Lease, MembershipStore, StoreError, WatchEvent, WatchHandle

REDECIDE_S = 5.0
"""How often a leader decides with no event and nothing falling due: a watch may miss an event (a
failed watch is made again, and the leader decides every second until then). Every decision reads
about ten keys; once a second that was most of an idle leader's store requests."""
WATCH_REARM_S = 1.0
"""The wait before a failed watch is made again."""
LEADER_KEY_CHECK_S = 1.0
"""How often a leading agent reads the leader key besides when the watch says it changed (a watch
may miss an event); reading it on every 0.1-s pass was most of an idle agent's store requests."""
HAND_OVER_WAIT_S = 2.0
"""How long a departing leader waits for its own record to say ``leaving`` before its last decision."""

log = logging.getLogger("etc_agent.agent")


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
        self.ready = ReadyLayouts()
        """Layouts worked out ahead for the likely next memberships (:mod:`etc_agent.agent.ready`)."""
        self._reach = Reachability(node_id, config.peer_timeout) if config.peer_timeout > 0 else None
        self._probed: tuple[NodeRecord, ...] = ()
        """The node records of the last decision's read: whose liveness ports the probes go to."""
        self._went_silent = threading.Event()
        self._leader_record: NodeRecord | None = None
        """The node record of the agent that holds the leader key (another one), for the prober."""
        self._holder_seen: str | None = None
        """Another agent that held the leader key at the last look."""
        self._vanished_since: float | None = None
        """When this leader first found the job's generation record gone (None: it never did)."""
        self._peer_failure = threading.Event()
        """Set when this node's workers report a failed collective: check whether the leader is gone."""
        self._dirty = threading.Event()
        self._watch_failed = threading.Event()
        self._watch_armed_at = time.monotonic()
        self._leader_key_changed = threading.Event()
        """The watch saw the leader key change: a leading agent reads it at once, not at its next check."""
        model = None
        if config.model:
            from etc_agent.layout.model import ModelSpec

            model = ModelSpec.from_yaml(config.model)
        self._settings = Settings(
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
            job_restarts=config.job_restarts,
            live_migration=config.migration == "live",
            resilient_placement=config.placement == "resilient",
            spec=ParallelSpec.parse(config.parallel) if config.parallel else None,
            model=model,
            reregistration_grace_s=config.lease_ttl + config.reconfig_delay,
        )
        self._store_read = StoreRead(store, reader, self._settings, latest)

    # ---- election --------------------------------------------------------------------
    def run_election(self) -> None:
        """Try to become leader whenever there is none; lead while holding the key. The liveness
        ports are probed meanwhile (:mod:`etc_agent.agent.reach`): the leader probes every node, the
        others the leader."""
        prober = self._start_probing()
        self._warm_planner()
        try:
            self._elect()
        finally:
            if prober is not None:
                prober.stop()

    def _elect(self) -> None:
        while not self.stop_requested.is_set():
            try:
                if not self.leaving.is_set() and self._win():
                    self.is_leader = True
                    self.emit("leader_elected", {})
                    try:
                        self._lead()
                    finally:
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

    def registration_order(self) -> list[str]:
        """The registered nodes' ids in group order (the order of a first generation's members)."""
        return [record.node_id for record in ordered_nodes(self._store_read.nodes())]

    def num_spares(self, members: list[str]) -> int:
        """Nodes of the last read of the store that are outside ``members`` and not leaving."""
        return sum(1 for r in self._probed if r.node_id not in members and not r.leaving)

    def notify_peer_failure(self) -> None:
        """This node's workers saw a peer fail: if the leader died with it, take over now."""
        self._peer_failure.set()

    def _leader_node(self) -> tuple[KeyValue, NodeRecord] | None:
        """The leader key and its holder's node record, when another agent holds it."""
        kv = self.store.get(keys.LEADER)
        if kv is None:
            return None
        holder = self.reader.parse(LeaderRecord, kv)
        if holder is None or holder.node_id == self.node_id:
            return None
        node_kv = self.store.get(keys.node(holder.node_id))
        record = self.reader.parse(NodeRecord, node_kv) if node_kv is not None else None
        return (kv, record) if record is not None else None

    def _learn_the_leader(self) -> None:
        """Probe a new leader's port once (its refusals count only then), and keep its record for
        the prober; nothing to read otherwise."""
        known = self._leader_record is not None and self._leader_record.node_id == self._holder_seen
        if self._holder_seen is None or (known and self._gone.knows(self._holder_seen)):
            return
        found = self._leader_node()
        if found is not None:
            self._leader_record = found[1]
            self._gone.learn([found[1]])

    def _warm_planner(self) -> None:
        """Import the planner in the background (:func:`layoutfit.warm`) while the agents register,
        so that neither the first generation's decision nor a takeover's spends the import."""
        if self._settings.spec is None:
            return
        threading.Thread(target=layoutfit.warm, name="etc-warm-planner", daemon=True).start()

    def _take_over_from_a_gone_leader(self) -> bool:
        """The leader's agent is gone (:mod:`etc_agent.agent.gone`) or its host unreachable
        (:mod:`etc_agent.agent.reach`): take its key (compare-and-set, one agent wins) instead of
        waiting for its lease. A gone leader's node goes out now; an unreachable one's is dropped by
        the first decision, which names its host so that the survivors' workers stop waiting on it."""
        found = self._leader_node()
        if found is None:
            return False
        kv, record = found
        self._gone.learn([record])
        gone = self._gone.is_gone(record)
        silent = self._reach is not None and bool(self._reach.unreachable([record.node_id]))
        if not (gone or silent) or not self.store.compare_and_set(
            keys.LEADER, LeaderRecord(node_id=self.node_id).dumps(), kv.version, lease=self._lease()
        ):
            return False
        if gone:
            self.store.delete(keys.node(record.node_id))
            how = "the leader's liveness port refused a connection after a failure; taking over"
        else:
            assert self._reach is not None
            self._went_silent.set()  # the first decision comes at once, not after a quiet period
            how = f"the leader's liveness port has not answered for {self._reach.silent_for(record.node_id):.1f} s; taking over"
        self.emit("agent_gone", {"node": record.node_id, "how": how})
        return True

    def _win(self) -> bool:
        current = self.store.get(keys.LEADER)
        record = LeaderRecord(node_id=self.node_id).dumps()
        holder = self.reader.parse(LeaderRecord, current) if current is not None else None
        self._holder_seen = holder.node_id if holder is not None and holder.node_id != self.node_id else None
        if current is None:
            if self.store.create(keys.LEADER, record, lease=self._lease()):
                return True
            # Another agent won the key just now: learn who at once (its port is probed next), not a
            # fifth of a lease later, or a leader killed in the first seconds is never found gone.
            won = self.store.get(keys.LEADER)
            winner = self.reader.parse(LeaderRecord, won) if won is not None else None
            self._holder_seen = winner.node_id if winner is not None and winner.node_id != self.node_id else None
            return False
        if holder is None:
            # Not a leader's record (it would have been written with a lease): take the key over.
            return self.store.compare_and_set(keys.LEADER, record, current.version, lease=self._lease())
        return holder.node_id == self.node_id  # still ours (leading stopped on a store error): lead again

    def _lead(self) -> None:
        """Decide on every change the watch reports (after ``--reconfig-delay`` of quiet, or at once
        when a member went silent), when the last decision said something falls due, and every
        ``REDECIDE_S`` besides (every second while the watch is broken)."""
        watch = self._arm_watch()
        try:
            self._dirty.set()
            next_decision = checked_key = 0.0
            while not self.stop_requested.is_set() and not self.leaving.is_set():
                if self._went_silent.is_set():
                    self._went_silent.clear()
                    next_decision = self._decide_and_schedule()  # its peers are blocked: no quiet period
                elif self._dirty.wait(0.1):
                    self._quiet()
                    next_decision = self._decide_and_schedule()
                elif time.monotonic() >= next_decision:
                    next_decision = self._decide_and_schedule()
                if self._watch_failed.is_set() and time.monotonic() - self._watch_armed_at >= WATCH_REARM_S:
                    watch.cancel()
                    watch = self._arm_watch()
                if self._leader_key_changed.is_set() or time.monotonic() - checked_key > LEADER_KEY_CHECK_S:
                    self._leader_key_changed.clear()
                    checked_key = time.monotonic()
                    if not self._still_leader():
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
                    self.store.delete(keys.LEADER)
                except StoreError:
                    pass

    def _start_probing(self) -> Prober | None:
        """Probe liveness ports (:mod:`etc_agent.agent.reach`): a leader every node's (a silent one
        calls for a decision now), another agent the leader's (a silent one, for a take-over)."""
        if self._reach is None:
            return None

        def targets() -> list[NodeRecord]:
            if self.is_leader:
                return list(self._probed)
            return [self._leader_record] if self._leader_record is not None else []

        def changed(found: Round) -> None:
            if found.went_silent:
                (self._went_silent if self.is_leader else self._peer_failure).set()
            elif self.is_leader:
                self._dirty.set()  # a node cut off and back (re-registered meanwhile) is admitted now

        def never(record: NodeRecord) -> None:
            port = f"{record.host}:{record.probe_port}"
            self.emit("liveness_port_silent", {"node": record.node_id, "port": port, "note": "left to its lease"})

        return Prober(self._reach, targets, changed, never)

    def _hand_over(self) -> None:
        """A departing leader publishes the generation without its own node before it gives up the
        key (once its record says ``leaving``), so the others go on without waiting for an election
        first; nothing when no other node carries the job on."""
        deadline = time.monotonic() + HAND_OVER_WAIT_S
        while True:
            kv = self.store.get(keys.node(self.node_id))
            record = self.reader.parse(NodeRecord, kv) if kv is not None else None
            if record is None or record.leaving or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if record is None or not record.leaving:
            return
        if not any(n.node_id != self.node_id for n in self.members_now()):
            return
        self.decide()

    def _arm_watch(self) -> WatchHandle:
        self._watch_failed.clear()
        self._watch_armed_at = time.monotonic()
        return self.store.watch_prefix("", self._on_event, self._on_watch_error)

    def _on_watch_error(self, err: Exception) -> None:
        """The watch failed: events may be lost until it is made again (decide every second meanwhile)."""
        self._watch_failed.set()
        self._dirty.set()

    def _decide_and_schedule(self) -> float:
        """Decide now; the ``time.monotonic()`` of the next decision no event asks for."""
        made = self.decide()
        now = time.monotonic()
        due = now + (1.0 if self._watch_failed.is_set() else REDECIDE_S)
        if made.wait_until is not None:  # a wall-clock time: a held join, records being put back
            due = min(due, now + max(0.0, made.wait_until - time.time()) + 0.01)
        return due

    def _still_leader(self) -> bool:
        leader = self.store.get(keys.LEADER)
        record = self.reader.parse(LeaderRecord, leader) if leader is not None else None
        return record is not None and record.node_id == self.node_id

    def _quiet(self) -> None:
        """Debounce: return once nothing changed for ``--reconfig-delay``, or at once when no later
        change can alter the decision."""
        while not self.stop_requested.is_set():
            self._dirty.clear()
            if settled(self._read()) or not self._dirty.wait(self.config.reconfig_delay):
                return

    def _on_event(self, event: WatchEvent) -> None:
        if event.key == keys.LEADER:
            self._leader_key_changed.set()
        if (
            event.key.startswith(keys.NODES)
            or "/status/" in event.key
            or "/abandoned/" in event.key
            or "/peer_failed/" in event.key
            or event.key.endswith("/migration")  # a join held back until the switch is done
        ):
            self._dirty.set()

    # ---- reading the store ---------------------------------------------------------------
    def statuses(self, generation: int) -> dict[str, NodeStatus]:
        """Node id -> the status its agent reported for ``generation`` (foreign values left out)."""
        return self._store_read.statuses(generation)

    def members_now(self, include_leaving: bool = False, include_unready: bool = False) -> list[NodeRecord]:
        """The registered, ready nodes in group order (one read of the store)."""
        return members(ordered_nodes(self._store_read.nodes()), include_leaving, include_unready)

    def _read(self) -> Snapshot:
        return self._store_read.snapshot()

    # ---- the decision -----------------------------------------------------------------
    def decide(self) -> Decision:
        """Publish the next generation if the store says one is due (at most one compare-and-set)."""
        snapshot = self._snapshot()
        made = decision.decide(snapshot)
        self._apply(snapshot, made)
        if made.record is None:  # after a publication the snapshot is stale: the next pass prepares
            self._prepare_ready(snapshot)
        return made

    def _prepare_ready(self, snapshot: Snapshot) -> None:
        """While a generation runs, work out in the background the layouts of the memberships its
        likely next events leave (once per generation and set of registered nodes)."""
        likely = decision.likely_layouts(snapshot)
        if not likely:
            return
        assert snapshot.current is not None
        basis = (
            snapshot.current.number,
            tuple(sorted((e.record.node_id, e.record.num_devices) for e in snapshot.nodes)),
        )
        jobs = [functools.partial(decision.prepare_layout, snapshot, ordered, devices) for ordered, devices in likely]
        self.ready.prepare(basis, jobs)

    def _snapshot(self) -> Snapshot:
        """The store's read, with what this leader found out besides it: since when the job's records
        are gone from the store, and which members' agents are gone (:mod:`etc_agent.agent.gone`:
        their liveness ports refused after a reported failure; they leave now, not at their lease)."""
        snapshot = self._read()
        latest = snapshot.latest
        if snapshot.generation_version == 0 and latest is not None:
            if self._vanished_since is None:
                self._vanished_since = time.monotonic()
                self.emit(
                    "store_records_vanished",
                    {"last_generation": latest.number, "note": "the job's generation record is gone from the store"},
                )
            snapshot = replace(snapshot, vanished_for_s=time.monotonic() - self._vanished_since)
        current = snapshot.current
        records = ordered_nodes(snapshot.nodes)
        self._probed = tuple(records)
        if current is not None and current.status == "running":
            self._gone.learn(records)
            gone = self._gone.check(current.number, failure_evidence(snapshot), current.members, records)
            snapshot = replace(snapshot, gone=tuple(gone))
        if self._reach is not None:
            snapshot = replace(snapshot, unreachable=tuple(self._reach.unreachable(r.node_id for r in records)))
        return replace(snapshot, ready_layouts=self.ready.snapshot())

    def _apply(self, snapshot: Snapshot, made: Decision) -> None:
        """Write what ``made`` says: the only place the decision writes the store. The record is
        published only if ``generation`` is still at the version ``snapshot`` read."""
        for node_id in made.drop:
            assert snapshot.current is not None  # gone agents are found in a running generation only
            self.store.delete(keys.node(node_id))
            if node_id in snapshot.gone:
                how = "its liveness port refused a connection after a failure (not waiting for its lease)"
            else:
                assert self._reach is not None  # only the probes find nodes unreachable
                silent_s = self._reach.silent_for(node_id)
                how = (
                    f"its liveness port has not answered for {silent_s:.1f} s: unreachable (not waiting for its lease)"
                )
            self.emit("agent_gone", {"node": node_id, "generation": snapshot.current.number, "how": how})
        record = made.record
        if record is None:
            return
        if self.store.compare_and_set(keys.GENERATION, record.dumps(), made.version):
            self.emit(
                "generation_published",
                {
                    "generation": record.number,
                    "status": record.status,
                    "members": len(record.members),
                    "world_size": record.world_size,
                    "reason": record.reason,
                    **({"layout_ready": record.layout_ready} if record.layout_seconds is not None else {}),
                    **({"layout_s": record.layout_seconds} if record.layout_seconds is not None else {}),
                },
            )
        if record.status == "running" and record.not_resilient:
            self.emit(
                "not_resilient",
                {
                    "generation": record.number,
                    "placement": self.config.placement,
                    "gaps": "; ".join(record.not_resilient),
                },
            )
