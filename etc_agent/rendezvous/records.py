"""JSON records kept in the membership store, validated with pydantic (never pickle).

Keys under the run prefix:

- ``nodes/<node_id>``: :class:`NodeRecord`, under the agent's lease (a lapsed lease = a dead node);
- ``leader``: :class:`LeaderRecord`, under the leader's lease (store-based election);
- ``generation``: :class:`GenerationRecord`, written only by the leader with compare-and-set;
- ``generations/<n>/master``: :class:`MasterRecord`, the rendezvous address chosen by the first member;
- ``generations/<n>/status/<node_id>``: :class:`NodeStatus`, what each agent's workers did.
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

    @property
    def world_size(self) -> int:
        return sum(self.num_devices)


class MasterRecord(Record):
    addr: str
    port: int


class NodeStatus(Record):
    state: Literal["running", "succeeded", "failed"]
    exit_codes: dict[int, int] = Field(default_factory=dict, description="Local rank -> exit code of workers that ended.")
    message: str = ""
