"""A newly read generation, acted on: this node's role in it, its workers started, kept or stopped.

The main loop hands every generation it reads for the first time to :meth:`Generations.on_generation`:

- ``succeeded`` / ``failed``: the workers stop, the node's phase is final, the agent exits;
- elastic (worker-API) workers of a member or a sender live on into it (:meth:`continue_workers`);
  a ``waiting`` generation holds them at a step boundary; a spare's warm workers keep waiting;
- otherwise (a plain script): the workers stop, and a member starts new ones with ranks from its
  place in the generation (:meth:`start_workers`).

The first member hosts the workers' store and publishes its address (:meth:`master`).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from etc_agent.agent.node import Node, Superseded
from etc_agent.agent.storehost import WorkerStores
from etc_agent.agent.worker_env import assignments, worker_env
from etc_agent.protocol import keys
from etc_agent.protocol.phases import RESTART_EXIT, Phase
from etc_agent.rendezvous.records import GenerationRecord, MasterRecord, NodeStatus
from etc_agent.rendezvous.store import StoreError

log = logging.getLogger("etc_agent.agent")

MASTER_WAIT_FLOOR_S = 60.0
"""The least a member waits for the first member's workers' store address. That member may still be
importing torch in its fork server to host the store (seconds on a loaded machine), so a short
``join_timeout`` must not end the wait; a first member that died is caught by its lease, and the
newer generation ends the wait at once (:class:`Superseded`)."""

MASTER_POLL_S = 0.05
"""How often a member reads the workers' store address again when no watch event came."""


class StaticStore(Protocol):
    """A store at a fixed address (etcrun's TCPStore on ``--master-port``)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


class Generations:
    """This node's part of each generation (see the module's docstring)."""

    def __init__(self, node: Node, worker_stores: WorkerStores, static_store: StaticStore | None):
        """``static_store``: a TCPStore this agent hosts at a fixed address for the whole run
        (torchrun's static rendezvous on ``--master-port``); generations use it as the workers'
        store while each restart count's key prefix is still unused there."""
        self.node = node
        self.worker_stores = worker_stores
        self.static_store = static_store
        self._static_attempts: set[int] = set()
        """Restart counts whose ``/worker/attempt_<n>`` keys workers already wrote to the static store."""

    def on_generation(self, gen: GenerationRecord) -> int | None:
        """Act on a newly read generation: its status, and this node's role in it (computed once
        here). Returns the agent's exit code when the job ended."""
        node = self.node
        previous = node.generation
        node.generation = gen
        node.emit(
            "generation_seen",
            {"generation": gen.number, "status": gen.status, "members": len(gen.members), "reason": gen.reason},
        )
        if gen.status in ("succeeded", "failed"):
            node.stop_workers(f"job {gen.status}")
            node.state.move(Phase.FINISHED if gen.status == "succeeded" else Phase.FAILED, gen.number)
            if gen.status == "failed":
                node.emit("job_failed", {"reason": gen.reason})
            return 0 if gen.status == "succeeded" else 1
        self.worker_stores.may_host(gen.members, node.node_id)
        role = gen.role_of(node.node_id, with_senders=node.config.migration == "live")
        if node.elastic and node.workers is not None:
            if self._carry_elastic_workers(gen, role, previous):
                return None
        node.stop_workers(f"generation {gen.number}" if previous else "start")
        if gen.status == "running" and role == "member":
            node.state.move(Phase.MIGRATING, gen.number)
            try:
                self.start_workers(gen)
            except Superseded:
                node.generation = previous
                return None
            node.state.move(Phase.RUNNING, gen.number)
        else:
            node.state.move(Phase.SPARE, gen.number)
            if gen.status == "running":
                node.emit("spare", {"generation": gen.number, "members": len(gen.members)})
        return None

    def _carry_elastic_workers(self, gen: GenerationRecord, role: str, previous: GenerationRecord | None) -> bool:
        """Elastic workers into ``gen``; False where they stop instead (this node left the job)."""
        node = self.node
        if gen.status == "waiting":
            if node.state.state.phase == Phase.RUNNING:
                node.state.move(Phase.PENDING, gen.number)
            return True  # workers hold their state at a step boundary until enough nodes return
        if role != "spare":
            # A member's workers go on; a sender's send what they hold, then exit (the node stays, idle).
            node.state.move(Phase.MIGRATING, gen.number)
            try:
                self.continue_workers(gen, role)
            except Superseded:
                node.generation = previous
                return True
            node.state.move(Phase.RUNNING if role == "member" else Phase.DEPARTING, gen.number)
            return True
        if not node.assignments or not node.state.state.ready:
            node.emit("spare", {"generation": gen.number, "members": len(gen.members), "workers": "warm, waiting"})
            return True  # warm standby workers of a node not (yet, or not again) in the job keep waiting
        return False

    def master(self, gen: GenerationRecord) -> MasterRecord:
        """The workers' store of ``gen``: hosted by its first member, read by the others. Store
        errors are waited out (said once) until the deadline: a request lost by a busy store is not
        a reason to give up the generation."""
        node = self.node
        key = keys.master(gen.number)
        unpublished = self._host_master(gen).dumps() if gen.members[0] == node.node_id else None
        deadline = time.monotonic() + max(node.config.join_timeout, MASTER_WAIT_FLOOR_S)
        said = False
        while time.monotonic() < deadline and not node.state.state.stop_requested:
            node.generation_keys_changed.clear()  # before the read: a put after it wakes the wait below
            try:
                if unpublished is not None:
                    node.store.create(key, unpublished)  # False when a lost reply's create had landed
                    unpublished = None
                kv = node.store.get(key)
                master = node.reader.parse(MasterRecord, kv) if kv else None
                if master is not None:
                    return master
                newer = node.read_generation()
            except StoreError as err:
                if not said:
                    node.emit(
                        "store_unreachable", {"error": str(err), "pending": f"generation {gen.number}'s workers' store"}
                    )
                    said = True
                time.sleep(0.2)
                continue
            if newer and newer.number != gen.number:
                raise Superseded()
            # The generation watch sees the address put (its first member's agent saw the generation
            # at about the time this one did); the timeout covers a watch that is down.
            node.generation_keys_changed.wait(MASTER_POLL_S)
        raise TimeoutError(f"generation {gen.number}: member {gen.members[0]} did not publish the master address")

    def _host_master(self, gen: GenerationRecord) -> MasterRecord:
        if self.static_store is not None and gen.restart_count not in self._static_attempts:
            # Static rendezvous: MASTER_PORT is --master-port, as under torchrun, and torch's
            # agent-store clients keep each restart's keys apart (/worker/attempt_<restart count>).
            self._static_attempts.add(gen.restart_count)
            return MasterRecord(addr=self.static_store.host, port=self.static_store.port)
        # Like torchrun's c10d agents: the first member hosts the workers' store
        # (etc_agent.agent.storehost).
        addr, port = self.worker_stores.new()
        return MasterRecord(addr=addr, port=port)

    def prepare_assignments(self, gen: GenerationRecord, master: MasterRecord) -> None:
        """What each local worker is in ``gen``: served to elastic workers over the control channel."""
        node = self.node
        trained = False
        if gen.started:
            try:
                trained = node.store.get(keys.TRAINED) is not None
            except StoreError:
                trained = True  # unknown: never start fresh over state that may exist
        node.assignments = assignments(node, gen, master, trained)
        rank0 = [local for local, a in node.assignments.items() if a.rank == 0]
        node.control_keys.serving(gen.number, rank0[0] if rank0 else None)

    def start_workers(self, gen: GenerationRecord) -> None:
        node = self.node
        index = gen.members.index(node.node_id)
        master = self.master(gen)
        offset = gen.transport_rank(node.node_id, 0)
        nproc = node.config.nproc_per_node
        envs = [worker_env(node, gen, master, local_rank) for local_rank in range(nproc)]
        self.prepare_assignments(gen, master)
        node.workers = node.make_workers(envs, node.run_dir / f"attempt_{gen.number}")
        node.report_afresh(gen, NodeStatus(state="running"))
        node.emit(
            "workers_started",
            {
                "generation": gen.number,
                "group_rank": index,
                "world_size": gen.world_size,
                "ranks": f"{offset}-{offset + nproc - 1}",
                "restart_count": gen.restart_count,
            },
        )

    def continue_workers(self, gen: GenerationRecord, role: str) -> None:
        """Elastic workers stay alive into ``gen``; dead ones are started again (they join as receivers).

        With ``--migration checkpoint`` the workers save and exit (code ``RESTART_EXIT``) at the agreed
        step instead; once they are gone, fresh ones start and load (the checkpoint baseline)."""
        node = self.node
        assert node.workers is not None  # called for a node whose workers live on
        master = self.master(gen)
        self.prepare_assignments(gen, master)
        if node.config.migration == "checkpoint":
            deadline = time.monotonic() + max(node.config.shutdown_timeout, 60.0)
            while any(code is None for code in node.workers.poll().values()) and time.monotonic() < deadline:
                time.sleep(0.02)
            node.workers.stop(node.config.shutdown_timeout)
        restarted = self._restart_dead_workers(gen, master) if node.node_id in gen.members else []
        node.report_afresh(gen, NodeStatus(state="running"))
        node.emit(
            "workers_continue",
            {
                "generation": gen.number,
                "world_size": gen.world_size,
                "parallel": gen.parallel,
                "role": role,
                "restarted_local_ranks": restarted,
                "reason": gen.reason,
            },
        )

    def _restart_dead_workers(self, gen: GenerationRecord, master: MasterRecord) -> list[int]:
        node = self.node
        assert node.workers is not None
        codes = node.workers.poll()
        died = {r: c for r, c in codes.items() if c not in (None, 0, RESTART_EXIT)}
        if died and node.config.migration == "live":
            # Died between the last look and this generation: a crash restart too, said as one.
            node.num_crash_restarts += 1
            log.error(
                "worker failure (generation %d):\n%s",
                node.generation.number if node.generation else gen.number,
                node.workers.failure_report(node.script_name()),
            )
            node.emit(
                "workers_failed",
                {
                    "generation": gen.number,
                    "exit_codes": died,
                    "restarting": sorted(died),
                    "action": f"restarting local ranks {sorted(died)} into generation {gen.number} as receivers "
                    f"({node.num_crash_restarts}/{node.config.node_crash_restarts})",
                },
            )
        restarted = []
        for local_rank, code in codes.items():
            if code is not None:
                env = worker_env(node, gen, master, local_rank)
                node.workers.restart(local_rank, env, node.run_dir / f"attempt_{gen.number}")
                restarted.append(local_rank)
        return restarted
