"""What a worker process is told through its environment, as one typed class read once at start-up.

The agent writes it (:func:`etc_agent.agent.worker_env.worker_env` builds every variable from a
:class:`WorkerSettings`); the worker reads it (:meth:`WorkerSettings.from_env` in ``Job()``, the
fork server and the switch's fault hooks), so each ``ETC_AGENT_*`` variable is spelled, typed,
defaulted and described here only. Variables a user sets (``ETC_AGENT_TIMEOUT``,
``ETC_AGENT_BACKEND``, ...) are read from the same class; a bad value fails at start-up with a
message naming the variable. The channel's key (``ETC_AGENT_TOKEN``) and the job's secret
(``ETC_AGENT_SECRET``, ``ETC_AGENT_SECRET_FILE``) belong to :mod:`etc_agent.utils.auth`, below
this layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

_TRUE = ("1", "true", "yes", "on")
SPARE_FD_VARIABLE = "ETC_AGENT_SPARE_FD"
"""Set in a warm spare worker's environment only (:attr:`WorkerSettings.spare_fd`)."""


class WorkerSettings(BaseModel):
    """Every variable of a worker's environment that the agent sets or the worker reads (by its name)."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")

    agent_addr: str | None = Field(
        None, alias="ETC_AGENT_ADDR", description="host:port of this node's agent's control channel."
    )
    elastic: bool = Field(
        True,
        alias="ETC_AGENT_ELASTIC",
        description="0: the worker API runs as a plain torchrun worker (no live migration) even under etcrun.",
    )
    local_rank: int = Field(
        0,
        ge=0,
        alias="ETC_AGENT_LOCAL_RANK",
        description="The agent's count of this worker on its node (LOCAL_RANK, then SLURM_LOCALID, where unset); "
        "--virtual-local-rank leaves it intact while LOCAL_RANK is 0.",
    )
    device_index: int | None = Field(
        None, ge=0, alias="LOCAL_RANK", description="torchrun's LOCAL_RANK: the CUDA device index of this worker."
    )
    node_id: str = Field("local", alias="ETC_AGENT_NODE_ID", description="The agent's node id.")
    generation: int = Field(
        0, ge=0, alias="ETC_AGENT_GENERATION", description="The generation the worker was started in."
    )
    migration: Literal["live", "checkpoint"] = Field(
        "live",
        alias="ETC_AGENT_MIGRATION",
        description="live, or checkpoint: at a switch save with DCP and exit; new workers load (the baseline).",
    )
    parallel: str | None = Field(
        None, alias="ETC_AGENT_PARALLEL", description="The generation's parallel config (tp=..,pp=..,dp=..)."
    )
    backend: str | None = Field(
        None, alias="ETC_AGENT_BACKEND", description="torch.distributed backend (default: nccl with CUDA, else gloo)."
    )
    timeout_s: float = Field(
        120.0,
        gt=0,
        alias="ETC_AGENT_TIMEOUT",
        description="Seconds: bounds every wait of a switch, every collective of the training mesh's groups and "
        "the wait for a generation.",
    )
    connect_timeout_s: float = Field(
        1.0,
        gt=0,
        alias="ETC_AGENT_CONNECT_TIMEOUT",
        description="Seconds: a gloo group not connected 5 x this after its store calls are over is given up "
        "(a peer died while it formed).",
    )
    vote_interval_s: float = Field(
        0.5,
        ge=0,
        alias="ETC_AGENT_VOTE_INTERVAL",
        description="Seconds of training between the ranks' step-boundary votes (0: a vote at every step); "
        "a new generation takes over up to this long after the agents see it.",
    )
    prepare: bool = Field(
        True,
        alias="ETC_AGENT_PREPARE",
        description="etcrun --prepare: enter a new generation's store, form its migration group and a "
        "member's training groups and (where the script allows it) build its state while still training "
        "(0: at the switch).",
    )
    checkpoint_dir: str | None = Field(
        None, alias="ETC_AGENT_CHECKPOINT_DIR", description="etcrun --checkpoint-dir: where checkpoints go."
    )
    checkpoint_interval: int = Field(
        0, ge=0, alias="ETC_AGENT_CHECKPOINT_INTERVAL", description="etcrun --checkpoint-interval (steps; 0: none)."
    )
    checkpoint_keep: int = Field(
        2, ge=1, alias="ETC_AGENT_CHECKPOINT_KEEP", description="etcrun --checkpoint-keep: checkpoints kept."
    )
    fresh_start: bool = Field(
        False, alias="ETC_AGENT_FRESH_START", description="etcrun --fresh-start: never resume from checkpoint_dir."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        alias="ETC_AGENT_LOG_FORMAT",
        description="etcrun --log-format: json makes the worker's own log records JSON lines on stderr.",
    )
    spare_fd: int | None = Field(
        None,
        ge=0,
        alias=SPARE_FD_VARIABLE,
        description="Set in a warm spare worker only: the socket its agent writes its adoption to "
        "(etc_agent.worker.spare).",
    )
    preload: tuple[str, ...] = Field(
        (), alias="ETC_AGENT_PRELOAD", description="Comma-separated modules the fork server imports before forking."
    )
    fault_sender_pause_s: float = Field(
        0.0,
        ge=0,
        alias="ETC_AGENT_FAULT_SENDER_PAUSE_S",
        description="Tests only: a sender pauses this long mid-migration (to be killed there).",
    )
    fault_checkpoint_commit_pause_s: float = Field(
        0.0,
        ge=0,
        alias="ETC_AGENT_FAULT_CHECKPOINT_COMMIT_PAUSE_S",
        description="Tests only: a checkpoint's commit pauses this long on one rank.",
    )

    @field_validator("elastic", mode="before")
    @classmethod
    def _elastic(cls, value: object) -> object:
        return value != "0" if isinstance(value, str) else value

    @field_validator("fresh_start", mode="before")
    @classmethod
    def _flag(cls, value: object) -> object:
        return value.strip().lower() in _TRUE if isinstance(value, str) else value

    @field_validator("checkpoint_interval", "checkpoint_keep", mode="before")
    @classmethod
    def _whole(cls, value: object) -> object:
        # Written as numbers by hand as often as by the agent ("100", "1e3").
        return int(float(value)) if isinstance(value, str) and value.strip() else value

    @field_validator("preload", mode="before")
    @classmethod
    def _names(cls, value: object) -> object:
        return tuple(n.strip() for n in value.split(",") if n.strip()) if isinstance(value, str) else value

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WorkerSettings:
        """The settings in ``environ``; a bad value raises ``ValueError`` naming its variable."""
        names = {field.alias: name for name, field in cls.model_fields.items() if field.alias}
        given: dict[str, str] = {alias: environ[alias] for alias in names if environ.get(alias, "") != ""}
        if "ETC_AGENT_LOCAL_RANK" not in given:
            fallback = environ.get("LOCAL_RANK") or environ.get("SLURM_LOCALID")
            if fallback:
                given["ETC_AGENT_LOCAL_RANK"] = fallback
        try:
            return cls.model_validate(given)
        except ValidationError as err:
            first = err.errors()[0]
            alias = str(first["loc"][0]) if first["loc"] else "environment"
            raise ValueError(f"{alias}={given.get(alias)!r}: {first['msg']}") from None

    def to_env(self) -> dict[str, str]:
        """The variables of the settings given when these were made (None: left out), as strings."""
        out: dict[str, str] = {}
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if name not in self.model_fields_set or value is None or field.alias is None:
                continue
            if isinstance(value, bool):
                out[field.alias] = "1" if value else "0"
            elif isinstance(value, tuple):
                out[field.alias] = ",".join(value)
            else:
                out[field.alias] = str(value)
        return out

    @property
    def cuda_index(self) -> int:
        """The CUDA device of this worker: LOCAL_RANK (0 under --virtual-local-rank), else the local rank."""
        return self.device_index if self.device_index is not None else self.local_rank
