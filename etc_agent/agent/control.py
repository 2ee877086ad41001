"""The messages a worker sends its agent on the control channel (``ETC_AGENT_ADDR``), as pydantic models.

Every request is one JSON object, validated against :data:`ControlRequest` (the ``op`` field picks
the model) before the agent acts on it; anything else gets an error reply naming the field.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from etc_agent.rendezvous.records import MigrationRecord

MAX_REASON = 2000


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Hello(_Request):
    """A worker started: it registers (``elastic``: it uses the worker API and lives across generations)."""

    op: Literal["hello"]
    local_rank: int = Field(ge=0)
    pid: int | None = Field(None, gt=0)
    elastic: bool = False


class Attach(_Request):
    """Sidecar mode: a worker started by another launcher holds this connection open for as long as it
    lives; its closing is how the agent learns that the worker exited."""

    op: Literal["attach"]
    local_rank: int = Field(ge=0)
    pid: int = Field(gt=0)


class Exiting(_Request):
    """Sidecar mode: the exit code a worker is about to exit with (sent just before it detaches)."""

    op: Literal["exiting"]
    local_rank: int = Field(ge=0)
    pid: int = Field(gt=0)
    code: int


class Heartbeat(_Request):
    """A worker is alive (workers of plain scripts; the worker API's polls count as heartbeats too)."""

    op: Literal["heartbeat"]
    local_rank: int = Field(ge=0)


class AssignmentQuery(_Request):
    """The newest generation number and what this worker is in the generation its node serves."""

    op: Literal["assignment"]
    local_rank: int = Field(ge=0)


class GenerationQuery(_Request):
    """The generation this node's workers run and the newest one in the store."""

    op: Literal["generation"]


class _WithReason(_Request):
    reason: str = ""

    @field_validator("reason")
    @classmethod
    def _shorten(cls, value: str) -> str:
        return value[:MAX_REASON]


class SwitchFailed(_WithReason):
    """A worker's switch into ``generation`` failed (a peer died mid-migration): abandon it."""

    op: Literal["switch_failed"]
    local_rank: int = Field(ge=0)
    generation: int = Field(ge=0)


class Fatal(_WithReason):
    """The job cannot go on (training state lost, a build that does not fit): fail it, no restart."""

    op: Literal["fatal"]


class Finished(_Request):
    """Training rank 0 completed the last step."""

    op: Literal["finished"]
    step: int = Field(ge=0)
    generation: int = Field(ge=0)


class Trained(_Request):
    """Training rank 0 committed its first optimizer step: from now on the job has state to lose."""

    op: Literal["trained"]
    step: int = Field(ge=0)


class Migration(_Request):
    """New rank 0's record of the migration it completed."""

    op: Literal["migration"]
    record: MigrationRecord


ControlRequest = Annotated[
    Union[Hello, Attach, Exiting, Heartbeat, AssignmentQuery, GenerationQuery, SwitchFailed, Fatal, Finished, Trained, Migration],
    Field(discriminator="op"),
]
CONTROL_REQUEST: TypeAdapter[ControlRequest] = TypeAdapter(ControlRequest)
