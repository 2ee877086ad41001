"""``etc-agent status``: a job's members, leader, generation, workers and last migration, read from
its membership store and shown as rich tables (or one JSON object)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from etc_agent.cli.jobstore import (
    EtcdCaCert,
    EtcdCert,
    EtcdKey,
    EtcdPassword,
    EtcdUser,
    RdzvBackend,
    RdzvEndpoint,
    RdzvId,
    open_job_store,
)
from etc_agent.protocol import keys
from etc_agent.rendezvous.records import GenerationRecord, LeaderRecord, MigrationRecord, NodeRecord, NodeStatus
from etc_agent.rendezvous.store import MembershipStore


@dataclass
class JobStatus:
    """What a job's membership store says of it."""

    nodes: list[NodeRecord] = field(default_factory=list)
    leader: str | None = None
    generation: GenerationRecord | None = None
    statuses: dict[str, NodeStatus] = field(default_factory=dict)
    """Node id -> its workers' status in the current generation."""
    migration: MigrationRecord | None = None
    rejected: list[dict[str, str]] = field(default_factory=list)
    """Records that could not be read: ``{"key": ..., "reason": ...}``, as ``--json`` prints them."""

    def to_json(self, run_id: str) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "leader": self.leader,
            "nodes": [n.model_dump() for n in self.nodes],
            "generation": self.generation.model_dump() if self.generation else None,
            "status": {k: v.model_dump() for k, v in self.statuses.items()},
            "last_migration": self.migration.model_dump() if self.migration else None,
            "rejected": self.rejected,
        }


def read_status(store: MembershipStore) -> JobStatus:
    job = JobStatus()
    for kv in store.get_prefix(keys.NODES):
        try:
            job.nodes.append(NodeRecord.loads(kv.value))
        except ValueError as err:
            job.rejected.append({"key": kv.key, "reason": str(err)})
    leader_kv = store.get(keys.LEADER)
    gen_kv = store.get(keys.GENERATION)
    job.leader = LeaderRecord.loads(leader_kv.value).node_id if leader_kv else None
    job.generation = GenerationRecord.loads(gen_kv.value) if gen_kv else None
    if job.generation is not None:
        for kv in store.get_prefix(keys.statuses(job.generation.number)):
            job.statuses[keys.node_of(kv.key)] = NodeStatus.loads(kv.value)
    migration_kv = store.get(keys.LAST_MIGRATION)
    if migration_kv is not None:
        try:
            job.migration = MigrationRecord.loads(migration_kv.value)
        except ValueError as err:
            job.rejected.append({"key": keys.LAST_MIGRATION, "reason": str(err)})
    return job


def status(
    rdzv_endpoint: RdzvEndpoint,
    rdzv_id: RdzvId,
    rdzv_backend: RdzvBackend = "etcd-v3",
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object instead of tables.")] = False,
    etcd_ca_cert: EtcdCaCert = None,
    etcd_cert: EtcdCert = None,
    etcd_key: EtcdKey = None,
    etcd_user: EtcdUser = None,
    etcd_password: EtcdPassword = None,
) -> None:
    """Show a job's members, leader, generation and worker status from the membership store."""
    store = open_job_store(
        rdzv_backend, rdzv_endpoint, rdzv_id, etcd_ca_cert, etcd_cert, etcd_key, etcd_user, etcd_password
    )
    with store:
        job = read_status(store)
    if json_out:
        sys.stdout.write(json.dumps(job.to_json(rdzv_id)) + "\n")
        return
    print_status(Console(), rdzv_id, job)


def print_status(console: Console, run_id: str, job: JobStatus) -> None:
    generation = job.generation
    if generation is None:
        console.print(f"run {run_id}: no generation yet ({len(job.nodes)} nodes registered)")
    else:
        console.print(
            f"run {run_id}: generation {generation.number} {generation.status}, world size {generation.world_size}, "
            f"restarts {generation.restart_count}; {generation.reason}"
        )
        if generation.not_resilient:
            console.print(f"not resilient to one node's loss: {'; '.join(generation.not_resilient)}")
    console.print(members_table(job))
    if job.migration is not None:
        console.print(migration_table(job.migration))


def members_table(job: JobStatus) -> Table:
    """One row per registered node: its group rank in the generation, its role, its workers' state."""
    table = Table(title="members", header_style="bold")
    for col in ("node", "host", "devices", "group rank", "role", "workers"):
        table.add_column(col)
    members = job.generation.members if job.generation else []
    for n in job.nodes:
        rank = str(members.index(n.node_id)) if n.node_id in members else "-"
        role = "leader" if n.node_id == job.leader else ("leaving" if n.leaving else "")
        state = job.statuses[n.node_id].state if n.node_id in job.statuses else ("spare" if rank == "-" else "")
        table.add_row(n.node_id, n.host, str(n.num_devices), rank, role, state)
    return table


def migration_table(m: MigrationRecord, title: str = "last migration") -> Table:
    """One migration record: what changed, what moved, and where the stall went."""
    table = Table(title=f"{title}: generation {m.generation} ({m.reason})", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("config", f"{m.old_config} ({m.old_world_size} ranks) -> {m.new_config} ({m.new_world_size} ranks)")
    table.add_row("resumed at step", str(m.step))
    if m.senders or m.lost:
        table.add_row("departed / lost devices", f"{', '.join(m.senders) or '-'} / {', '.join(m.lost) or '-'}")
    table.add_row("state", _mb(m.state_bytes))
    table.add_row(
        "moved",
        f"{_mb(m.bytes_moved)} (intra-node {_mb(m.bytes_moved_intra_node)}, inter-node {_mb(m.bytes_moved_inter_node)}); "
        f"kept in place {_mb(m.bytes_reused)}",
    )
    table.add_row("a checkpoint would move", f"{_mb(m.checkpoint_bytes)} (write once, every new rank reads its shards)")
    table.add_row(
        "stall",
        f"{m.total_stall_s:.3f} s: detect {m.detect_s:.3f}, agree {m.agree_s:.3f}, rebuild {m.rebuild_s:.3f}, "
        f"plan {m.plan_s:.3f}, transfer {m.transfer_s:.3f}",
    )
    if m.stall_parts is not None:
        parts = m.stall_parts.model_dump()
        table.add_row(
            "slowest rank's stall",
            ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {value:.3f}" for name, value in parts.items()),
        )
    return table


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
