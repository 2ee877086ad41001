"""The per-node agent: membership, leader election, the generation protocol, worker supervision.

Every agent registers a :class:`NodeRecord` under its lease and keeps the lease alive. One agent
wins the ``leader`` key; it watches the members and the workers' statuses and, after
``reconfig_delay`` without further change, publishes the next :class:`GenerationRecord` with
compare-and-set. Every agent acts only on the generation it reads from the store:

- ``running`` and it is a member: (re)start its workers with ranks from its position;
- ``waiting`` (fewer than ``min_nodes``) or not a member: stop its workers and wait;
- ``failed`` / ``succeeded``: stop and exit.

This is the torchrun-compatible mode (workers restarted on every membership change or failure,
failures counted against ``max_restarts``). Workers that use the worker API are kept alive across
generations instead (the worker API issue builds on this).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etc_agent.agent.config import AgentConfig
from etc_agent.agent.console import CONSOLE_ATTR, event_level
from etc_agent.agent.controlauth import ControlKeys, NotAllowed
from etc_agent.agent.departure import AfterAck, DepartureOutcome, after_acknowledgement, departure_verdict
from etc_agent.agent.endwatch import EndWatch
from etc_agent.agent.forkserver import ForkServer
from etc_agent.agent.leader import Leader
from etc_agent.agent.records import RecordReader
from etc_agent.agent.storehost import WorkerStores
from etc_agent.agent.workers import AttachedWorkers, Attachments, WorkerGroup, WorkerSpec
from etc_agent.protocol.control import (
    CONTROL_REQUEST,
    Assignment,
    AssignmentQuery,
    AssignmentReply,
    Attach,
    ControlRequest,
    Exiting,
    Fatal,
    Finished,
    GenerationQuery,
    Heartbeat,
    Hello,
    HelloReply,
    Migration,
    PeerFailed,
    SwitchFailed,
    Trained,
)
from etc_agent.protocol.phases import RESTART_EXIT, Phase, PhaseTracker
from etc_agent.rendezvous.records import (
    AbandonRecord,
    GenerationRecord,
    MasterRecord,
    NodeRecord,
    NodeStatus,
    PeerFailureRecord,
)
from etc_agent.rendezvous.store import Lease, LeaseExpired, MembershipStore, StoreError, WatchHandle
from etc_agent.utils import auth
from etc_agent.utils.jsonline import JsonLineServer, parse_address
from etc_agent.utils.liveness import LivenessPort

log = logging.getLogger("etc_agent.agent")
_STDOUT_LOCK = threading.Lock()
"""JSON events come from the main, leader and keepalive threads: each is written whole."""


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


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        spec: WorkerSpec,
        store: MembershipStore,
        emit: Callable[[str, dict], None] | None = None,
        workers_store=None,
    ):
        """``workers_store``: a TCPStore this agent hosts at a fixed address for the whole run
        (torchrun's static rendezvous on ``--master-port``); generations use it as the workers'
        store while each restart count's key prefix is still unused there."""
        self.config, self.spec, self.store = config, spec, store
        self._static_store = workers_store
        self._static_attempts: set[int] = set()
        """Restart counts whose ``/worker/attempt_<n>`` keys workers already wrote to the static store."""
        self.node_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.host = config.local_addr or socket.getfqdn()
        self.emit = emit or self._log_event
        self.workers: WorkerGroup | AttachedWorkers | None = None
        self._forkserver: ForkServer | None = None
        self.generation: GenerationRecord | None = None
        self.restart_count = 0
        self.leaving = threading.Event()
        self.stop_requested = threading.Event()
        self.hard_stop = threading.Event()
        """Set by a second SIGTERM/SIGINT: stop everything now, the embedded store included."""
        self.signal_received: signal.Signals | None = None
        """The first signal that asked this node to leave (reported when that ends an unfinished job)."""
        self._wake = threading.Event()
        self._lease: Lease | None = None
        """Granted by ``_register()`` in ``run()``, before the threads that use it start."""
        self._control: JsonLineServer
        """The workers' control channel (``ETC_AGENT_ADDR``), opened in ``run()``."""
        self._reported: tuple[int, str] | None = None
        self._log_root = Path(spec.log_dir) if spec.log_dir else Path(tempfile.mkdtemp(prefix="etcrun-"))
        self._run_dir = self._log_root / f"{config.run_id}_{self.node_id}"
        self.log_file = self._run_dir / "agent.log"
        """Every event of this agent (etcrun writes it; the console shows those at its --log-level)."""
        self._threads: list[threading.Thread] = []
        self._worker_stores: WorkerStores | None = None
        self._latest: GenerationRecord | None = None
        self._unreported: tuple[GenerationRecord, NodeStatus] | None = None
        self._end_watch = EndWatch(self.node_id)
        self._liveness: LivenessPort | None = None
        self._end_read_at = 0.0
        self.contacts = WorkerContacts()
        self._watches: list[WatchHandle] = []
        self._elastic = config.sidecar
        """Set when a worker says hello through the worker API: workers then live across generations
        (always for a sidecar: only worker-API processes can attach)."""
        self._elastic_announced = False
        self._attachments = Attachments()
        self._control_keys = ControlKeys(config.nproc_per_node, config.sidecar)
        self._assignments: dict[int, Assignment] = {}
        """What each local worker is in the generation this node serves (rank, group, store address)."""
        self._ready = True
        self._restarting: set[int] = set()
        """Local ranks restarted after a crash whose new process has not said hello yet (the node is
        out of the membership until they have)."""
        self._crash_restarts = 0
        self._crashed_in: int | None = None
        """The generation of the latest crash restart (in the node record while restarting)."""
        self._last_crash: tuple[int, tuple[tuple[int, int | None], ...]] | None = None
        self._finished_cache: tuple[float, bool] = (0.0, False)
        """(when checked, whether the store's ``finished`` marker exists), read at most every 0.5 s."""
        self.reader = RecordReader(self.emit)
        self.leader = self._make_leader()
        self.phase = PhaseTracker(f"agent {self.node_id}")
        """This node's phase in the generation it serves (the protocol's state table)."""

    def _make_leader(self) -> Leader:
        return Leader(
            self.store,
            self.config,
            self.node_id,
            self.emit,
            self.reader,
            self.leaving,
            self.stop_requested,
            lease=lambda: self._lease,
            latest=lambda: self._latest,
        )

    # ---- logging --------------------------------------------------------------------
    def _log_event(self, event: str, fields: dict) -> None:
        """Every event goes to the log (the agent's log file has them all; the console those at its
        level, :mod:`etc_agent.agent.console`); with ``--log-format json`` the console gets each
        event as one JSON line on stdout instead, whatever its level."""
        as_json = self.config.log_format == "json"
        if as_json:
            line = json.dumps({"ts": round(time.time(), 3), "event": event, "node": self.node_id, **fields}) + "\n"
            with _STDOUT_LOCK:  # one write per record: print() writes the newline separately
                sys.stdout.write(line)
                sys.stdout.flush()
        detail = " ".join(f"{k}={v}" for k, v in fields.items())
        log.log(event_level(event), "[%s] %s %s", self.node_id, event, detail, extra={CONSOLE_ATTR: not as_json})

    # ---- membership ----------------------------------------------------------------
    def _node_record(self) -> NodeRecord:
        return NodeRecord(
            node_id=self.node_id,
            host=self.host,
            num_devices=self.config.nproc_per_node,
            pid=os.getpid(),
            node_rank_hint=self.config.node_rank,
            leaving=self.leaving.is_set(),
            restarting=sorted(self._restarting),
            crashed_in=self._crashed_in if self._restarting else None,
            probe_port=self._liveness.port if self._liveness is not None else None,
            ready=self._ready,
        )

    def _register(self) -> None:
        self._lease = self.store.grant_lease(self.config.lease_ttl)
        self.store.put(f"nodes/{self.node_id}", self._node_record().dumps(), lease=self._lease)
        self.emit(
            "registered",
            {
                "host": self.host,
                "devices": self.config.nproc_per_node,
                "lease_ttl": self._lease.ttl,
                "control_addr": self._control.address,
                "log_file": str(self.log_file),
            },
        )

    def _put_record(self) -> None:
        self.store.put(f"nodes/{self.node_id}", self._node_record().dumps(), lease=self._lease)

    def _keepalive(self) -> None:
        interval = max(0.2, self.config.lease_ttl / 3)
        assert self._lease is not None  # run() registers before it starts this thread
        while not self.stop_requested.wait(interval):
            try:
                self._lease.refresh()
                if not self.leaving.is_set() and self.store.get(f"nodes/{self.node_id}") is None:
                    # The lease lives but the record is gone (keys deleted by hand, a wiped prefix).
                    self.emit("node_record_vanished", {"action": "registering again"})
                    self._put_record()
            except LeaseExpired:
                self.emit("lease_expired", {"action": "re-registering"})
                try:
                    self._register()
                except StoreError as err:
                    self.emit("store_unreachable", {"error": str(err)})
            except StoreError as err:
                self.emit("store_unreachable", {"error": str(err)})

    # ---- this node's part of a generation -------------------------------------------
    def _master(self, gen: GenerationRecord) -> MasterRecord:
        key = f"generations/{gen.number}/master"
        if gen.members[0] == self.node_id:
            if self._static_store is not None and gen.restart_count not in self._static_attempts:
                # Static rendezvous: MASTER_PORT is --master-port, as under torchrun, and torch's
                # agent-store clients keep each restart's keys apart (/worker/attempt_<restart count>).
                self._static_attempts.add(gen.restart_count)
                record = MasterRecord(addr=self._static_store.host, port=self._static_store.port)
            else:
                # Like torchrun's c10d agents: the first member hosts the workers' store
                # (etc_agent.agent.storehost).
                assert self._worker_stores is not None  # made by run() before any generation is served
                addr, port = self._worker_stores.new()
                record = MasterRecord(addr=addr, port=port)
            self.store.create(key, record.dumps())
        deadline = time.monotonic() + self.config.join_timeout
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            kv = self.store.get(key)
            master = self.reader.parse(MasterRecord, kv) if kv else None
            if master is not None:
                return master
            newer = self._read_generation()
            if newer and newer.number != gen.number:
                raise _Superseded()
            time.sleep(0.05)
        raise TimeoutError(f"generation {gen.number}: member {gen.members[0]} did not publish the master address")

    def _node_env(self, local_rank: int, generation: int) -> dict[str, str]:
        """What a worker gets from this node whatever its place in a generation."""
        env = {
            "LOCAL_RANK": "0" if self.spec.virtual_local_rank else str(local_rank),
            "ETC_AGENT_LOCAL_RANK": str(local_rank),
            "ROLE_NAME": self.spec.role,
            "LOCAL_WORLD_SIZE": str(self.config.nproc_per_node),
            "TORCHELASTIC_MAX_RESTARTS": str(self.config.job_restarts),
            "TORCHELASTIC_RUN_ID": self.config.run_id,
            "ETC_AGENT_GENERATION": str(generation),
            "ETC_AGENT_NODE_ID": self.node_id,
            "ETC_AGENT_ADDR": self._control.address,
            auth.TOKEN_ENV: self._control_keys.token(local_rank),
            "ETC_AGENT_MIGRATION": self.config.migration,
        }
        if self.config.checkpoint_dir:
            env["ETC_AGENT_CHECKPOINT_DIR"] = self.config.checkpoint_dir
        if self.config.fresh_start:
            env["ETC_AGENT_FRESH_START"] = "1"
        if self.config.checkpoint_interval:
            env["ETC_AGENT_CHECKPOINT_INTERVAL"] = str(self.config.checkpoint_interval)
            env["ETC_AGENT_CHECKPOINT_KEEP"] = str(self.config.checkpoint_keep)
        if "OMP_NUM_THREADS" in os.environ:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        if self.spec.virtual_local_rank:
            # As torchrun does: each worker sees only its own device, as device 0.
            visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            env["CUDA_VISIBLE_DEVICES"] = visible[local_rank] if local_rank < len(visible) else str(local_rank)
        return env

    def _worker_env(self, gen: GenerationRecord, master: MasterRecord, local_rank: int) -> dict[str, str]:
        rank = gen.training_rank(self.node_id, local_rank)
        env = {
            **self._node_env(local_rank, gen.number),
            "RANK": str(rank),
            "GROUP_RANK": str(gen.members.index(self.node_id)),
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(gen.world_size),
            "GROUP_WORLD_SIZE": str(len(gen.members)),
            "ROLE_WORLD_SIZE": str(gen.world_size),
            "MASTER_ADDR": master.addr,
            "MASTER_PORT": str(master.port),
            "TORCHELASTIC_RESTART_COUNT": str(gen.restart_count),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
        if gen.parallel:
            env["ETC_AGENT_PARALLEL"] = gen.parallel
        return env

    def _prepare_assignments(self, gen: GenerationRecord, master: MasterRecord) -> None:
        """What each local worker is in ``gen``: served to elastic workers over the control channel
        (transport and training ranks from the record's helpers, the same ones the env uses)."""
        trained = False
        if gen.started:
            try:
                trained = self.store.get("trained") is not None
            except StoreError:
                trained = True  # unknown: never start fresh over state that may exist
        # Checkpoint mode: departing workers saved and exited already, they send nothing.
        live = self.config.migration == "live"
        devices = gen.transport_devices(with_senders=live)
        leaving = self.node_id not in gen.members
        self._assignments = {
            local: Assignment(
                generation=gen.number,
                pg_rank=gen.transport_rank(self.node_id, local),
                pg_world_size=len(devices),
                rank=None if leaving else gen.training_rank(self.node_id, local),
                world_size=gen.world_size,
                parallel=gen.parallel,
                store_addr=master.addr,
                store_port=master.port,
                devices=devices,
                leaving=leaving,
                standby_after=leaving and not self._ready and not self.leaving.is_set(),
                started=gen.started,
                trained=trained,
                reason=gen.reason,
                published_at=gen.published_at,
                node_id=self.node_id,
            )
            for local in range(self.config.nproc_per_node)
            if not leaving or gen.sends(self.node_id, local)
        }
        rank0 = [local for local, a in self._assignments.items() if a.rank == 0]
        self._control_keys.serving(gen.number, rank0[0] if rank0 else None)

    def _start_workers(self, gen: GenerationRecord) -> None:
        index = gen.members.index(self.node_id)
        master = self._master(gen)
        offset = gen.transport_rank(self.node_id, 0)
        nproc = self.config.nproc_per_node
        envs = [self._worker_env(gen, master, local_rank) for local_rank in range(nproc)]
        self._prepare_assignments(gen, master)
        attempt_dir = self._run_dir / f"attempt_{gen.number}"
        self.workers = self._make_workers(envs, attempt_dir)
        self._reported = None
        self._report(gen, NodeStatus(state="running"))
        self.emit(
            "workers_started",
            {
                "generation": gen.number,
                "group_rank": index,
                "world_size": gen.world_size,
                "ranks": f"{offset}-{offset + nproc - 1}",
                "restart_count": gen.restart_count,
            },
        )

    def _continue_workers(self, gen: GenerationRecord, role: str) -> None:
        """Elastic workers stay alive into ``gen``; dead ones are started again (they join as receivers).

        With ``--migration checkpoint`` the workers save and exit (code ``RESTART_EXIT``) at the agreed
        step instead; once they are gone, fresh ones start and load (the checkpoint baseline)."""
        assert self.workers is not None  # called for a node whose workers live on (_on_generation, _send_state)
        master = self._master(gen)
        self._prepare_assignments(gen, master)
        restarted = []
        if self.config.migration == "checkpoint":
            deadline = time.monotonic() + max(self.config.shutdown_timeout, 60.0)
            while any(code is None for code in self.workers.poll().values()) and time.monotonic() < deadline:
                time.sleep(0.02)
            self.workers.stop(self.config.shutdown_timeout)
        if self.node_id in gen.members:
            codes = self.workers.poll()
            died = {r: c for r, c in codes.items() if c not in (None, 0, RESTART_EXIT)}
            if died and self.config.migration == "live":
                # Died between the last look and this generation: a crash restart too, said as one.
                self._crash_restarts += 1
                log.error(
                    "worker failure (generation %d):\n%s",
                    self.generation.number if self.generation else gen.number,
                    self.workers.failure_report(self._script_name()),
                )
                self.emit(
                    "workers_failed",
                    {
                        "generation": gen.number,
                        "exit_codes": died,
                        "action": f"restarting local ranks {sorted(died)} into generation {gen.number} as receivers "
                        f"({self._crash_restarts}/{self.config.node_crash_restarts})",
                    },
                )
            for local_rank, code in codes.items():
                if code is not None:
                    self.workers.restart(
                        local_rank, self._worker_env(gen, master, local_rank), self._run_dir / f"attempt_{gen.number}"
                    )
                    restarted.append(local_rank)
        self._reported = None
        self._report(gen, NodeStatus(state="running"))
        self.emit(
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

    def _stop_workers(self, why: str, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.workers is not None:
            self.emit("workers_stopping", {"reason": why, **({"signal": sig.name} if sig != signal.SIGTERM else {})})
            self.workers.stop(self.config.shutdown_timeout, sig)
            self.workers = None

    def _report(self, gen: GenerationRecord, status: NodeStatus) -> None:
        if self._reported == (gen.number, status.state):
            return
        try:
            self.store.put(f"generations/{gen.number}/status/{self.node_id}", status.dumps(), lease=self._lease)
        except StoreError as err:
            self.emit("store_unreachable", {"error": str(err), "pending": f"status {status.state}"})
            self._unreported = (gen, status)  # sent again from the main loop
            return
        self._unreported = None
        self._reported = (gen.number, status.state)

    def _read_generation(self) -> GenerationRecord | None:
        kv = self.store.get("generation")
        return self.reader.parse(GenerationRecord, kv) if kv is not None else None

    # ---- main loop ------------------------------------------------------------------
    def run(self) -> int:
        """Run until the job ends (0 on success), this node leaves (0), or it fails (1)."""
        if self.spec.start_method == "forkserver" and not self.spec.no_python and not self.config.sidecar:
            # Its imports run beside this process's and the rendezvous: workers fork ready from it,
            # and so do the workers' stores this agent hosts (this process never imports torch).
            self._forkserver = ForkServer()
        else:
            # torch takes ~1.5 s to import: pay it before joining, not when a generation needs the
            # TCPStore. Not in a background thread: TCPStores made while torch was still importing
            # in another thread made workers abort ("terminate called without an active exception").
            import torch.distributed  # noqa: F401
        self._worker_stores = WorkerStores(self.host, self._forkserver)

        host, port = parse_address(
            self.config.control_addr or ("127.0.0.1:29401" if self.config.sidecar else "127.0.0.1:0")
        )
        self._control = JsonLineServer(
            self._on_control,
            host,
            port,
            name="etc-control",
            schema=CONTROL_REQUEST,
            on_held=self._attached,
            keys=self._control_keys.lookup,
        )
        if self.config.sidecar and auth.configured_secret() is None:
            # Workers another launcher starts on this host find the channel's key in this user's
            # private file (elsewhere they derive it from ETC_AGENT_SECRET).
            auth.write_local_secret(*auth.control_secret_name(self._control.address), self._control_keys.master)
        if self.config.sidecar:
            self.emit(
                "sidecar",
                {
                    "control_addr": self._control.address,
                    "nproc_per_node": self.config.nproc_per_node,
                    "note": f"workers attach with ETC_AGENT_ADDR={self._control.address} and LOCAL_RANK",
                },
            )
        self._liveness = LivenessPort()  # before the record that names its port
        self._warm_fork_server_before_joining()
        self._join_warm()
        self._register()
        assert self._lease is not None  # granted by _register() (which raises otherwise)
        for target in (self._keepalive, self.leader.run_election):
            t = threading.Thread(target=target, name=f"etc-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        self._watches.append(self.store.watch_prefix("generation", lambda e: self._wake.set()))
        started = time.monotonic()
        try:
            return self._loop(started)
        finally:
            self.stop_requested.set()
            self._stop_workers("agent exiting")
            for w in self._watches:
                w.cancel()
            for t in self._threads:
                t.join(timeout=2)
            self._control.stop()
            if self.config.sidecar:
                auth.remove_local_secret(*auth.control_secret_name(self._control.address))
            if self._liveness is not None:
                self._liveness.close()
            self._worker_stores.close()
            if self._forkserver is not None:
                self._forkserver.close()
            try:
                self._lease.revoke()
            except StoreError:
                pass

    def _on_control(self, req: ControlRequest, key_id: str) -> dict:
        """The control channel of this node's workers (``ETC_AGENT_ADDR``): requests signed with one
        worker's key, validated against :mod:`etc_agent.protocol.control` (one model per ``op``) and
        checked against what this agent knows (:mod:`etc_agent.agent.controlauth`); JSON replies."""
        local_rank = getattr(req, "local_rank", 0)
        if local_rank >= self.config.nproc_per_node:
            raise ValueError(
                f"local_rank {local_rank} is not a worker of this node (--nproc-per-node {self.config.nproc_per_node})"
            )
        try:
            self._control_keys.check(req, key_id, self._started_pid)
        except NotAllowed as err:
            self.emit("control_refused", {"key": key_id, "op": req.op, "reason": str(err)})
            raise
        # Each handler takes the request type it is keyed by.
        handlers: dict[type, Callable[[Any], dict]] = {
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
        }
        return handlers[type(req)](req)

    def _started_pid(self, local_rank: int) -> int | None:
        """The pid of the process this agent started for ``local_rank`` (None: none, or a sidecar)."""
        workers = self.workers
        if not isinstance(workers, WorkerGroup):
            return None
        return workers.pids().get(local_rank)

    def _on_hello(self, req: Hello | Heartbeat) -> dict:
        # A new process under a local rank another process already served replaces it (sidecar: the
        # other launcher restarted it); it joins the generation after the one its predecessor ran.
        replacement = isinstance(req, Hello) and self.contacts.pid.get(req.local_rank) not in (None, req.pid)
        self.contacts.seen[req.local_rank] = time.monotonic()
        if isinstance(req, Hello) and req.pid is not None:
            self.contacts.pid[req.local_rank] = req.pid
        if isinstance(req, Hello) and req.elastic:
            if not self._elastic_announced:
                # The leader reads it: a live job's crash is handled without ending the job.
                try:
                    self.store.put("elastic", json.dumps({"node": self.node_id}))
                    self._elastic_announced = True
                except StoreError:
                    pass
            self._elastic = True
            self.contacts.hellos.add(req.local_rank)
        reply = HelloReply(node_id=self.node_id, generation=self.generation.number if self.generation else None)
        if self.config.sidecar and isinstance(req, Hello):
            # What etcrun would have put in its children's environment.
            number = self.generation.number if self.generation else 0
            if replacement and req.local_rank in self.contacts.served:
                # Its predecessor last saw that generation: the replacement joins a later one.
                number = self.contacts.served.pop(req.local_rank) + 1
            node_env = self._node_env(req.local_rank, number)
            env = {
                k: v
                for k, v in node_env.items()
                if k not in ("LOCAL_RANK", "ETC_AGENT_LOCAL_RANK", "OMP_NUM_THREADS", auth.TOKEN_ENV)
            }
            reply = reply.model_copy(update={"sidecar": True, "env": env})
        return reply.model_dump()

    def _on_attach(self, req: Attach) -> dict:
        if not self.config.sidecar:
            raise ValueError("attach is for workers of an etc-agent sidecar; this agent starts its own workers")
        return {"ok": True, "hold": True}

    def _on_exiting(self, req: Exiting) -> dict:
        self._attachments.report_exit(req.local_rank, req.pid, req.code)
        return {"ok": True}

    def _on_assignment_query(self, req: AssignmentQuery) -> dict:
        self.contacts.seen[req.local_rank] = time.monotonic()
        latest = self._latest
        served = self._assignments.get(req.local_rank)
        if served is not None:
            self.contacts.served[req.local_rank] = served.generation
        return AssignmentReply(
            latest=latest.number if latest else None,
            latest_status=latest.status if latest else None,
            assignment=served,
            finished=self._job_finished(),
            standby=not self._assignments or not self._ready,
            stop=self._attachments.stop_requested(req.local_rank),
        ).model_dump()

    def _on_switch_failed(self, req: SwitchFailed) -> dict:
        self._abandon(req.generation, f"{self.node_id} local_rank {req.local_rank}: {req.reason[:300]}")
        return {"ok": True}

    def _on_peer_failed(self, req: PeerFailed) -> dict:
        key = f"generations/{req.generation}/peer_failed/{self.node_id}"
        try:
            if self.store.get(key) is None:
                record = PeerFailureRecord(generation=req.generation, reason=req.reason)
                self.store.put(key, record.dumps(), lease=self._lease)
                self.emit(
                    "peer_failure", {"generation": req.generation, "local_rank": req.local_rank, "reason": req.reason}
                )
        except StoreError as err:
            self.emit(
                "store_unreachable", {"error": str(err), "pending": f"peer failure in generation {req.generation}"}
            )
        self.leader.notify_peer_failure()  # the leader may be the agent that died
        return {"ok": True}

    def _on_fatal(self, req: Fatal) -> dict:
        gen = self.generation
        if gen is not None:
            self._report(gen, NodeStatus(state="failed", message=req.reason, fatal=True))
        self.emit("fatal", {"reason": req.reason[:500]})
        return {"ok": True}

    def _on_finished(self, req: Finished) -> dict:
        # The training ranks completed the last step: processes still on their way into a
        # generation (a late joiner) exit instead of waiting for peers that are gone.
        self._put_or_say("finished", json.dumps({"step": req.step, "generation": req.generation}), "finished marker")
        self._finished_cache = (time.monotonic(), True)
        self.emit("training_finished", {"step": req.step, "generation": req.generation})
        return {"ok": True}

    def _on_trained(self, req: Trained) -> dict:
        self._put_or_say("trained", json.dumps({"step": req.step, "node": self.node_id}), "trained marker")
        return {"ok": True}

    def _on_migration(self, req: Migration) -> dict:
        record = req.record
        if self._put_or_say(f"generations/{record.generation}/migration", record.dumps(), "migration record"):
            self._put_or_say("last_migration", record.dumps(), "migration record")
        self.emit("migration", record.model_dump(exclude={"schema_version"}))
        return {"ok": True}

    def _on_generation_query(self, req: GenerationQuery) -> dict:
        latest = self._latest
        return {
            "node_id": self.node_id,
            "running": self.generation.model_dump() if self.generation else None,
            "latest": latest.model_dump() if latest else None,
            "leaving": self.leaving.is_set(),
        }

    def _put_or_say(self, key: str, value: str, what: str) -> bool:
        """Write a marker or record the workers reported; through a store outage, say what is pending."""
        try:
            self.store.put(key, value)
            return True
        except StoreError as err:
            self.emit("store_unreachable", {"error": str(err), "pending": what})
            return False

    def _attached(self, req: Attach, sock, reader) -> None:
        """A sidecar's worker holds its attach connection while it lives (runs in the connection's thread)."""
        attachment = self._attachments.attach(req.local_rank, req.pid, sock)
        self.emit("worker_attached", {"local_rank": req.local_rank, "pid": req.pid})
        try:
            while reader.read(4096):
                pass
        except OSError:
            pass
        self._attachments.closed(attachment)
        self.emit(
            "worker_detached",
            {
                "local_rank": req.local_rank,
                "pid": req.pid,
                "exit_code": attachment.exit_code,
                "reported": attachment.reported is not None,
            },
        )
        self._wake.set()

    def _make_workers(self, envs: list[dict[str, str]], attempt_dir: Path):
        """This node's workers: started here, or (sidecar) the processes that attach under these local ranks."""
        if self.config.sidecar:
            return AttachedWorkers(self._attachments, [int(env["ETC_AGENT_LOCAL_RANK"]) for env in envs])
        return WorkerGroup(self.spec, envs, attempt_dir, forkserver=self._forkserver)

    def _join_warm(self) -> None:
        """Joining a running elastic job: start the workers first (interpreter, torch, the script's
        imports) and register as ready only once they said hello, so the running ranks do not stall
        while this node's processes start. They wait for their assignment in ``job.start()``."""
        try:
            elastic = self.store.get("elastic") is not None
            current = self._read_generation()
        except StoreError:
            return
        if (
            not elastic
            or current is None
            or current.status != "running"
            or self.spec.no_python
            or self.config.migration != "live"
        ):
            return
        self._ready = False
        self._elastic = True
        # No rank yet: a standby worker learns it from its assignment once the node is a member.
        envs = [
            {**self._node_env(local_rank, current.number + 1), "RANK": "-1"}
            for local_rank in range(self.config.nproc_per_node)
        ]
        self.workers = self._make_workers(envs, self._run_dir / "standby")
        self.emit("workers_warming", {"workers": len(envs), "note": "joining once they run"})
        deadline = time.monotonic() + self.config.join_timeout
        while time.monotonic() < deadline and not self.stop_requested.is_set() and not self.leaving.is_set():
            if len(self.contacts.hellos) >= self.config.nproc_per_node:
                self._ready = True
                self.emit(
                    "workers_warm", {"seconds": round(time.monotonic() - (deadline - self.config.join_timeout), 2)}
                )
                return
            if any(code is not None for code in self.workers.poll().values()):
                # The script is not a worker-API script after all (or it failed at start): join normally.
                self.workers.stop(self.config.shutdown_timeout)
                self.workers = None
                self._elastic = False
                self._ready = True
                self.emit(
                    "workers_warming_failed",
                    {"note": "a worker exited before saying hello; joining without warm start"},
                )
                return
            time.sleep(0.05)
        self._ready = True

    def _warm_fork_server_before_joining(self) -> None:
        """Joining a running job restarts the others' workers (a plain script's) or brings this
        node's in (a worker-API script's): the fork server's imports are paid before this node
        registers, so the others' workers never wait for them in the rendezvous. A first start
        registers at once (the imports overlap the rendezvous)."""
        if self._forkserver is None:
            return
        try:
            current = self._read_generation()
        except StoreError:
            return
        if current is None or current.status != "running" or self._forkserver.ready.is_set():
            return
        started = time.monotonic()
        deadline = started + min(self.config.join_timeout, FORK_SERVER_WAIT_S)
        while not self._forkserver.ready.wait(0.1):
            if time.monotonic() >= deadline or self.stop_requested.is_set() or self.leaving.is_set():
                break
        self.emit(
            "fork_server_warm" if self._forkserver.ready.is_set() else "fork_server_not_warm",
            {"seconds": round(time.monotonic() - started, 2), "note": "before joining the running job"},
        )

    def _job_finished(self) -> bool:
        checked_at, value = self._finished_cache
        if value or time.monotonic() - checked_at < 0.5:
            return value
        try:
            value = self.store.get("finished") is not None
        except StoreError:
            value = False
        self._finished_cache = (time.monotonic(), value)
        return value

    def request_departure(self) -> None:
        """Planned departure (SIGTERM): leave the membership, let the others go on without us."""
        self.leaving.set()
        self._wake.set()

    def _loop(self, started: float) -> int:
        waiting_since: float | None = started
        unreachable_since: float | None = None
        last_complaint = 0.0
        while True:
            if self.leaving.is_set():
                return self._depart()
            now = time.monotonic()
            try:
                gen = self._read_generation()
                unreachable_since = None
            except StoreError as err:
                # Keep the workers running through a store outage, say so, give up after join_timeout.
                unreachable_since = unreachable_since or now
                if now - last_complaint > 10:
                    self.emit("store_unreachable", {"error": str(err), "for_s": round(now - unreachable_since, 1)})
                    last_complaint = now
                if now - unreachable_since > self.config.join_timeout:
                    self.emit("giving_up", {"reason": f"store unreachable for {self.config.join_timeout:.0f} s"})
                    return 1
                self._wake.wait(min(1.0, max(self.config.monitor_interval, 0.2)))
                continue
            if gen is not None:
                # Kept when the record vanishes: the leader goes on after the last number it saw.
                self._latest = gen
            if gen and (self.generation is None or gen.number != self.generation.number):
                code = self._on_generation(gen)
                if code is not None:
                    return code
            # The wait for --nnodes MIN members is bounded by join_timeout, counted from when it began.
            if gen is None or gen.status == "waiting":
                waiting_since = waiting_since or now
                if now - waiting_since > self.config.join_timeout:
                    self.emit(
                        "join_timeout",
                        {
                            "seconds": self.config.join_timeout,
                            "members": len(gen.members) if gen else 0,
                            "needed": self.config.min_nodes,
                        },
                    )
                    return 1
            else:
                waiting_since = None
            if self.workers is not None and self.generation is not None:
                self._check_workers(self.generation)
                self._maybe_rejoin()
            self._watch_end(now)
            if (
                self._unreported is not None
                and self.generation is not None
                and self._unreported[0].number == self.generation.number
            ):
                self._report(*self._unreported)
            self._wake.wait(self.config.monitor_interval)
            self._wake.clear()

    def _watch_end(self, now: float) -> None:
        """Who the end of the job waits for, said every 30 s (:mod:`etc_agent.agent.endwatch`); the
        statuses are read at most every 10 s."""
        gen = self.generation
        done = self.phase.phase == Phase.FINISHED
        if gen is None or gen.status != "running" or (self.workers is None and not done):
            return
        if now - self._end_read_at < self._end_watch.every_s / 3:
            return
        self._end_read_at = now
        try:
            kvs = self.store.get_prefix(f"generations/{gen.number}/status/")
        except StoreError:
            return
        succeeded = {
            kv.key.rsplit("/", 1)[-1]
            for kv in kvs
            if (status := self.reader.parse(NodeStatus, kv)) is not None and status.state == "succeeded"
        }
        pids = {}
        if self.workers is not None:
            codes = self.workers.poll()
            pids = {r: pid for r, pid in self.workers.pids().items() if codes.get(r) is None}
        said = self._end_watch.check(now, gen, done, succeeded, pids)
        if said is not None:
            self.emit(*said)

    def _on_generation(self, gen: GenerationRecord) -> int | None:
        """Act on a newly read generation: its status, and this node's role in it (computed once here)."""
        previous = self.generation
        self.generation = gen
        self.emit(
            "generation_seen",
            {"generation": gen.number, "status": gen.status, "members": len(gen.members), "reason": gen.reason},
        )
        if gen.status in ("succeeded", "failed"):
            self._stop_workers(f"job {gen.status}")
            self._move(Phase.FINISHED if gen.status == "succeeded" else Phase.FAILED, gen.number)
            if gen.status == "failed":
                self.emit("job_failed", {"reason": gen.reason})
            return 0 if gen.status == "succeeded" else 1
        role = gen.role_of(self.node_id, with_senders=self.config.migration == "live")
        if self._elastic and self.workers is not None:
            if gen.status == "waiting":
                if self.phase.phase == Phase.RUNNING:
                    self._move(Phase.PENDING, gen.number)
                return None  # workers hold their state at a step boundary until enough nodes return
            if role != "spare":
                # A member's workers go on; a sender's send what they hold, then exit (the node stays, idle).
                self._move(Phase.MIGRATING, gen.number)
                try:
                    self._continue_workers(gen, role)
                except _Superseded:
                    self.generation = previous
                    return None
                self._move(Phase.RUNNING if role == "member" else Phase.DEPARTING, gen.number)
                return None
            if not self._assignments or not self._ready:
                self.emit("spare", {"generation": gen.number, "members": len(gen.members), "workers": "warm, waiting"})
                return None  # warm standby workers of a node not (yet, or not again) in the job keep waiting
        self._stop_workers(f"generation {gen.number}" if previous else "start")
        if gen.status == "running" and role == "member":
            self._move(Phase.MIGRATING, gen.number)
            try:
                self._start_workers(gen)
            except _Superseded:
                self.generation = previous
                return None
            self._move(Phase.RUNNING, gen.number)
        else:
            self._move(Phase.SPARE, gen.number)
            if gen.status == "running":
                self.emit("spare", {"generation": gen.number, "members": len(gen.members)})
        return None

    def _move(self, phase: Phase, generation: int) -> None:
        """This node's phase for ``generation``; leaving RUNNING for anything but a failure or the end
        goes through PENDING (a newer generation was seen), as the state table has it."""
        current = self.phase.phase
        if current in (Phase.FINISHED, Phase.FAILED):
            return  # the node's workers are done; the store's final record only confirms it
        if current == Phase.RUNNING and phase not in (
            Phase.RUNNING,
            Phase.RECOVERING,
            Phase.DEPARTING,
            Phase.FINISHED,
            Phase.FAILED,
        ):
            self.phase.to(Phase.PENDING, generation)
        self.phase.to(phase, generation)

    def _kill_hung_workers(self, gen: GenerationRecord) -> None:
        """A worker-API process that stopped talking (frozen, deadlocked with the GIL held) is killed so
        that the job handles it like a crash instead of every peer waiting on it."""
        assert self.workers is not None  # only from _check_workers()
        now = time.monotonic()
        codes = self.workers.poll()
        for local_rank, pid in self.workers.pids().items():
            seen = self.contacts.seen.get(local_rank)
            if seen is None or codes.get(local_rank) is not None or self.contacts.pid.get(local_rank) != pid:
                continue
            silent = now - seen
            if silent > self.config.worker_heartbeat_timeout:
                why = f"no word from it for {silent:.1f} s (--worker-heartbeat-timeout {self.config.worker_heartbeat_timeout:g})"
                self.emit(
                    "worker_hung",
                    {
                        "generation": gen.number,
                        "local_rank": local_rank,
                        "pid": pid,
                        "silent_s": round(silent, 1),
                        "action": "SIGKILL, handled as a crash",
                    },
                )
                log.error(
                    "worker local_rank %d (pid %d) on %s hung: %s; killing it", local_rank, pid, self.node_id, why
                )
                self.workers.kill(local_rank, why)
                self.contacts.seen.pop(local_rank, None)

    def _check_workers(self, gen: GenerationRecord) -> None:
        assert self.workers is not None  # the main loop checks workers only while there are some
        if self._elastic and self.config.worker_heartbeat_timeout > 0:
            self._kill_hung_workers(gen)
        codes = self.workers.poll()
        failed = {r: c for r, c in codes.items() if c not in (None, 0, RESTART_EXIT)}
        if failed and self._elastic:
            self._on_live_crash(gen, codes, failed)
        elif failed and self._superseded(gen):
            return  # a newer generation (a member's planned departure, say) restarts these workers anyway
        elif failed:
            summary = self.workers.failure_summary(self.host)
            self.emit("workers_failed", {"generation": gen.number, "exit_codes": failed})
            self._move(Phase.RECOVERING, gen.number)
            group = self.workers
            self._stop_workers("a local worker failed")
            # After the stop, as torchrun does: the workers stopped because of the failure are listed too.
            log.error("worker failure (generation %d):\n%s", gen.number, group.failure_report(self._script_name()))
            self._report(
                gen,
                NodeStatus(
                    state="failed", exit_codes={r: c for r, c in codes.items() if c is not None}, message=summary
                ),
            )
        elif all(c == 0 for c in codes.values()):
            self.workers.close()
            self.workers = None
            if self.node_id not in gen.members:
                # A spare whose workers sent their state: it waits, without workers, for a generation that needs it.
                self._move(Phase.SPARE, gen.number)
                self.emit(
                    "spare", {"generation": gen.number, "members": len(gen.members), "workers": "state sent, exited"}
                )
                return
            self._report(gen, NodeStatus(state="succeeded", exit_codes=codes))
            self._move(Phase.FINISHED, gen.number)
            self.emit("workers_succeeded", {"generation": gen.number})

    def _superseded(self, gen: GenerationRecord) -> bool:
        """Whether the store already holds a newer generation than ``gen`` (read again: workers that
        failed because a departing peer's workers stopped are that generation's to restart, not a
        failure of ``gen``)."""
        try:
            latest = self._read_generation()
        except StoreError:
            return False
        return latest is not None and latest.number != gen.number

    def _on_live_crash(self, gen: GenerationRecord, codes: dict[int, int | None], failed: dict[int, int]) -> None:
        """A worker of a live job died: restart it now as a standby process and take this node out
        of the membership until it runs, so the others go on at once (this node's surviving workers
        send what they hold and wait); past ``--max-restarts`` the node leaves the job instead."""
        assert self.workers is not None  # only from _check_workers()
        pids = self.workers.pids()
        crash = (gen.number, tuple(sorted((r, pids.get(r)) for r in failed)))
        if crash == self._last_crash:
            return  # seen already (the checkpoint baseline restarts the worker with the next generation)
        self._last_crash = crash
        summary = self.workers.failure_summary(self.host)
        log.error("worker failure (generation %d):\n%s", gen.number, self.workers.failure_report(self._script_name()))
        if self.node_id in gen.members:
            self._move(Phase.RECOVERING, gen.number)
        limit = self.config.node_crash_restarts
        if self._crash_restarts >= limit:
            self.emit(
                "workers_failed",
                {
                    "generation": gen.number,
                    "exit_codes": failed,
                    "action": f"leaving the job: {self._crash_restarts}/{limit} crash restarts used (--max-restarts)",
                },
            )
            self.request_departure()
            return
        self._crash_restarts += 1
        if self.config.migration == "checkpoint":
            # The baseline restarts every worker of the generation after it (as torchrun does).
            self.emit(
                "workers_failed",
                {
                    "generation": gen.number,
                    "exit_codes": failed,
                    "action": "restart as joiners (--migration checkpoint)",
                },
            )
            self._report(
                gen,
                NodeStatus(
                    state="failed", exit_codes={r: c for r, c in codes.items() if c is not None}, message=summary
                ),
            )
            return
        self._ready = False
        self._crashed_in = gen.number
        for local_rank in failed:
            self.contacts.hellos.discard(local_rank)
            self._restarting.add(local_rank)
        try:
            self._put_record()  # out of the membership; the restarted ranks are no senders
        except StoreError as err:
            self.emit("store_unreachable", {"error": str(err), "pending": "leave the membership while restarting"})
        self._report(
            gen,
            NodeStatus(state="failed", exit_codes={r: c for r, c in codes.items() if c is not None}, message=summary),
        )
        # After the store heard of it: the leader's decision does not wait for the restart.
        for local_rank in failed:
            env = {**self._node_env(local_rank, gen.number + 1), "RANK": "-1"}
            self.workers.restart(local_rank, env, self._run_dir / f"restart_{self._crash_restarts}")
        self.emit(
            "workers_failed",
            {
                "generation": gen.number,
                "exit_codes": failed,
                "action": f"restarting local ranks {sorted(failed)} ({self._crash_restarts}/{limit}); "
                "the others go on, this node rejoins once they run",
            },
        )

    def _maybe_rejoin(self) -> None:
        """Back into the membership once every restarted worker said hello (a warm join)."""
        if not self._restarting or not self._restarting <= self.contacts.hellos:
            return
        self._restarting.clear()
        self._ready = True
        try:
            self._put_record()
        except StoreError as err:
            self._ready = False
            self.emit("store_unreachable", {"error": str(err), "pending": "rejoin after a restart"})
            return
        self.emit("workers_warm", {"note": "restarted workers run; this node rejoins the job"})

    def _script_name(self) -> str:
        return self.spec.entrypoint[0] if self.spec.entrypoint else "workers"

    def _abandon(self, generation: int, reason: str) -> None:
        key = f"generations/{generation}/abandoned/{self.node_id}"
        try:
            if self.store.get(key) is None:
                self.store.put(key, AbandonRecord(generation=generation, reason=reason).dumps())
                self.emit("generation_abandoned", {"generation": generation, "reason": reason})
        except StoreError as err:
            self.emit("store_unreachable", {"error": str(err), "pending": f"abandon generation {generation}"})

    def _depart(self) -> int:
        """A planned departure: announced before any local worker stops. The node record says
        ``leaving``; a member with running workers waits (bounded) for the leader to publish the
        generation without it (worker-API workers send their state into it), and only then are its
        workers stopped, so the others' restart is a membership change, never a failure."""
        self.emit("departing", {"shutdown_timeout": self.config.shutdown_timeout})
        self._move(Phase.DEPARTING, self.generation.number if self.generation else -1)
        try:
            self.store.put(f"nodes/{self.node_id}", self._node_record().dumps(), lease=self._lease)
        except StoreError as err:
            self.emit("store_unreachable", {"error": str(err)})
        had_workers = (
            self.workers is not None
            and self.generation is not None
            and self.node_id in self.generation.members
            and any(code is None for code in self.workers.poll().values())
        )
        ack = None
        if had_workers:
            ack = self._await_acknowledgement()
            if ack is not None and self._elastic:
                self._send_state(ack)
        # As torchrun does, workers get the signal the agent got (SIGUSR1 of a Slurm preemption, say).
        self._stop_workers("planned departure", self.signal_received or signal.SIGTERM)
        verdict = departure_verdict(self._departure_outcome(had_workers, ack))
        self.emit(
            "departed" if verdict.exit_code == 0 else "job_unfinished",
            {
                "exit_code": verdict.exit_code,
                "reason": verdict.reason,
                **({"cause": self.signal_received.name} if self.signal_received is not None else {}),
            },
        )
        try:
            self.store.delete(f"nodes/{self.node_id}")
        except StoreError:
            pass
        return verdict.exit_code

    def _departure_outcome(self, had_workers: bool, ack: GenerationRecord | None) -> DepartureOutcome:
        """What the departure led to (see :mod:`etc_agent.agent.departure`); a running acknowledging
        generation is followed until its members run in it, bounded like the wait for it."""
        after_ack: AfterAck = "unknown"
        if ack is not None and ack.status == "running":
            deadline = time.monotonic() + self._acknowledgement_wait_s()
            while time.monotonic() < deadline and not self.hard_stop.is_set():
                try:
                    latest = self._read_generation()
                    reported = {node: status.state for node, status in self.leader.statuses(ack.number).items()}
                except StoreError:
                    latest, reported = None, {}
                seen = after_acknowledgement(ack, latest, reported)
                if seen is not None:
                    after_ack = seen
                    break
                self._wake.wait(0.2)
                self._wake.clear()
        try:
            latest = self._read_generation()
            finished = self._job_finished() or (latest is not None and latest.status == "succeeded")
        except StoreError:
            finished = False
        return DepartureOutcome(
            finished=finished,
            had_workers=had_workers,
            acknowledged=ack,
            others_registered=self._others_go_on(),
            after_ack=after_ack,
        )

    def _others_go_on(self) -> bool:
        """Whether another node that is not leaving is registered (True when the store cannot tell)."""
        try:
            records = [self.reader.parse(NodeRecord, kv) for kv in self.store.get_prefix("nodes/")]
        except StoreError:
            return True
        return any(r is not None and r.node_id != self.node_id and not r.leaving for r in records)

    def _acknowledgement_wait_s(self) -> float:
        """What it takes a leader to publish a generation: the reconfiguration delay, a new leader's
        election after a lease lapses, and a margin."""
        return self.config.reconfig_delay + self.config.lease_ttl + DEPARTURE_MARGIN_S

    def _await_acknowledgement(self) -> GenerationRecord | None:
        """The first generation after the one this node serves, which the leader publishes once it
        read this node's record marked leaving; None when no other node carries the job on, this
        node's workers all ended meanwhile, a second signal came, or none came in time (said)."""
        assert self.generation is not None and self.workers is not None
        wait_s = self._acknowledgement_wait_s()
        deadline = time.monotonic() + wait_s
        next_check = time.monotonic()
        while not self.hard_stop.is_set():
            now = time.monotonic()
            if now >= deadline:
                self.emit(
                    "departure_unacknowledged",
                    {
                        "waited_s": round(wait_s, 1),
                        "note": "no generation without this node was published; its workers stop now",
                    },
                )
                return None
            if now >= next_check:
                next_check = now + 1.0
                if not self._others_go_on():
                    self.emit("departure_alone", {"note": "no other node carries the job on"})
                    return None
            try:
                gen = self._read_generation()
            except StoreError:
                gen = None
            if gen is not None and gen.number != self.generation.number:
                self._latest = gen
                self.emit(
                    "departure_acknowledged",
                    {"generation": gen.number, "status": gen.status, "members": len(gen.members), "reason": gen.reason},
                )
                return gen
            if all(code is not None for code in self.workers.poll().values()):
                return None
            self._wake.wait(0.2)
            self._wake.clear()
        return None

    def _send_state(self, gen: GenerationRecord) -> None:
        """Elastic workers of a departing node send their shards in ``gen``, the generation that drops
        this node, then exit; bounded by ``shutdown_timeout``. Without it the node leaves as a crash
        would: the survivors restore its state from replicas."""
        assert self.workers is not None  # _depart() sends state only from a node that had workers
        while True:
            if gen.status != "running" or self.node_id not in gen.senders:
                return
            try:
                self._continue_workers(gen, "sender")
                break
            except _Superseded:
                try:
                    newer = self._read_generation()
                except StoreError:
                    return
                if newer is None:
                    return
                gen = newer
        self.generation = gen
        until = time.monotonic() + self.config.shutdown_timeout
        while time.monotonic() < until and not self.hard_stop.is_set():
            codes = self.workers.poll()
            died = {r: c for r, c in codes.items() if c not in (None, 0, RESTART_EXIT)}
            if died:
                # The receivers lost a source mid-migration: that generation must be planned again
                # (from replicas), without this node; its other senders are of no use now.
                self._abandon(
                    gen.number,
                    f"sender {self.node_id} local ranks {sorted(died)} exited {sorted(set(died.values()))} "
                    "before their state was sent",
                )
                self.emit("state_not_sent", {"generation": gen.number, "exit_codes": codes})
                return
            if all(code is not None for code in codes.values()):
                self.emit("state_sent", {"generation": gen.number, "exit_codes": codes})
                return
            time.sleep(0.05)
        self.emit("departure_timeout", {"generation": gen.number, "seconds": self.config.shutdown_timeout})


FORK_SERVER_WAIT_S = 120.0
"""Longest a joining agent waits for its fork server's imports before it registers anyway."""
DEPARTURE_MARGIN_S = 10.0
"""Beyond the reconfiguration delay and a lease: how long a departing node waits for the leader."""


class _Superseded(Exception):
    """A newer generation appeared while this one was being set up."""


def install_signal_handlers(agent: Agent, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Each of ``signals`` (etcrun: ``--signals-to-handle``): planned departure; a second one: stop now
    (a store host stops serving too). The first one is remembered: a job that did not finish then
    ends with torchrun's exit code for a signal, not 0."""

    def on_term(signum, frame):
        agent.emit("signal", {"signal": signal.Signals(signum).name})
        if agent.leaving.is_set():
            agent.hard_stop.set()
            agent.stop_requested.set()
        if agent.signal_received is None:
            agent.signal_received = signal.Signals(signum)
        agent.request_departure()

    for sig in signals:
        signal.signal(sig, on_term)
