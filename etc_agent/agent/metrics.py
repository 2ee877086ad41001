"""One agent's Prometheus metrics (``etcrun --metrics-port``): what its node is doing, what each
switch cost, how its store and workers behave.

The metrics are fed from three places, each at the edge where the fact is known:

- the agent's event stream (:meth:`AgentMetrics.observe_event`: every ``emit`` passes through it):
  switches from the ``migration`` records, worker exits and restarts, fencing, checkpoint commits,
  lease losses, abandoned generations;
- its store client (:meth:`AgentMetrics.observe_store`: every request's latency and outcome);
- its workers' polls (:meth:`AgentMetrics.observe_progress`: the step each worker is at and how long
  its last step took).

The node's state (phase, generation, members, spares, leadership) is read when scraped, from a
:class:`NodeView` the agent gives, so it is never stale. Every metric carries the ``node`` label (one
value per agent); the other labels are bounded sets (:data:`SWITCH_KINDS`, :data:`STALL_PHASES`,
store operations, local ranks): never a step, sample or generation number. A switch is counted by
the one agent whose worker reported its record (new rank 0's node), so a sum over nodes is the
job's count.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, StateSetMetricFamily
from prometheus_client.registry import Collector

from etc_agent.protocol.phases import Phase

log = logging.getLogger("etc_agent.agent")

SWITCH_KINDS = ("join", "planned_leave", "crash_replica", "restart_in_place", "resume", "reconfigure")
"""What a switch was: a node joined, one left on purpose, a crash the replicas covered, a crashed
worker restarted in place (the others may not shrink), the job resumed from storage, or a layout
change with the same devices."""

SWITCH_OUTCOMES = ("live", "redone", "restored")
"""How the state came through: every byte live, some steps trained again (an older version was
the newest complete one), or read from a checkpoint."""

STALL_PHASES: dict[str, tuple[str, ...]] = {
    "stop": ("stop_s",),
    "agree": ("arrive_s", "group_s", "migration_group_s", "exchange_s"),
    "build": ("build_s",),
    "plan": ("describe_s", "plan_s", "plan_check_s", "setup_s"),
    "transfer": ("transfer_s", "local_copy_s", "peer_wait_s", "migrate_other_s"),
    "swap": ("settle_s", "unaccounted_s"),
}
"""The stall's named parts as the metrics show them, each the sum of fields of the record's
:class:`~etc_agent.rendezvous.records.StallParts` (together, every field: they add up to the stall)."""

STALL_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PART_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class NodeView:
    """What the agent's node is at the moment of a scrape."""

    phase: Phase
    generation: int | None
    """The generation its workers serve (None before the first)."""
    members: int
    """Nodes in that generation."""
    spares: int | None
    """Registered nodes outside it (known to the leader only; None elsewhere)."""
    leading: bool


def switch_kind(record: Mapping[str, Any]) -> str:
    """The kind of the switch a migration record describes (one of :data:`SWITCH_KINDS`)."""
    if record.get("restored_from") or record.get("old_config") is None:
        return "resume"
    lost, old, new = record.get("lost") or [], record["old_world_size"], record["new_world_size"]
    if lost:
        return "crash_replica" if new < old else "restart_in_place"
    if new > old:
        return "join"
    if new < old:
        return "planned_leave"
    return "reconfigure"


def switch_outcome(record: Mapping[str, Any]) -> str:
    """How the state came through a switch (one of :data:`SWITCH_OUTCOMES`)."""
    if record.get("bytes_restored"):
        return "restored"
    return "redone" if record.get("redone_steps") else "live"


def stall_phases(parts: Mapping[str, float]) -> dict[str, float]:
    """A record's ``stall_parts`` summed into :data:`STALL_PHASES` (they add up to the same stall)."""
    return {phase: sum(float(parts.get(name) or 0.0) for name in names) for phase, names in STALL_PHASES.items()}


class _NodeCollector(Collector):
    """The node's state, read from the agent when scraped."""

    def __init__(self, node_id: str, view: Callable[[], NodeView]):
        self.node_id, self.view = node_id, view

    def collect(self):
        view = self.view()
        state = StateSetMetricFamily(
            "etc_agent_node_state", "The node's phase in the generation it serves.", labels=["node"]
        )
        state.add_metric([self.node_id], {phase.value: phase == view.phase for phase in Phase})
        yield state
        for name, doc, value in (
            (
                "etc_agent_generation",
                "The generation this node's workers serve (-1 before the first).",
                view.generation,
            ),
            ("etc_agent_members", "Nodes in that generation.", view.members),
            ("etc_agent_spares", "Registered nodes outside that generation (from the leader only).", view.spares),
            ("etc_agent_is_leader", "1 while this agent leads the job.", int(view.leading)),
        ):
            family = GaugeMetricFamily(name, doc, labels=["node"])
            if value is not None or name == "etc_agent_generation":
                family.add_metric([self.node_id], -1 if value is None else value)
            yield family


class AgentMetrics:
    """The metrics of one agent on a registry of its own (thread-safe: prometheus_client's are)."""

    def __init__(self, node_id: str, view: Callable[[], NodeView]):
        self.node_id = node_id
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_NodeCollector(node_id, view))
        self._add_switch_metrics()
        self._add_job_metrics()
        self._add_process_metrics()
        self._last_step: dict[int, int] = {}
        self._lock = threading.Lock()
        self._handlers: dict[str, Callable[[Mapping[str, Any]], None]] = {
            "migration": self._on_migration,
            "generation_published": self._on_published,
            "generation_abandoned": lambda _: self.abandoned.labels(node_id).inc(),
            "checkpoint_committed": self._on_commit,
            "checkpoint_commit_refused": lambda _: self.commits_refused.labels(node_id).inc(),
            "fenced": lambda _: self.fenced.labels(node_id).inc(),
            "workers_failed": self._on_workers_failed,
            "spare_worker_ready": lambda _: self.spare_ready.labels(node_id).set(1),
            "spare_worker_adopted": self._on_spare_adopted,
            "spare_worker_off": lambda _: self.spare_ready.labels(node_id).set(0),
        }

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, ["node", *labels], registry=self.registry)

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, ["node", *labels], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
        return Histogram(name, doc, ["node", *labels], buckets=buckets, registry=self.registry)

    def _add_switch_metrics(self) -> None:
        self.switches = self._counter(
            "etc_agent_switches", "Switches reported by this node's workers.", "kind", "outcome"
        )
        self.stall = self._histogram(
            "etc_agent_stall_seconds", "A switch's stall (slowest rank).", STALL_BUCKETS, "kind"
        )
        self.stall_part = self._histogram(
            "etc_agent_stall_part_seconds", "The stall's named parts.", PART_BUCKETS, "part"
        )
        self.bytes_moved = self._counter("etc_agent_bytes_moved", "Bytes a switch moved between processes.", "scope")
        self.transfer_rate = self._gauge(
            "etc_agent_transfer_bytes_per_second", "The last switch's bytes over its data phase."
        )
        self.plan = self._histogram(
            "etc_agent_plan_seconds", "Computing a switch's migration plan (slowest rank).", PART_BUCKETS
        )
        self.abandoned = self._counter("etc_agent_generations_abandoned", "Generations abandoned mid-switch.")

    def _add_job_metrics(self) -> None:
        self.published = self._counter(
            "etc_agent_generations_published", "Generations this agent published as the leader."
        )
        self.ready_layout = self._counter(
            "etc_agent_ready_layouts", "Published generations whose layout was ready before the event."
        )
        self.layout_time = self._histogram(
            "etc_agent_layout_seconds", "The leader's time on a generation's layout.", PART_BUCKETS
        )
        self.commits = self._counter("etc_agent_checkpoint_commits", "Periodic checkpoints committed.")
        self.commit_wait = self._histogram(
            "etc_agent_checkpoint_commit_seconds", "From the worker's ask to the commit.", PART_BUCKETS
        )
        self.commits_refused = self._counter(
            "etc_agent_checkpoint_commits_refused", "Commits refused (a newer generation)."
        )
        self.fenced = self._counter("etc_agent_fenced", "Times this agent fenced itself (lost the store alone).")

    def _add_process_metrics(self) -> None:
        self.store_latency = self._histogram("etc_agent_store_request_seconds", "Store requests.", STORE_BUCKETS, "op")
        self.store_errors = self._counter("etc_agent_store_errors", "Failed store requests.", "op")
        self.lease_renewals = self._counter("etc_agent_lease_renewals", "Lease refreshes the store answered.")
        self.lease_misses = self._counter(
            "etc_agent_lease_misses", "Lease refreshes that failed (the lease found expired included)."
        )
        self.worker_exits = self._counter(
            "etc_agent_worker_failures",
            "Workers that failed: cause error (exit code > 0) or signal, and the exit code (-N: signal N).",
            "cause",
            "code",
        )
        self.worker_restarts = self._counter("etc_agent_worker_restarts", "Workers restarted in place.")
        self.spare_ready = self._gauge(
            "etc_agent_spare_worker_ready", "1 while a warm spare worker waits, ready to take a crashed rank."
        )
        self.spare_adoptions = self._counter(
            "etc_agent_spare_worker_adoptions", "Crashed workers whose place the warm spare took."
        )
        self.steps = self._counter("etc_agent_steps", "Steps trained, as the workers report them.", "local_rank")
        self.step_time = self._gauge(
            "etc_agent_step_seconds", "The last step's time, as the worker reports it.", "local_rank"
        )
        self.data_position = self._gauge(
            "etc_agent_data_position", "Samples the worker's data loader has handed out.", "local_rank"
        )

    # ---- feeds --------------------------------------------------------------------------
    def observe_event(self, event: str, fields: Mapping[str, Any]) -> None:
        handler = self._handlers.get(event)
        if handler is not None:
            handler(fields)

    def observe_store(self, op: str, seconds: float, ok: bool) -> None:
        self.store_latency.labels(self.node_id, op).observe(seconds)
        if not ok:
            self.store_errors.labels(self.node_id, op).inc()
        if op == "lease_refresh":
            (self.lease_renewals if ok else self.lease_misses).labels(self.node_id).inc()

    def observe_progress(self, local_rank: int, step: int, step_s: float | None, position: int | None) -> None:
        """A worker's poll: the step it is at (the next one to train), its last step's time, its data position."""
        rank = str(local_rank)
        with self._lock:
            last = self._last_step.get(local_rank)
            self._last_step[local_rank] = step
        if last is not None and step > last:
            self.steps.labels(self.node_id, rank).inc(step - last)
        if step_s is not None:
            self.step_time.labels(self.node_id, rank).set(step_s)
        if position is not None:
            self.data_position.labels(self.node_id, rank).set(position)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

    # ---- events -------------------------------------------------------------------------
    def _on_migration(self, record: Mapping[str, Any]) -> None:
        if record.get("method", "live") != "live":
            return
        node, kind = self.node_id, switch_kind(record)
        self.switches.labels(node, kind, switch_outcome(record)).inc()
        self.stall.labels(node, kind).observe(float(record["total_stall_s"]))
        for phase, seconds in stall_phases(record.get("stall_parts") or {}).items():
            self.stall_part.labels(node, phase).observe(seconds)
        inter = int(record.get("bytes_moved_inter_node") or 0)
        self.bytes_moved.labels(node, "inter_node").inc(inter)
        self.bytes_moved.labels(node, "intra_node").inc(int(record["bytes_moved"]) - inter)
        transfer_s = float(record.get("transfer_s") or 0.0)
        if record["bytes_moved"] and transfer_s > 0:
            self.transfer_rate.labels(node).set(record["bytes_moved"] / transfer_s)
        self.plan.labels(node).observe(float(record.get("plan_s") or 0.0))

    def _on_published(self, fields: Mapping[str, Any]) -> None:
        self.published.labels(self.node_id).inc()
        if fields.get("layout_ready"):
            self.ready_layout.labels(self.node_id).inc()
        if fields.get("layout_s") is not None:
            self.layout_time.labels(self.node_id).observe(float(fields["layout_s"]))

    def _on_commit(self, fields: Mapping[str, Any]) -> None:
        self.commits.labels(self.node_id).inc()
        self.commit_wait.labels(self.node_id).observe(float(fields.get("waited_s") or 0.0))

    def _on_workers_failed(self, fields: Mapping[str, Any]) -> None:
        codes = fields.get("exit_codes") or {}
        for code in codes.values():
            if code is not None and code != 0:
                self.worker_exits.labels(self.node_id, "signal" if code < 0 else "error", str(code)).inc()
        restarting = fields.get("restarting") or ()
        if restarting:
            self.worker_restarts.labels(self.node_id).inc(len(restarting))

    def _on_spare_adopted(self, fields: Mapping[str, Any]) -> None:
        self.spare_adoptions.labels(self.node_id).inc()
        self.spare_ready.labels(self.node_id).set(0)  # until the next one says it is ready


def metered(emit: Callable[[str, dict], None], metrics: AgentMetrics | None) -> Callable[[str, dict], None]:
    """``emit`` that feeds ``metrics`` first (a metrics bug is logged, never raised into the agent)."""
    if metrics is None:
        return emit

    def both(event: str, fields: dict) -> None:
        try:
            metrics.observe_event(event, fields)
        except Exception:  # the event still goes out; only the metric is lost
            log.exception("metrics: event %s not counted", event)
        emit(event, fields)

    return both
