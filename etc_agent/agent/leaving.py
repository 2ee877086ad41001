"""A planned departure (SIGTERM/SIGINT, or a node out of crash restarts), run to its end.

The departure is announced before any local worker stops: the node record says ``leaving``; a
member with running workers waits (bounded) for the leader to publish the generation without it
(worker-API workers send their state into it), and only then are its workers stopped, so the
others' restart is a membership change, never a failure. What the departure led to decides the
exit code (:mod:`etc_agent.agent.departure`, pure).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from etc_agent.agent.departure import AfterAck, DepartureOutcome, after_acknowledgement, departure_verdict
from etc_agent.agent.node import Node, Superseded
from etc_agent.protocol import keys
from etc_agent.protocol.phases import RESTART_EXIT, Phase
from etc_agent.rendezvous.records import GenerationRecord, NodeStatus
from etc_agent.rendezvous.store import StoreError

DEPARTURE_MARGIN_S = 10.0
"""Beyond the reconfiguration delay and a lease: how long a departing node waits for the leader."""

Statuses = Callable[[int], dict[str, NodeStatus]]
"""The members' statuses in a generation (the leader's reading of them)."""
ContinueWorkers = Callable[[GenerationRecord, str], None]
"""Elastic workers into a generation in a role (``Generations.continue_workers``)."""


class Leaving:
    def __init__(self, node: Node, statuses: Statuses, continue_workers: ContinueWorkers):
        self.node = node
        self._statuses = statuses
        self._continue_workers = continue_workers

    def depart(self) -> int:
        """Run the departure (see the module's docstring); returns the agent's exit code."""
        node = self.node
        node.emit("departing", {"shutdown_timeout": node.config.shutdown_timeout})
        node.state.move(Phase.DEPARTING, node.generation.number if node.generation else -1)
        try:
            node.put_record()
        except StoreError as err:
            node.emit("store_unreachable", {"error": str(err)})
        had_workers = (
            node.workers is not None
            and node.generation is not None
            and node.node_id in node.generation.members
            and any(code is None for code in node.workers.poll().values())
        )
        ack = None
        if had_workers:
            ack = self._await_acknowledgement()
            if ack is not None and node.elastic:
                self._send_state(ack)
        # As torchrun does, workers get the signal the agent got (SIGUSR1 of a Slurm preemption, say).
        cause = node.state.state.cause
        node.stop_workers("planned departure", cause or signal.SIGTERM)
        verdict = departure_verdict(self._outcome(had_workers, ack))
        node.emit(
            "departed" if verdict.exit_code == 0 else "job_unfinished",
            {"exit_code": verdict.exit_code, "reason": verdict.reason, **({"cause": cause.name} if cause else {})},
        )
        try:
            node.store.delete(keys.node(node.node_id))
        except StoreError:
            pass
        return verdict.exit_code

    def _outcome(self, had_workers: bool, ack: GenerationRecord | None) -> DepartureOutcome:
        """What the departure led to; a running acknowledging generation is followed until its
        members run in it, bounded like the wait for it."""
        node = self.node
        after_ack: AfterAck = "unknown"
        if ack is not None and ack.status == "running":
            after_ack = self._follow(ack)
        try:
            latest = node.read_generation()
            finished = node.job_finished() or (latest is not None and latest.status == "succeeded")
        except StoreError:
            finished = False
        return DepartureOutcome(
            finished=finished,
            had_workers=had_workers,
            acknowledged=ack,
            others_registered=node.others_go_on(),
            after_ack=after_ack,
        )

    def _follow(self, ack: GenerationRecord) -> AfterAck:
        node = self.node
        deadline = time.monotonic() + self.acknowledgement_wait_s()
        while time.monotonic() < deadline and not node.state.state.stopping_now:
            try:
                latest = node.read_generation()
                reported = {member: status.state for member, status in self._statuses(ack.number).items()}
            except StoreError:
                latest, reported = None, {}
            seen = after_acknowledgement(ack, latest, reported)
            if seen is not None:
                return seen
            node.wake.wait(0.2)
            node.wake.clear()
        return "unknown"

    def acknowledgement_wait_s(self) -> float:
        """What it takes a leader to publish a generation: the reconfiguration delay, a new leader's
        election after a lease lapses, and a margin."""
        return self.node.config.reconfig_delay + self.node.config.lease_ttl + DEPARTURE_MARGIN_S

    def _await_acknowledgement(self) -> GenerationRecord | None:
        """The first generation after the one this node serves, which the leader publishes once it
        read this node's record marked leaving; None when no other node carries the job on, this
        node's workers all ended meanwhile, a second signal came, or none came in time (said)."""
        node = self.node
        assert node.generation is not None and node.workers is not None
        wait_s = self.acknowledgement_wait_s()
        deadline = time.monotonic() + wait_s
        next_check = time.monotonic()
        while not node.state.state.stopping_now:
            now = time.monotonic()
            if now >= deadline:
                note = "no generation without this node was published; its workers stop now"
                node.emit("departure_unacknowledged", {"waited_s": round(wait_s, 1), "note": note})
                return None
            if now >= next_check:
                next_check = now + 1.0
                if not node.others_go_on():
                    node.emit("departure_alone", {"note": "no other node carries the job on"})
                    return None
            try:
                gen = node.read_generation()
            except StoreError:
                gen = None
            if gen is not None and gen.number != node.generation.number:
                node.latest = gen
                node.emit(
                    "departure_acknowledged",
                    {"generation": gen.number, "status": gen.status, "members": len(gen.members), "reason": gen.reason},
                )
                return gen
            if all(code is not None for code in node.workers.poll().values()):
                return None
            node.wake.wait(0.2)
            node.wake.clear()
        return None

    def _send_state(self, gen: GenerationRecord) -> None:
        """Elastic workers of a departing node send their shards in ``gen``, the generation that drops
        this node, then exit; bounded by ``shutdown_timeout``. Without it the node leaves as a crash
        would: the survivors restore its state from replicas."""
        node = self.node
        assert node.workers is not None  # depart() sends state only from a node that had workers
        sending = self._into_sending_generation(gen)
        if sending is None:
            return
        node.generation = sending
        until = time.monotonic() + node.config.shutdown_timeout
        while time.monotonic() < until and not node.state.state.stopping_now:
            codes = node.workers.poll()
            died = {r: c for r, c in codes.items() if c not in (None, 0, RESTART_EXIT)}
            if died:
                # The receivers lost a source mid-migration: that generation must be planned again
                # (from replicas), without this node; its other senders are of no use now.
                node.abandon(
                    sending.number,
                    f"sender {node.node_id} local ranks {sorted(died)} exited {sorted(set(died.values()))} "
                    "before their state was sent",
                )
                node.emit("state_not_sent", {"generation": sending.number, "exit_codes": codes})
                return
            if all(code is not None for code in codes.values()):
                node.emit("state_sent", {"generation": sending.number, "exit_codes": codes})
                return
            time.sleep(0.05)
        node.emit("departure_timeout", {"generation": sending.number, "seconds": node.config.shutdown_timeout})

    def _into_sending_generation(self, gen: GenerationRecord) -> GenerationRecord | None:
        """The workers told to send in ``gen`` (or the newer one that superseded it while they were
        being told); None where this node sends in none."""
        node = self.node
        while True:
            if gen.status != "running" or node.node_id not in gen.senders:
                return None
            try:
                self._continue_workers(gen, "sender")
                return gen
            except Superseded:
                try:
                    newer = node.read_generation()
                except StoreError:
                    return None
                if newer is None:
                    return None
                gen = newer
