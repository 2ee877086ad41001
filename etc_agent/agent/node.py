"""What every room of the agent shares: who this node is, what it serves, and how it writes to the store.

:class:`Node` is the node's identity and its shared, mutable view of the job (the generation it
serves, the newest one read, its workers and what they said); its methods are the node's own reads
and writes of the membership store (its record, its status in a generation, markers the workers
report). The rooms that act on it (:mod:`generations`, :mod:`supervision`, :mod:`leaving`,
:mod:`control`) each get the one ``Node``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from etc_agent.agent.attached import AttachedWorkers, Attachments
from etc_agent.agent.config import AgentConfig
from etc_agent.agent.controlauth import ControlKeys
from etc_agent.agent.forkserver import ForkServer
from etc_agent.agent.node_state import NodeState, NodeStateMachine
from etc_agent.agent.records import RecordReader
from etc_agent.agent.workers import WorkerGroup, WorkerSpec
from etc_agent.protocol import keys
from etc_agent.protocol.control import Assignment
from etc_agent.rendezvous.records import AbandonRecord, GenerationRecord, NodeRecord, NodeStatus
from etc_agent.rendezvous.store import Lease, MembershipStore, StoreError
from etc_agent.utils.liveness import LivenessPort

Emit = Callable[[str, dict], None]


@dataclass
class WorkerContacts:
    """What this node's workers said on the control channel, by local rank."""

    seen: dict[int, float] = field(default_factory=dict)
    """When each last spoke (``time.monotonic``): a worker silent too long is hung."""
    pid: dict[int, int] = field(default_factory=dict)
    """The pid that said hello: only a process that spoke can be judged silent."""
    hellos: set[int] = field(default_factory=set)
    """Local ranks whose worker-API process said hello (a warm joiner waits for all of them)."""
    served: dict[int, int] = field(default_factory=dict)
    """The newest generation whose assignment each process asked for (sidecar: where a replacement
    of that process starts looking)."""


class LoopPasses:
    """The agent's main-loop passes, counted. What the agent serves its workers changes in a pass
    (a new generation, assignments, readiness) or is seen by the next one (within
    ``--monitor-interval``: a fence, the finished marker), so a worker's held poll looks again after
    each pass instead of the worker asking again every 0.1 s."""

    def __init__(self) -> None:
        self._number = 0
        self._changed = threading.Condition()

    @property
    def number(self) -> int:
        return self._number

    def passed(self) -> None:
        """A pass ended (called by the main loop only)."""
        with self._changed:
            self._number += 1
            self._changed.notify_all()

    def wait_after(self, number: int, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for a pass after pass ``number``; the newest pass's number."""
        with self._changed:
            self._changed.wait_for(lambda: self._number > number, timeout_s)
            return self._number


class Superseded(Exception):
    """A newer generation appeared while this one was being set up."""


@dataclass
class Node:
    """One node of the job, as every room of its agent sees it."""

    config: AgentConfig
    spec: WorkerSpec
    store: MembershipStore
    node_id: str
    host: str
    emit: Emit
    run_dir: Path
    """This agent's directory of the run (its log, its workers' logs by attempt)."""
    state: NodeStateMachine
    reader: RecordReader
    control_keys: ControlKeys
    wake: threading.Event = field(default_factory=threading.Event)
    """Set to run the main loop's next pass now (a generation changed, a worker detached)."""
    generation_keys_changed: threading.Event = field(default_factory=threading.Event)
    """Set at every change under the generation keys the watch sees (the current generation, a
    generation's workers' store address): a member waiting for that address reads it again at once
    (:meth:`etc_agent.agent.generations.Generations.master`)."""
    passes: LoopPasses = field(default_factory=LoopPasses)
    contacts: WorkerContacts = field(default_factory=WorkerContacts)
    attachments: Attachments = field(default_factory=Attachments)
    workers: WorkerGroup | AttachedWorkers | None = None
    generation: GenerationRecord | None = None
    """The generation this node serves."""
    latest: GenerationRecord | None = None
    """The newest generation read (kept when the record vanishes: the leader goes on after it)."""
    assignments: dict[int, Assignment] = field(default_factory=dict)
    """What each local worker is in the generation this node serves (rank, group, store address)."""
    elastic: bool = False
    """Set when a worker says hello through the worker API: workers then live across generations
    (always for a sidecar: only worker-API processes can attach)."""
    lease: Lease | None = None
    """Granted by :meth:`register`, before the threads that use it start."""
    control_address: str = ""
    liveness: LivenessPort | None = None
    forkserver: ForkServer | None = None
    """Workers (and the workers' stores) fork from it where the start method is ``forkserver``."""
    fenced: bool = False
    """This node lost the store while its peers reach it (:mod:`etc_agent.agent.fence`): its workers
    train no step and commit no checkpoint until the store answers again."""
    revisions: dict[int, int] = field(default_factory=dict)
    """Generation number -> the store revision its record was published at (a checkpoint commit
    made in that generation is fenced on it, :mod:`etc_agent.agent.commits`)."""
    num_crash_restarts: int = 0
    """Crashed workers this node restarted in a live job (bounded by ``--max-restarts``)."""
    _reported: tuple[int, str] | None = None
    _unreported: tuple[GenerationRecord, NodeStatus] | None = None
    _finished_unsaid: str | None = None
    """The finished marker a store outage kept from the store."""
    _finished_cache: tuple[float, bool] = (0.0, False)
    """(when checked, whether the store's ``finished`` marker exists), read at most once a second (every
    held poll of every worker asks after each main-loop pass)."""

    # ---- the node record ------------------------------------------------------------
    def record(self, state: NodeState | None = None) -> NodeRecord:
        state = state or self.state.state
        return NodeRecord(
            node_id=self.node_id,
            host=self.host,
            num_devices=self.config.nproc_per_node,
            pid=os.getpid(),
            node_rank_hint=self.config.node_rank,
            leaving=state.leaving,
            restarting=sorted(state.restarting),
            crashed_in=state.crashed_in if state.restarting else None,
            probe_port=self.liveness.port if self.liveness is not None else None,
            ready=state.ready,
        )

    def register(self) -> None:
        self.lease = self.store.grant_lease(self.config.lease_ttl)
        self.store.put(keys.node(self.node_id), self.record().dumps(), lease=self.lease)

    def put_record(self, state: NodeState | None = None) -> None:
        self.store.put(keys.node(self.node_id), self.record(state).dumps(), lease=self.lease)

    def others_go_on(self) -> bool:
        """Whether another node that is not leaving is registered (True when the store cannot tell)."""
        try:
            records = [self.reader.parse(NodeRecord, kv) for kv in self.store.get_prefix(keys.NODES)]
        except StoreError:
            return True
        return any(r is not None and r.node_id != self.node_id and not r.leaving for r in records)

    # ---- generations ----------------------------------------------------------------
    def read_generation(self) -> GenerationRecord | None:
        kv = self.store.get(keys.GENERATION)
        gen = self.reader.parse(GenerationRecord, kv) if kv is not None else None
        if gen is not None and kv is not None and gen.number not in self.revisions:
            self.revisions[gen.number] = kv.mod_revision
            for old in [n for n in self.revisions if n < gen.number - 8]:
                del self.revisions[old]
        return gen

    def superseded(self, gen: GenerationRecord) -> bool:
        """Whether the store already holds a newer generation than ``gen`` (read again: workers that
        failed because a departing peer's workers stopped are that generation's to restart, not a
        failure of ``gen``)."""
        try:
            latest = self.read_generation()
        except StoreError:
            return False
        return latest is not None and latest.number != gen.number

    def report(self, gen: GenerationRecord, status: NodeStatus) -> None:
        """This node's status in ``gen``, once per state; through a store outage it is kept and
        :meth:`report_pending` sends it again."""
        if self._reported == (gen.number, status.state):
            return
        try:
            self.store.put(keys.status(gen.number, self.node_id), status.dumps(), lease=self.lease)
        except StoreError as err:
            self.emit("store_unreachable", {"error": str(err), "pending": f"status {status.state}"})
            self._unreported = (gen, status)
            return
        self._unreported = None
        self._reported = (gen.number, status.state)

    def report_afresh(self, gen: GenerationRecord, status: NodeStatus) -> None:
        """``status`` in ``gen`` even where the same state was reported before (workers started anew)."""
        self._reported = None
        self.report(gen, status)

    def report_pending(self) -> None:
        """What a store outage kept from the store, written once it answers: the finished marker and
        this node's status in the generation it serves."""
        if self._finished_unsaid is not None and self.put_or_say(
            keys.FINISHED, self._finished_unsaid, "finished marker"
        ):
            self._finished_unsaid = None
        pending = self._unreported
        if pending is not None and self.generation is not None and pending[0].number == self.generation.number:
            self.report(*pending)

    def abandon(self, generation: int, reason: str) -> None:
        key = keys.abandon(generation, self.node_id)
        try:
            if self.store.get(key) is None:
                self.store.put(key, AbandonRecord(generation=generation, reason=reason).dumps())
                self.emit("generation_abandoned", {"generation": generation, "reason": reason})
        except StoreError as err:
            self.emit("store_unreachable", {"error": str(err), "pending": f"abandon generation {generation}"})

    # ---- markers ----------------------------------------------------------------------
    def put_or_say(self, key: str, value: str, what: str) -> bool:
        """Write a marker or record the workers reported; through a store outage, say what is pending."""
        try:
            self.store.put(key, value)
            return True
        except StoreError as err:
            self.emit("store_unreachable", {"error": str(err), "pending": what})
            return False

    def mark_finished(self, step: int, generation: int) -> None:
        """The last step is done; through a store outage the marker waits for :meth:`report_pending`
        (a finished job is reported finished once the store answers, never as failed)."""
        value = json.dumps({"step": step, "generation": generation})
        if not self.put_or_say(keys.FINISHED, value, "finished marker"):
            self._finished_unsaid = value
        self._finished_cache = (time.monotonic(), True)

    def job_finished(self) -> bool:
        checked_at, value = self._finished_cache
        if value or time.monotonic() - checked_at < 1.0:
            return value
        try:
            value = self.store.get(keys.FINISHED) is not None
        except StoreError:
            value = False
        self._finished_cache = (time.monotonic(), value)
        return value

    # ---- workers ------------------------------------------------------------------------
    def stop_workers(self, why: str, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.workers is not None:
            self.emit("workers_stopping", {"reason": why, **({"signal": sig.name} if sig != signal.SIGTERM else {})})
            self.workers.stop(self.config.shutdown_timeout, sig)
            self.workers = None

    def make_workers(self, envs: list[dict[str, str]], attempt_dir: Path) -> WorkerGroup | AttachedWorkers:
        """This node's workers: started here, or (sidecar) the processes that attach under these local ranks."""
        if self.config.sidecar:
            return AttachedWorkers(self.attachments, [int(env["ETC_AGENT_LOCAL_RANK"]) for env in envs])
        return WorkerGroup(self.spec, envs, attempt_dir, forkserver=self.forkserver)

    def request_departure(self, cause: signal.Signals | None = None, asked: bool = False) -> None:
        """Planned departure: leave the membership, let the others go on without this node (a second
        signal while leaving: stop now). ``asked``: the workers' launcher asked (sidecar mode)."""
        self.state.leave(cause, asked)
        self.wake.set()

    def script_name(self) -> str:
        return self.spec.entrypoint[0] if self.spec.entrypoint else "workers"
