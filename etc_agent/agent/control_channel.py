"""The control channel of this node's workers (``ETC_AGENT_ADDR``): one handler per request type.

Requests are signed with one worker's key, validated against :mod:`etc_agent.protocol.control` (one
model per ``op``) and checked against what this agent knows (:mod:`etc_agent.agent.controlauth`)
before a handler sees them. Handlers run in the server's connection threads: they read the
:class:`~etc_agent.agent.node.Node`, write markers and records the workers report to the store, and
answer with the reply models.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from etc_agent.agent.commits import Commits
from etc_agent.agent.controlauth import NotAllowed
from etc_agent.agent.node import Node
from etc_agent.agent.worker_env import node_env
from etc_agent.agent.workers import WorkerGroup
from etc_agent.protocol import keys
from etc_agent.protocol.control import (
    Ack,
    AssignmentQuery,
    AssignmentReply,
    Attach,
    CommitCheckpoint,
    ControlReply,
    ControlRequest,
    Exiting,
    Fatal,
    Finished,
    GenerationQuery,
    GenerationReply,
    Heartbeat,
    Hello,
    HelloReply,
    Leave,
    Migration,
    PeerFailed,
    SwitchFailed,
    Trained,
)
from etc_agent.rendezvous.records import NodeStatus, PeerFailureRecord
from etc_agent.rendezvous.store import StoreError
from etc_agent.utils import auth

_SIDECAR_ENV_OMITS = ("LOCAL_RANK", "ETC_AGENT_LOCAL_RANK", "OMP_NUM_THREADS", auth.TOKEN_ENV)
"""What a sidecar's worker keeps of its own launcher's environment."""


class ControlChannel:
    def __init__(
        self,
        node: Node,
        notify_peer_failure: Callable[[], None],
        commits: Commits,
        progress: Callable[[int, int, float | None, int | None], None] | None = None,
    ):
        """``notify_peer_failure``: wakes this node's leader loop (the leader may be the node whose
        worker died); ``commits``: the node's checkpoint commits; ``progress(local_rank, step,
        step_s, data position)``: what a worker's poll says of its training (the metrics)."""
        self.node = node
        self.commits = commits
        self._progress = progress
        self._notify_peer_failure = notify_peer_failure
        self._elastic_announced = False
        self._handlers: dict[type, Callable[[Any], ControlReply]] = {
            Hello: self._on_hello,
            Heartbeat: self._on_hello,
            Attach: self._on_attach,
            Exiting: self._on_exiting,
            AssignmentQuery: self._on_assignment_query,
            SwitchFailed: self._on_switch_failed,
            PeerFailed: self._on_peer_failed,
            Fatal: self._on_fatal,
            Finished: self._on_finished,
            Trained: self._on_trained,
            Migration: self._on_migration,
            GenerationQuery: self._on_generation_query,
            Leave: self._on_leave,
            CommitCheckpoint: self.commits.request,
        }

    def handle(self, req: ControlRequest, key_id: str) -> dict:
        """One request of a worker, checked (see the module's docstring), answered."""
        node = self.node
        local_rank = getattr(req, "local_rank", 0)
        if local_rank >= node.config.nproc_per_node:
            raise ValueError(
                f"local_rank {local_rank} is not a worker of this node (--nproc-per-node {node.config.nproc_per_node})"
            )
        try:
            node.control_keys.check(req, key_id, self._started_pid)
        except NotAllowed as err:
            node.emit("control_refused", {"key": key_id, "op": req.op, "reason": str(err)})
            raise
        return self._handlers[type(req)](req).model_dump()

    def _started_pid(self, local_rank: int) -> int | None:
        """The pid of the process this agent started for ``local_rank`` (None: none, or a sidecar)."""
        workers = self.node.workers
        if not isinstance(workers, WorkerGroup):
            return None
        return workers.pids().get(local_rank)

    def _on_hello(self, req: Hello | Heartbeat) -> HelloReply:
        node = self.node
        # A new process under a local rank another process already served replaces it (sidecar: the
        # other launcher restarted it); it joins the generation after the one its predecessor ran.
        replacement = isinstance(req, Hello) and node.contacts.pid.get(req.local_rank) not in (None, req.pid)
        node.contacts.seen[req.local_rank] = time.monotonic()
        if isinstance(req, Hello) and req.pid is not None:
            node.contacts.pid[req.local_rank] = req.pid
        if isinstance(req, Hello) and req.elastic:
            self._announce_elastic()
            node.elastic = True
            node.contacts.hellos.add(req.local_rank)
            if req.local_rank in node.state.state.restarting:
                node.wake.set()  # the node rejoins now, not at the main loop's next pass
        reply = HelloReply(node_id=node.node_id, generation=node.generation.number if node.generation else None)
        if node.config.sidecar and isinstance(req, Hello):
            # What etcrun would have put in its children's environment.
            number = node.generation.number if node.generation else 0
            if replacement and req.local_rank in node.contacts.served:
                # Its predecessor last saw that generation: the replacement joins a later one.
                number = node.contacts.served.pop(req.local_rank) + 1
            env = {k: v for k, v in node_env(node, req.local_rank, number).items() if k not in _SIDECAR_ENV_OMITS}
            reply = reply.model_copy(update={"sidecar": True, "env": env})
        return reply

    def _announce_elastic(self) -> None:
        """The leader reads it: a live job's crash is handled without ending the job."""
        if self._elastic_announced:
            return
        try:
            self.node.store.put(keys.ELASTIC, json.dumps({"node": self.node.node_id}))
            self._elastic_announced = True
        except StoreError:
            pass

    def _on_attach(self, req: Attach) -> Ack:
        if not self.node.config.sidecar:
            raise ValueError("attach is for workers of an etc-agent sidecar; this agent starts its own workers")
        return Ack(hold=True)

    def _on_exiting(self, req: Exiting) -> Ack:
        self.node.attachments.report_exit(req.local_rank, req.pid, req.code)
        return Ack()

    def _on_assignment_query(self, req: AssignmentQuery) -> AssignmentReply:
        """The worker's poll. With ``known`` (the digest of the reply it holds) the answer waits, up
        to ``hold_s``, until the reply differs: it is looked at again after each main-loop pass, so
        a change reaches the worker in the pass that made it, and an idle worker asks about once
        per ``hold_s`` instead of every 0.1 s."""
        node = self.node
        node.contacts.seen[req.local_rank] = time.monotonic()
        if self._progress is not None and req.step is not None:
            self._progress(req.local_rank, req.step, req.step_s, req.data_position)
        deadline = time.monotonic() + req.hold_s
        seen_pass = node.passes.number
        reply = self._assignment_reply(req.local_rank)
        while req.known is not None and reply.digest == req.known:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            seen_pass = node.passes.wait_after(seen_pass, left)
            reply = self._assignment_reply(req.local_rank)
        node.contacts.seen[req.local_rank] = time.monotonic()
        return reply

    def _assignment_reply(self, local_rank: int) -> AssignmentReply:
        node = self.node
        latest = node.latest
        served = node.assignments.get(local_rank)
        if served is not None:
            node.contacts.served[local_rank] = served.generation
        return AssignmentReply(
            latest=latest.number if latest else None,
            latest_status=latest.status if latest else None,
            assignment=served,
            finished=node.job_finished(),
            standby=not node.assignments or not node.state.state.ready,
            stop=node.attachments.stop_requested(local_rank),
            unreachable_hosts=latest.unreachable_hosts if latest else [],
            fenced=node.fenced,
        ).with_digest()

    def _on_switch_failed(self, req: SwitchFailed) -> Ack:
        self.node.abandon(req.generation, f"{self.node.node_id} local_rank {req.local_rank}: {req.reason[:300]}")
        return Ack()

    def _on_peer_failed(self, req: PeerFailed) -> Ack:
        node = self.node
        key = keys.peer_failure(req.generation, node.node_id)
        try:
            if node.store.get(key) is None:
                record = PeerFailureRecord(generation=req.generation, reason=req.reason)
                node.store.put(key, record.dumps(), lease=node.lease)
                node.emit(
                    "peer_failure", {"generation": req.generation, "local_rank": req.local_rank, "reason": req.reason}
                )
        except StoreError as err:
            pending = f"peer failure in generation {req.generation}"
            node.emit("store_unreachable", {"error": str(err), "pending": pending})
        self._notify_peer_failure()
        return Ack()

    def _on_fatal(self, req: Fatal) -> Ack:
        gen = self.node.generation
        if gen is not None:
            self.node.report(gen, NodeStatus(state="failed", message=req.reason, fatal=True))
        self.node.emit("fatal", {"reason": req.reason[:500]})
        return Ack()

    def _on_finished(self, req: Finished) -> Ack:
        # The training ranks completed the last step: processes still on their way into a
        # generation (a late joiner) exit instead of waiting for peers that are gone.
        self.node.mark_finished(req.step, req.generation)
        self.node.emit("training_finished", {"step": req.step, "generation": req.generation})
        return Ack()

    def _on_trained(self, req: Trained) -> Ack:
        self.node.put_or_say(keys.TRAINED, json.dumps({"step": req.step, "node": self.node.node_id}), "trained marker")
        return Ack()

    def _on_migration(self, req: Migration) -> Ack:
        record = req.record
        if self.node.put_or_say(keys.migration(record.generation), record.dumps(), "migration record"):
            self.node.put_or_say(keys.LAST_MIGRATION, record.dumps(), "migration record")
        self.node.emit("migration", record.model_dump(exclude={"schema_version"}))
        return Ack()

    def _on_leave(self, req: Leave) -> Ack:
        self.node.emit("departure_requested", {"by": "workers launcher", "reason": req.reason[:200]})
        self.node.request_departure(None, asked=True)
        return Ack()

    def _on_generation_query(self, req: GenerationQuery) -> GenerationReply:
        node = self.node
        return GenerationReply(
            node_id=node.node_id, running=node.generation, latest=node.latest, leaving=node.state.state.leaving
        )

    def attached(self, req: Attach, sock: Any, reader: Any) -> None:
        """A sidecar's worker holds its attach connection while it lives (runs in the connection's thread)."""
        node = self.node
        attachment = node.attachments.attach(req.local_rank, req.pid, sock)
        node.emit("worker_attached", {"local_rank": req.local_rank, "pid": req.pid})
        try:
            while reader.read(4096):
                pass
        except OSError:
            pass
        node.attachments.closed(attachment)
        node.emit(
            "worker_detached",
            {
                "local_rank": req.local_rank,
                "pid": req.pid,
                "exit_code": attachment.exit_code,
                "reported": attachment.reported is not None,
            },
        )
        node.wake.set()
