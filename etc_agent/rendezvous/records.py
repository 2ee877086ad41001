"""JSON records kept in the membership store, validated with pydantic (never pickle).

Keys under the run prefix:

- ``nodes/<node_id>``: :class:`NodeRecord`, under the agent's lease (a lapsed lease = a dead node);
- ``leader``: :class:`LeaderRecord`, under the leader's lease (store-based election);
- ``generation``: :class:`GenerationRecord`, written only by the leader with compare-and-set;
- ``generations/<n>/master``: :class:`MasterRecord`, the rendezvous address chosen by the first member;
- ``generations/<n>/status/<node_id>``: :class:`NodeStatus`, what each agent's workers did;
- ``generations/<n>/abandoned/<node_id>``: :class:`AbandonRecord`, a node saw generation n fail
  (a peer vanished mid-switch); the leader publishes the next one. Written without a lease, so it
  outlives a departing agent.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = Field(SCHEMA_VERSION, description="Format of this record; newer ones are rejected.")

    def dumps(self) -> str:
        return self.model_dump_json()

    @classmethod
    def loads(cls, text: str):
        """Parse and validate; raise ValueError with the reason for foreign or malformed values."""
        try:
            record = cls.model_validate_json(text)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ValueError(f"invalid {cls.__name__}: {where + ': ' if where else ''}{first.get('msg')}") from None
        if record.schema_version > SCHEMA_VERSION:
            raise ValueError(f"{cls.__name__} has schema version {record.schema_version}, newer than {SCHEMA_VERSION}")
        return record


class NodeRecord(Record):
    node_id: str = Field(description="Unique per agent process.")
    host: str = Field(description="Address other nodes reach this node at.")
    num_devices: int = Field(ge=1, description="Workers this agent runs (--nproc-per-node).")
    pid: int = Field(description="Agent process id.")
    node_rank_hint: int | None = Field(None, description="--node-rank, when the user fixed it.")
    leaving: bool = Field(False, description="The agent received SIGTERM and is departing.")
    restarting: list[int] = Field(
        default_factory=list,
        description="Local ranks restarted after a crash that do not run yet (they hold no state).",
    )
    crashed_in: int | None = Field(
        None, description="While restarting: the generation whose worker crashed (its failure to be handled)."
    )
    probe_port: int | None = Field(
        None,
        description="TCP port (all interfaces of ``host``) that accepts and closes connections while the "
        "agent lives: the leader probes it when peers report a failure (refused: the agent is gone).",
    )
    ready: bool = Field(
        True,
        description="False while a node joining an elastic job starts its workers; "
        "the leader adds it once they run, so the others do not wait for their start.",
    )


class LeaderRecord(Record):
    node_id: str


class GenerationRecord(Record):
    number: int = Field(ge=0)
    status: Literal["running", "waiting", "failed", "succeeded"] = Field(
        description="running: workers run with these members; waiting: fewer nodes than --nnodes MIN; "
        "failed / succeeded: the job is over."
    )
    members: list[str] = Field(default_factory=list, description="Node ids in group-rank order.")
    num_devices: list[int] = Field(default_factory=list, description="Workers per member, same order.")
    restart_count: int = Field(0, ge=0, description="Restarts after worker failures so far (torchrun's count).")
    reason: str = Field("", description="Why this generation exists (join, leave, failure, start).")
    parallel: str | None = Field(
        None, description="Parallel config of this world (tp=..,pp=..,dp=..,zero=..), from --parallel."
    )
    senders: list[str] = Field(
        default_factory=list, description="Departing nodes whose workers send their state, then exit."
    )
    sender_devices: list[int] = Field(default_factory=list, description="Workers per sender, same order.")
    sender_local_ranks: list[list[int]] | None = Field(
        None,
        description="Local ranks of each sender that send, same order (None: 0 .. workers-1); a worker "
        "a node is restarting after a crash holds nothing and is left out.",
    )
    started: bool = Field(False, description="An earlier generation ran: training state exists somewhere.")
    unreachable_hosts: list[str] = Field(
        default_factory=list,
        description="Addresses of the previous generation's members this one dropped as unreachable (their "
        "liveness ports went silent) that no member of this one shares: the survivors' workers shut their "
        "sockets to them, which ends a collective blocked on a silent host.",
    )
    published_at: float = Field(0.0, description="Wall-clock time the leader published this generation.")
    probe_addresses: list[str] = Field(
        default_factory=list,
        description="``host:port`` of each member's liveness port, same order as members (empty where "
        "unknown): a member that loses the store asks its peers there whether they still reach it.",
    )
    layout_ready: bool = Field(
        False,
        description="The leader had this layout and placement ready before the event (worked out while the "
        "previous generation trained, for exactly these members): the decision spent nothing on it.",
    )
    layout_seconds: float | None = Field(
        None, description="Seconds the decision spent fitting the layout and placing its ranks (0 when ready)."
    )
    placement: list[str] | None = Field(
        None,
        description="Device (node:local) of each training rank, when the leader placed them "
        "(worker-API jobs with --parallel); otherwise ranks follow member order.",
    )
    not_resilient: list[str] = Field(
        default_factory=list,
        description="Why one node's loss would lose state no survivor holds "
        "(empty: every shard has copies on two nodes); --placement resilient spreads replicas first.",
    )

    @property
    def world_size(self) -> int:
        return sum(self.num_devices)

    def member_devices(self) -> list[str]:
        """``node:local_rank`` of every member's devices, in member order (the group order)."""
        return [f"{n}:{d}" for n, k in zip(self.members, self.num_devices) for d in range(k)]

    def sender_device_names(self) -> list[str]:
        """``node:local_rank`` of every sender's devices, in sender order."""
        return [f"{n}:{d}" for n, locals_ in zip(self.senders, self._sender_locals()) for d in locals_]

    def _sender_locals(self) -> list[list[int]]:
        if self.sender_local_ranks is not None:
            return self.sender_local_ranks
        return [list(range(k)) for k in self.sender_devices]

    def sends(self, node_id: str, local_rank: int) -> bool:
        """Whether that worker of a sender takes part in the migration."""
        return node_id in self.senders and local_rank in self._sender_locals()[self.senders.index(node_id)]

    def transport_devices(self, with_senders: bool) -> list[str]:
        """The migration group's devices by transport rank: the members', then (live) the senders'."""
        return self.member_devices() + (self.sender_device_names() if with_senders else [])

    def peer_probes(self, node_id: str) -> list[tuple[str, str, int]]:
        """(node id, host, liveness port) of every other member whose port is known, in member order."""
        found = []
        for member, address in zip(self.members, self.probe_addresses):
            host, _, port = address.rpartition(":")
            if member != node_id and host and port.isdigit():
                found.append((member, host.strip("[]"), int(port)))
        return found

    def role_of(self, node_id: str, with_senders: bool) -> Literal["member", "sender", "spare"]:
        """A node's part in this generation (``with_senders``: senders take part, i.e. live migration)."""
        if node_id in self.members:
            return "member"
        return "sender" if with_senders and node_id in self.senders else "spare"

    def transport_rank(self, node_id: str, local_rank: int) -> int:
        """Transport rank of a member's or a sender's device (see :meth:`transport_devices`)."""
        if node_id in self.members:
            return sum(self.num_devices[: self.members.index(node_id)]) + local_rank
        index = self.senders.index(node_id)
        return self.world_size + sum(self.sender_devices[:index]) + self._sender_locals()[index].index(local_rank)

    def training_rank(self, node_id: str, local_rank: int) -> int:
        """Training rank of a member's device: its place in :attr:`placement`, or member order."""
        device = f"{node_id}:{local_rank}"
        if self.placement and device in self.placement:
            return self.placement.index(device)
        return self.transport_rank(node_id, local_rank)


class CheckpointRecord(Record):
    """The newest committed periodic checkpoint (``checkpoint``): written in one transaction only
    while the ``generation`` key is still at ``revision``, so an agent cut off from the job (its
    generation replaced) never commits over the live job's checkpoint."""

    step: int = Field(ge=0)
    generation: int = Field(ge=0, description="The generation the checkpoint was made in.")
    revision: int = Field(ge=0, description="The store revision that generation was published at.")
    path: str
    committed_at: float = Field(description="Wall-clock time of the commit.")


class MasterRecord(Record):
    addr: str
    port: int


class StallParts(BaseModel):
    """One process's stall (the one that stalled longest) in consecutive parts that add up to it."""

    model_config = ConfigDict(extra="forbid")

    stop_s: float = Field(
        description="Training stopped until the assignment was in hand: the state described, the old groups torn down, the checkpointer settled, the agent asked."
    )
    arrive_s: float = Field(description="Until every process of the generation reached its store.")
    group_s: float = Field(description="Forming the training group and the mesh.")
    build_s: float = Field(description="Building the new layout's model and optimizer.")
    migration_group_s: float = Field(description="Forming the migration group (members and senders).")
    exchange_s: float = Field(description="Saying which versions of the state each process holds.")
    describe_s: float = Field(description="Describing the state held and exchanging the descriptions.")
    plan_s: float = Field(description="Computing the migration plan.")
    transfer_s: float = Field(description="The data phase: pack, send and receive, unpack.")
    local_copy_s: float = Field(description="Copies inside one process (regions that stay on their device).")
    plan_check_s: float = Field(
        0.0, description="The plan's hash compared across processes (includes waiting for the slowest planner)."
    )
    setup_s: float = Field(
        0.0,
        description="The new shards given storage (and their pages made resident, where that still ran in the "
        "background) and this process's pieces indexed.",
    )
    peer_wait_s: float = Field(
        0.0, description="This process's data phase done, until every process finished its own (the slowest receiver)."
    )
    migrate_other_s: float = Field(
        description="The rest of the migration: the versions chosen, snapshots dropped, the executor's own bookkeeping."
    )
    settle_s: float = Field(description="Carrying the plain state and resuming, until the record.")
    unaccounted_s: float = Field(
        description="The stall less the parts above (marks that overlapped or were not reached)."
    )


class MigrationRecord(Record):
    """What one migration did, written by new rank 0 (``generations/<n>/migration``)."""

    generation: int
    method: Literal["live", "checkpoint"] = Field(
        "live",
        description="live: device to device; checkpoint: DCP save, "
        "restart every worker, load with resharding (the baseline).",
    )
    old_config: str | None
    new_config: str
    old_world_size: int
    new_world_size: int
    devices: list[str] = Field(description="Device of each new rank.")
    senders: list[str] = Field(default_factory=list, description="Devices that only sent (departing).")
    lost: list[str] = Field(default_factory=list, description="Devices whose state was gone (failures).")
    reason: str = ""
    step: int = Field(description="Training resumed at this global step.")
    bytes_moved: int
    bytes_moved_intra_node: int
    bytes_moved_inter_node: int
    bytes_reused: int = Field(0, description="Bytes of new state already in place on their device.")
    state_bytes: int = Field(description="Total bytes of model and optimizer state.")
    checkpoint_bytes: int = Field(
        description="Bytes a checkpoint-based migration moves: every element written once, "
        "every new rank reading its shards."
    )
    bytes_restored: int = Field(
        0,
        description="Bytes read from a checkpoint: live, only what no live process held; "
        "checkpoint method, everything every new rank loaded.",
    )
    restored_from: str | None = Field(None, description="The checkpoint directory they were read from.")
    checkpoint_api: Literal["boxes", "state_dict"] | None = Field(
        None,
        description="checkpoint method: how the state went through DCP. state_dict: FSDP2's own path "
        "(torch.distributed.checkpoint.state_dict get/set_state_dict); boxes: the described shards.",
    )
    redone_steps: int = Field(
        0, description="Steps trained again: the live state was newer than the step resumed from."
    )
    detect_s: float = Field(description="Generation published (or failure seen) until every rank stopped.")
    leave_spread_s: float | None = Field(
        None,
        description="After a failure: from the first process that left training (its collective failed) "
        "to the last; how long the death took to reach every survivor.",
    )
    agree_s: float = Field(description="Stopped until the new group formed.")
    rebuild_s: float = Field(description="Building the new layout's model and optimizer (build + state).")
    plan_s: float
    transfer_s: float = Field(description="Data phase of the slowest rank (pack, send/receive, unpack).")
    inter_node_gbit_s: float | None = Field(
        None,
        description="The bytes moved between nodes over transfer_s, in Gbit/s as links are rated (None: none "
        "crossed a node); on a link that carried them all, the share of its rate the migration used.",
    )
    total_stall_s: float = Field(description="Training stopped until training resumed, on the slowest rank.")
    num_prepared: int = Field(
        0,
        description="Live: processes that had arrived at the generation and formed its migration group while "
        "still training (etcrun --prepare); the others did it inside the stall.",
    )
    num_built_ahead: int = Field(
        0,
        description="Live: members whose training groups formed and whose state was built while still "
        "training (a gloo job whose build allows it: job.start(build, build_ahead=True)).",
    )
    bytes_touched_ahead: int = Field(
        0,
        description="Live: bytes of new shards made resident before the data phase (one write per memory page), "
        "summed over the members: built ahead, by the preparation; built in the switch, in the background while "
        "the plan was made. A new shard equal to one the member holds is not touched (its storage is taken over).",
    )
    planned_ahead: bool = Field(
        False,
        description="Live: the plan was made while training from every process's description, published on the "
        "generation's store, and every process found it still valid: no planning and no hash check in the stall.",
    )
    stall_parts: StallParts | None = Field(
        None, description="Live: the slowest rank's stall in named parts that add up to it (None: the checkpoint way)."
    )


class AbandonRecord(Record):
    generation: int = Field(ge=0)
    reason: str = Field("", description="What failed (first line of the error, or which sender died).")


class PeerFailureRecord(Record):
    generation: int = Field(ge=0)
    reason: str = Field("", description="The first line of the error a worker's collective raised.")


class NodeStatus(Record):
    state: Literal["running", "succeeded", "failed"]
    exit_codes: dict[int, int] = Field(
        default_factory=dict, description="Local rank -> exit code of workers that ended."
    )
    message: str = ""
    fatal: bool = Field(
        False, description="The failure cannot be fixed by a restart (training state lost): the job fails now."
    )
