"""The per-node agent: membership, leader election, the generation protocol, worker supervision.

Every agent registers a :class:`NodeRecord` under its lease and keeps the lease alive. One agent
wins the ``leader`` key; it watches the members and the workers' statuses and, after
``reconfig_delay`` without further change, publishes the next :class:`GenerationRecord` with
compare-and-set. Every agent acts only on the generation it reads from the store:

- ``running`` and it is a member: (re)start its workers with ranks from its position;
- ``waiting`` (fewer than ``min_nodes``) or not a member: stop its workers and wait;
- ``failed`` / ``succeeded``: stop and exit.

Plain scripts get torchrun's contract (workers restarted on every membership change or failure,
failures counted against ``max_restarts``); worker-API processes live across generations.

This module is the node's main loop and its start and end; the rest lives in rooms of its own, all
sharing one :class:`~etc_agent.agent.node.Node`: the node's state (:mod:`node_state`), the leader
(:mod:`leader`), each generation acted on (:mod:`generations`), the workers watched
(:mod:`supervision`), a planned departure (:mod:`leaving`), the workers' control channel
(:mod:`control_channel`). ``docs/design.md`` walks one generation through them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from etc_agent.agent.commits import Commits
from etc_agent.agent.config import AgentConfig
from etc_agent.agent.console import CONSOLE_ATTR, EventFile, event_level
from etc_agent.agent.contact import ContactedStore, StoreContact
from etc_agent.agent.control_channel import ControlChannel
from etc_agent.agent.controlauth import ControlKeys
from etc_agent.agent.fence import Fence, FenceState
from etc_agent.agent.forkserver import ForkServer
from etc_agent.agent.generations import Generations, StaticStore
from etc_agent.agent.genwatch import GenerationWatch
from etc_agent.agent.leader import Leader
from etc_agent.agent.leaving import Leaving
from etc_agent.agent.metrics import AgentMetrics, NodeView, metered
from etc_agent.agent.metrics_server import MetricsServer
from etc_agent.agent.node import Emit, Node
from etc_agent.agent.node_state import NodeStateMachine
from etc_agent.agent.records import RecordReader
from etc_agent.agent.storehost import WorkerStores
from etc_agent.agent.supervision import Supervision
from etc_agent.agent.workers import WorkerGroup, WorkerSpec
from etc_agent.protocol import keys
from etc_agent.protocol.control import CONTROL_REQUEST
from etc_agent.rendezvous.store import LeaseExpired, MembershipStore, StoreError
from etc_agent.utils import auth
from etc_agent.utils.jsonline import JsonLineServer, parse_address
from etc_agent.utils.liveness import LivenessPort
from etc_agent.utils.structlog import json_line

log = logging.getLogger("etc_agent.agent")
_STDOUT_LOCK = threading.Lock()
"""JSON events come from the main, leader and keepalive threads: each is written whole."""


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        spec: WorkerSpec,
        store: MembershipStore,
        emit: Emit | None = None,
        workers_store: StaticStore | None = None,
    ):
        """``workers_store``: a TCPStore this agent hosts at a fixed address for the whole run
        (torchrun's static rendezvous on ``--master-port``)."""
        node_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        log_root = Path(spec.log_dir) if spec.log_dir else Path(tempfile.mkdtemp(prefix="etcrun-"))
        self.config = config
        self._outage_said = _EveryTenSeconds()
        self.metrics = AgentMetrics(node_id, self._node_view) if config.metrics_port is not None else None
        self._metrics_server: MetricsServer | None = None
        self.emit = metered(emit or self._log_event, self.metrics)
        contact = StoreContact(observe=self.metrics.observe_store if self.metrics else None)
        store = ContactedStore(store, contact)
        self.fence = Fence(node_id, config.lease_ttl, contact, self.emit)
        self.node = Node(
            config=config,
            spec=spec,
            store=store,
            node_id=node_id,
            host=config.local_addr or "127.0.0.1",  # etcrun always chooses one (utils.netaddr)
            emit=self.emit,
            run_dir=log_root / f"{config.run_id}_{node_id}",
            state=NodeStateMachine(f"agent {node_id}"),
            reader=RecordReader(self.emit),
            control_keys=ControlKeys(config.nproc_per_node, config.sidecar),
            elastic=config.sidecar,
        )
        self.node_id = node_id
        self.log_file = self.node.run_dir / "agent.log"
        """Every event of this agent (etcrun writes it; the console shows those at its --log-level)."""
        self.events = EventFile(self.node.run_dir / "events.jsonl")
        """Every event as a JSON line (``etc-agent timeline`` reads it)."""
        self._static_store = workers_store
        self._threads: list[threading.Thread] = []
        self.leader = Leader(
            store,
            config,
            node_id,
            self.emit,
            self.node.reader,
            self.node.state.leaving_event,
            self.node.state.stop_event,
            lease=lambda: self.node.lease,
            latest=lambda: self.node.latest,
        )
        self.supervision = Supervision(self.node)
        self.commits = Commits(self.node)
        self.channel = ControlChannel(
            self.node,
            self.leader.notify_peer_failure,
            self.commits,
            self.metrics.observe_progress if self.metrics else None,
        )

    @property
    def leaving(self) -> threading.Event:
        """Set once this node is leaving (a planned departure)."""
        return self.node.state.leaving_event

    @property
    def hard_stop(self) -> threading.Event:
        """Set by a second SIGTERM/SIGINT: stop everything now, the embedded store included."""
        return self.node.state.hard_stop_event

    def request_departure(self, cause: signal.Signals | None = None) -> None:
        self.node.request_departure(cause)

    # ---- logging --------------------------------------------------------------------
    def _log_event(self, event: str, fields: dict) -> None:
        """Every event goes to the log (the agent's log file has them all; the console those at its
        level, :mod:`etc_agent.agent.console`); with ``--log-format json`` the console gets each
        event as one JSON line on stdout instead, whatever its level."""
        as_json = self.config.log_format == "json"
        line = json_line(event, self.node_id, fields)
        self.events.write(line)
        if event == "store_unreachable" and not self._outage_said.due():
            # One line per outage on the console, not one per failed request of each thread.
            log.debug("[%s] %s %s", self.node_id, event, fields, extra={CONSOLE_ATTR: False})
            return
        if as_json:
            with _STDOUT_LOCK:  # one write per record: print() writes the newline separately
                sys.stdout.write(line)
                sys.stdout.flush()
        detail = " ".join(f"{k}={v}" for k, v in fields.items())
        log.log(event_level(event), "[%s] %s %s", self.node_id, event, detail, extra={CONSOLE_ATTR: not as_json})

    # ---- membership ----------------------------------------------------------------
    def _register(self) -> None:
        self.node.register()
        assert self.node.lease is not None
        self.emit(
            "registered",
            {
                "host": self.node.host,
                "interface": self.config.local_interface,
                "devices": self.config.nproc_per_node,
                "lease_ttl": self.node.lease.ttl,
                "control_addr": self.node.control_address,
                "log_file": str(self.log_file),
            },
        )

    def _import_torch_if_first(self, worker_stores: WorkerStores) -> None:
        """An agent among the first registered is likely a first generation's store host: its torch
        import starts now, beside the rendezvous, not when the generation needs the store."""
        try:
            worker_stores.may_host(self.leader.registration_order(), self.node_id)
        except StoreError:
            pass  # the first generation it sees decides

    def _keepalive(self) -> None:
        node = self.node
        interval = max(0.2, self.config.lease_ttl / 3)
        assert node.lease is not None  # run() registers before it starts this thread
        wait = interval
        while not node.state.stop_event.wait(wait):
            # Through an outage, tried again every quarter second: a node back in reach rejoins at once.
            wait = interval if self.fence.contact.silence_s() == 0 else 0.25
            try:
                node.lease.refresh()
                if not node.state.state.leaving and node.store.get(keys.node(self.node_id)) is None:
                    # The lease lives but the record is gone (keys deleted by hand, a wiped prefix).
                    self.emit("node_record_vanished", {"action": "registering again"})
                    node.put_record()
            except LeaseExpired:
                self.emit("lease_expired", {"action": "re-registering"})
                try:
                    self._register()
                except StoreError as err:
                    self.emit("store_unreachable", {"error": str(err)})
            except StoreError as err:
                self.emit("store_unreachable", {"error": str(err)})

    def _watch_fence(self) -> None:
        node = self.node

        def view() -> tuple[int | None, list[tuple[str, str, int]]]:
            gen = node.generation
            return (gen.number, gen.peer_probes(self.node_id)) if gen is not None else (None, [])

        self.fence.watch(node.state.stop_event, view, self._on_fence)

    def _on_fence(self, state: FenceState) -> None:
        """Fenced: a plain script's workers are frozen (worker-API ones hold at their step boundary,
        told by their poll); lifted: they go on, and the main loop acts on what the store says."""
        node = self.node
        node.fenced = state == "fenced"
        if not node.elastic and isinstance(node.workers, WorkerGroup):
            node.workers.freeze(node.fenced)
        node.wake.set()

    # ---- start and end ----------------------------------------------------------------
    def run(self) -> int:
        """Run until the job ends (0 on success), this node leaves (0), or it fails (1)."""
        node = self.node
        if node.spec.start_method == "forkserver" and not node.spec.no_python and not self.config.sidecar:
            # Its imports run beside this process's and the rendezvous: workers fork ready from it,
            # and so do the workers' stores this agent hosts (this process never imports torch;
            # without a fork server, only an agent that may host imports it: WorkerStores).
            node.forkserver = ForkServer()
        worker_stores = WorkerStores(node.host, node.forkserver)
        generations = Generations(node, worker_stores, self._static_store)
        control = self._open_control_channel()
        # Before the record that names its port; it tells a peer that asks whether this node hears the store.
        node.liveness = LivenessPort(
            lambda: self.fence.status_line(node.generation.number if node.generation else None)
        )
        try:
            self._serve_metrics()
            self.supervision.warm_fork_server_before_joining()
            self.supervision.join_warm()
            self._register()
            if worker_stores.in_process:
                self._import_torch_if_first(worker_stores)
            for target in (self._keepalive, self.leader.run_election, self._watch_fence):
                t = threading.Thread(target=target, name=f"etc-{target.__name__}", daemon=True)
                t.start()
                self._threads.append(t)
            generation_watch = GenerationWatch(node)
            generation_watch.arm()
            leaving = Leaving(node, self.leader.statuses, generations.continue_workers)
            try:
                return self._loop(generations, leaving, generation_watch)
            finally:
                generation_watch.close()
        finally:
            self._close(control, worker_stores)

    def _serve_metrics(self) -> None:
        if self.metrics is None or self.config.metrics_port is None:
            return
        addr = self.config.metrics_addr or self.node.host
        self._metrics_server = MetricsServer(addr, self.config.metrics_port, self.metrics.exposition)
        self.emit("metrics_serving", {"url": f"http://{addr}:{self._metrics_server.port}/metrics"})

    def _node_view(self) -> NodeView:
        """What a metrics scrape reports of this node."""
        gen = self.node.generation
        leading = self.leader.is_leader
        return NodeView(
            phase=self.node.state.state.phase,
            generation=gen.number if gen else None,
            members=len(gen.members) if gen else 0,
            spares=self.leader.num_spares(gen.members if gen else []) if leading else None,
            leading=leading,
        )

    def _open_control_channel(self) -> JsonLineServer:
        node = self.node
        host, port = parse_address(
            self.config.control_addr or ("127.0.0.1:29401" if self.config.sidecar else "127.0.0.1:0")
        )
        control = JsonLineServer(
            self.channel.handle,
            host,
            port,
            name="etc-control",
            schema=CONTROL_REQUEST,
            on_held=self.channel.attached,
            keys=node.control_keys.lookup,
        )
        node.control_address = control.address
        if self.config.sidecar and auth.configured_secret() is None:
            # Workers another launcher starts on this host find the channel's key in this user's
            # private file (elsewhere they derive it from ETC_AGENT_SECRET).
            auth.write_local_secret(*auth.control_secret_name(control.address), node.control_keys.master)
        if self.config.sidecar:
            self.emit(
                "sidecar",
                {
                    "control_addr": control.address,
                    "nproc_per_node": self.config.nproc_per_node,
                    "note": f"workers attach with ETC_AGENT_ADDR={control.address} and LOCAL_RANK",
                },
            )
        return control

    def _close(self, control: JsonLineServer, worker_stores: WorkerStores) -> None:
        node = self.node
        node.state.close()
        node.stop_workers("agent exiting")
        if self._metrics_server is not None:
            self._metrics_server.close()
        for t in self._threads:
            t.join(timeout=2)
        control.stop()
        if self.config.sidecar:
            auth.remove_local_secret(*auth.control_secret_name(control.address))
        if node.liveness is not None:
            node.liveness.close()
        worker_stores.close()
        if node.forkserver is not None:
            node.forkserver.close()
        if node.lease is not None:
            try:
                node.lease.revoke()
            except StoreError:
                pass

    # ---- the main loop ------------------------------------------------------------------
    def _loop(self, generations: Generations, leaving: Leaving, generation_watch: GenerationWatch) -> int:
        """Each pass: a departure runs to its end; the generation is read and a new one acted on;
        the wait for ``--nnodes`` MIN members is bounded; the workers are checked."""
        node = self.node
        outage = _StoreOutage(self.config.join_timeout, self.emit)
        waiting_since: float | None = time.monotonic()
        while True:
            if node.state.state.leaving:
                return leaving.depart()
            now = time.monotonic()
            try:
                gen = generation_watch.read()
                outage.over()
                self.commits.retry()
            except StoreError as err:
                # Keep the workers running through a store outage, say so, give up after join_timeout.
                if outage.gives_up(now, err):
                    return 1
                self._pause(min(1.0, max(self.config.monitor_interval, 0.2)))
                continue
            if gen is not None:
                node.latest = gen  # kept when the record vanishes: the leader goes on after it
            if gen and (node.generation is None or gen.number != node.generation.number):
                previous = node.generation
                try:
                    code = generations.on_generation(gen)
                except StoreError as err:
                    # Acted on again next pass: a busy store's lost request does not end the agent.
                    node.generation = previous
                    self.emit("store_unreachable", {"error": str(err), "pending": f"generation {gen.number}"})
                    self._pause(0.2)
                    continue
                if code is not None:
                    return code
            # The wait for --nnodes MIN members is bounded by join_timeout, counted from when it began.
            if gen is None or gen.status == "waiting":
                waiting_since = waiting_since or now
                if now - waiting_since > self.config.join_timeout:
                    needed = {"members": len(gen.members) if gen else 0, "needed": self.config.min_nodes}
                    self.emit("join_timeout", {"seconds": self.config.join_timeout, **needed})
                    return 1
            else:
                waiting_since = None
            if node.workers is not None and node.generation is not None:
                self.supervision.check_workers(node.generation)
                self.supervision.maybe_rejoin()
                self.supervision.spares.maintain(now)
            self.supervision.watch_end(now)
            node.report_pending()
            self._pause(self.config.monitor_interval)

    def _pause(self, seconds: float) -> None:
        """Until the next pass: ``seconds``, or less when something wakes the loop. The wake is
        cleared either way: one left set (a watch's error during an outage) made every retry pass
        run at once, against a store that was not answering."""
        self.node.passes.passed()
        self.node.wake.wait(seconds)
        self.node.wake.clear()


class _EveryTenSeconds:
    """Whether a repeated complaint is due again (at most once per 10 s, from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said_at = float("-inf")

    def due(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._said_at < 10:
                return False
            self._said_at = now
            return True


class _StoreOutage:
    """How long the store has been unreachable: said every 10 s, given up after ``join_timeout``."""

    def __init__(self, join_timeout: float, emit: Emit):
        self.join_timeout, self.emit = join_timeout, emit
        self.since: float | None = None
        self.last_said = 0.0

    def over(self) -> None:
        if self.since is not None:
            self.emit("store_reachable", {"after_s": round(time.monotonic() - self.since, 1)})
        self.since = None

    def gives_up(self, now: float, err: StoreError) -> bool:
        self.since = self.since or now
        if now - self.last_said > 10:
            self.emit("store_unreachable", {"error": str(err), "for_s": round(now - self.since, 1)})
            self.last_said = now
        if now - self.since > self.join_timeout:
            self.emit("giving_up", {"reason": f"store unreachable for {self.join_timeout:.0f} s"})
            return True
        return False


def install_signal_handlers(agent: Agent, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Each of ``signals`` (etcrun: ``--signals-to-handle``): planned departure; a second one: stop now
    (a store host stops serving too). The first one is remembered: a job that did not finish then
    ends with torchrun's exit code for a signal, not 0."""

    def on_term(signum: int, frame: object) -> None:
        agent.emit("signal", {"signal": signal.Signals(signum).name})
        agent.request_departure(signal.Signals(signum))

    for sig in signals:
        signal.signal(sig, on_term)


__all__ = ["Agent", "install_signal_handlers"]
