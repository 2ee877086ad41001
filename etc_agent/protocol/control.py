"""The messages a worker sends its agent on the control channel (``ETC_AGENT_ADDR``), as pydantic models.

Every request is one JSON object, validated against :data:`ControlRequest` (the ``op`` field picks
the model) before the agent acts on it; anything else gets an error reply naming the field.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from etc_agent.rendezvous.records import GenerationRecord, MigrationRecord

MAX_REASON = 2000
MAX_HOLD_S = 5.0
"""The longest an agent holds a worker's poll (its reply unchanged); well under the request timeout."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Hello(_Request):
    """A worker started: it registers (``elastic``: it uses the worker API and lives across generations)."""

    op: Literal["hello"] = "hello"
    local_rank: int = Field(ge=0)
    pid: int | None = Field(None, gt=0)
    elastic: bool = False


class Attach(_Request):
    """Sidecar mode: a worker started by another launcher holds this connection open for as long as it
    lives; its closing is how the agent learns that the worker exited."""

    op: Literal["attach"] = "attach"
    local_rank: int = Field(ge=0)
    pid: int = Field(gt=0)


class Exiting(_Request):
    """Sidecar mode: the exit code a worker is about to exit with (sent just before it detaches)."""

    op: Literal["exiting"] = "exiting"
    local_rank: int = Field(ge=0)
    pid: int = Field(gt=0)
    code: int


class Heartbeat(_Request):
    """A worker is alive (workers of plain scripts; the worker API's polls count as heartbeats too)."""

    op: Literal["heartbeat"] = "heartbeat"
    local_rank: int = Field(ge=0)


class AssignmentQuery(_Request):
    """The newest generation number and what this worker is in the generation its node serves."""

    op: Literal["assignment"] = "assignment"
    local_rank: int = Field(ge=0)
    step: int | None = Field(None, ge=0, description="The next step this worker trains (None before training).")
    step_s: float | None = Field(None, ge=0, description="Its last step's time, in seconds.")
    data_position: int | None = Field(None, ge=0, description="Samples its data loader has handed out.")
    known: str | None = Field(
        None, description="The digest of the last reply this worker holds: the agent answers once its reply differs."
    )
    hold_s: float = Field(
        0.0, ge=0, le=MAX_HOLD_S, description="With ``known``: answer an unchanged reply after this many seconds."
    )


class GenerationQuery(_Request):
    """The generation this node's workers run and the newest one in the store."""

    op: Literal["generation"] = "generation"


class _WithReason(_Request):
    reason: str = ""

    @field_validator("reason")
    @classmethod
    def _shorten(cls, value: str) -> str:
        return value[:MAX_REASON]


class SwitchFailed(_WithReason):
    """A worker's switch into ``generation`` failed (a peer died mid-migration): abandon it."""

    op: Literal["switch_failed"] = "switch_failed"
    local_rank: int = Field(ge=0)
    generation: int = Field(ge=0)


class PeerFailed(_WithReason):
    """A worker's collective failed mid-step in ``generation`` (a peer died): the leader then checks
    which member agents are gone instead of waiting for their leases."""

    op: Literal["peer_failed"] = "peer_failed"
    local_rank: int = Field(ge=0)
    generation: int = Field(ge=0)


class Fatal(_WithReason):
    """The job cannot go on (training state lost, a build that does not fit): fail it, no restart."""

    op: Literal["fatal"] = "fatal"


class Finished(_Request):
    """Training rank 0 completed the last step."""

    op: Literal["finished"] = "finished"
    step: int = Field(ge=0)
    generation: int = Field(ge=0)


class Trained(_Request):
    """Training rank 0 committed its first optimizer step: from now on the job has state to lose."""

    op: Literal["trained"] = "trained"
    step: int = Field(ge=0)


class Migration(_Request):
    """New rank 0's record of the migration it completed."""

    op: Literal["migration"] = "migration"
    record: MigrationRecord


class Leave(_Request):
    """Sidecar mode: the workers' launcher (``etc-agent workers``) got SIGTERM, as every container of a
    terminating pod does: a planned departure of this node, as the agent's own SIGTERM would start
    (the workers hand their state over and exit 0). Idempotent; it never escalates a departure."""

    op: Literal["leave"] = "leave"
    reason: str = Field("", max_length=MAX_REASON)


class CommitCheckpoint(_Request):
    """Training rank 0 wrote a periodic checkpoint (its state file still ``etc_state.json.pending``):
    the agent commits it in the store, fenced on the revision of ``generation``."""

    op: Literal["commit_checkpoint"] = "commit_checkpoint"
    step: int = Field(ge=0)
    generation: int = Field(ge=0)
    path: str = Field(description="The checkpoint's directory (``<dir>/step<S>-g<generation>``).")


ControlRequest = Annotated[
    Hello
    | Attach
    | Exiting
    | Heartbeat
    | AssignmentQuery
    | GenerationQuery
    | SwitchFailed
    | PeerFailed
    | Fatal
    | Finished
    | Trained
    | Migration
    | Leave
    | CommitCheckpoint,
    Field(discriminator="op"),
]
CONTROL_REQUEST: TypeAdapter[ControlRequest] = TypeAdapter(ControlRequest)


# ---- replies --------------------------------------------------------------------------------
class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Assignment(_Reply):
    """What one worker is in the generation its node serves: everything the switch needs to know of it.

    Transport ranks number the migration group: the members' devices in member order, then (live
    migration) the senders'. A sender has no training rank.
    """

    generation: int = Field(ge=0)
    pg_rank: int = Field(ge=0, description="This worker's transport rank in the generation's migration group.")
    pg_world_size: int = Field(ge=1, description="Processes in the migration group (members' and senders' devices).")
    rank: int | None = Field(description="Training rank in the new world; None: a sender, which exits after sending.")
    world_size: int = Field(ge=0, description="Training ranks of the generation.")
    parallel: str | None = Field(description="The generation's layout (None: the script's default resolves it).")
    store_addr: str = Field(description="Host of the generation's TCPStore (the first member hosts it).")
    store_port: int = Field(ge=0, le=65535)
    devices: list[str] = Field(description="``node:local_rank`` of each transport rank.")
    leaving: bool = Field(description="This node is a sender of the generation.")
    standby_after: bool = Field(
        False,
        description="A sender of a node that restarts a crashed worker: after sending it waits, without "
        "state, for the generation that takes the node back.",
    )
    started: bool = Field(description="An earlier generation ran: training state may exist somewhere.")
    trained: bool = Field(description="An optimizer step was committed: a state nobody holds is lost, not built again.")
    reason: str = ""
    published_at: float = Field(description="When the leader published the generation (wall clock).")
    node_id: str

    @property
    def device(self) -> str:
        return self.devices[self.pg_rank]

    @property
    def member_devices(self) -> list[str]:
        """The training ranks' devices in member order (what a migration record lists)."""
        return self.devices[: self.world_size]

    @property
    def sender_devices(self) -> list[str]:
        return self.devices[self.world_size :]


class HelloReply(_Reply):
    node_id: str
    generation: int | None
    sidecar: bool = False
    env: dict[str, str] = Field(
        default_factory=dict, description="Sidecar: what etcrun puts in its children's environment."
    )


class AssignmentReply(_Reply):
    """The worker's poll: the newest generation and its own part in the one its node serves."""

    latest: int | None
    latest_status: str | None
    assignment: Assignment | None
    finished: bool = Field(description="Training rank 0 reported the last step done.")
    standby: bool = Field(
        description="The node serves no generation yet (a warm joiner waits as long as its node does)."
    )
    stop: bool = Field(False, description="Sidecar: the agent asks this worker to stop.")
    unreachable_hosts: list[str] = Field(
        default_factory=list,
        description="The newest generation's ``unreachable_hosts``: the worker shuts its sockets to them.",
    )
    fenced: bool = Field(
        False,
        description="The agent lost the store while its peers reach it (etc_agent.agent.fence): the "
        "worker trains no further step and commits no checkpoint until the agent says otherwise.",
    )
    digest: str = Field("", description="A digest of every other field (the next poll's ``known``).")

    def with_digest(self) -> AssignmentReply:
        """This reply with ``digest`` set from its other fields."""
        body = self.model_dump_json(exclude={"digest"}).encode()
        return self.model_copy(update={"digest": hashlib.blake2b(body, digest_size=8).hexdigest()})


class Ack(_Reply):
    """A request carried out (``hold``: the connection stays open while the worker lives, sidecar)."""

    ok: bool = True
    hold: bool = False


class GenerationReply(_Reply):
    """What the agent serves: the generation its workers are in, the newest one read, whether it leaves."""

    node_id: str
    running: GenerationRecord | None
    latest: GenerationRecord | None
    leaving: bool


class CommitReply(_Reply):
    """What became of a checkpoint commit."""

    outcome: Literal["committed", "refused", "pending"] = Field(
        description="committed: the store took it and ``etc_state.json`` is in place; refused: its generation "
        "is no longer current (the directory is removed); pending: the store does not answer (or this node "
        "is fenced), the agent commits it once the store confirms the generation."
    )
    reason: str = ""


ControlReply = Ack | HelloReply | AssignmentReply | GenerationReply | CommitReply
"""Every reply of the agent on the control channel."""


class SpareAdoption(BaseModel):
    """What an agent writes to its warm spare's channel (one JSON line) when the spare takes the place
    of a crashed worker (:mod:`etc_agent.worker.spare`); not a request of the control channel."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    local_rank: int = Field(ge=0, description="The local rank whose worker the spare becomes.")
    env: dict[str, str] = Field(description="The whole environment a worker of that local rank is started with.")
    process_name: str = Field("worker", description="What ps shows for it from then on (the workers' name).")
