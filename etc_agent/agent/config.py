"""One agent's settings: what ``etcrun`` flags (and a job config file) set, validated once here.

Each field's description is the help text of the etcrun flag that sets it, and every check of a
setting lives here (ranges, choices, what needs what): etcrun maps its flags to these fields and
turns a rejected value into one line naming the flag (``etc_agent.cli.etcrun_config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

_SHARED_DIR = "(a directory every node can reach)"


LIVE_RESTARTS = 3
"""Crash restarts per node of a live job when ``--max-restarts`` is not given: torchrun's 0 would take
a node out at its first crash although a restart costs the others nothing."""


_INTERFACE = (
    "The workers' gloo and NCCL sockets bind to the interface that holds this address "
    "(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) unless the environment already names one."
)


class AgentConfig(BaseModel):
    """One agent's settings (from ``etcrun`` flags)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    run_id: str = Field(description="Job id shared by all nodes.")
    min_nodes: int = Field(1, ge=1, description="The fewest nodes the job runs on; with fewer it waits.")
    max_nodes: int = Field(1, ge=1, description="The most nodes the job uses; more agents wait as spares.")
    nproc_per_node: int = Field(1, ge=1, description="Workers per node.")
    max_restarts: int | None = Field(
        None,
        ge=0,
        description="Scripts without the worker API: worker-failure restarts of the job before it fails "
        "(torchrun's count; default 0). Live (worker-API) jobs: restarts of a crashed worker per node; the "
        "others go on meanwhile and the node rejoins once it runs; after the last one the node leaves "
        f"(default {LIVE_RESTARTS}).",
    )
    monitor_interval: float = Field(0.1, gt=0, description="Seconds between checks of the workers.")
    worker_heartbeat_timeout: float = Field(
        30.0,
        ge=0,
        description="Seconds without a word from a worker-API process (its control thread asks at least once a second) "
        "before it counts as hung: killed and handled as a crash. 0: never.",
    )
    reconfig_delay: float = Field(
        1.0,
        ge=0,
        description="Seconds of quiet that close one generation's membership changes "
        "(joins and leaves within it make one generation).",
    )
    lease_ttl: float = Field(
        5.0, gt=0, description="Seconds after which a node whose lease is not refreshed counts as dead."
    )
    peer_timeout: float = Field(
        1.0,
        ge=0,
        description="Seconds a node's liveness port may go without answering the leader's probes (a few "
        "a second) before the node counts as unreachable: a silent partition or a dead host leaves the "
        "job then, not at its lease, and rejoins once its port answers again. Shorter: a shorter stall "
        "on a silent host, and a congested network more likely to drop a live one. 0: leave it to the lease.",
    )
    join_timeout: float = Field(
        600.0, gt=0, description="Seconds the job may wait for --nnodes MIN members before it fails."
    )
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        description="Seconds between SIGTERM and SIGKILL for workers "
        "(default TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30).",
    )
    local_addr: str | None = Field(
        None,
        description="Address other nodes use to reach this node (default: the source address of this "
        f"host's route to the rendezvous endpoint; 127.0.0.1 for a rendezvous on loopback). {_INTERFACE}",
    )
    local_interface: str | None = Field(None, description=_INTERFACE)
    node_rank: int | None = Field(None, description="This node's rank (static rendezvous; a position hint otherwise).")
    log_format: Literal["text", "json"] = Field("text", description="text, or json: one JSON line per agent event.")
    model: str | None = Field(
        None, description="Model spec YAML for the --parallel auto policy (it picks tp/pp from it)."
    )
    parallel: str | None = Field(
        None,
        description="Initial parallel config for worker-API scripts: tp=..,pp=..,dp=.. "
        "(each a number or auto), or auto; the leader resolves it for each membership.",
    )
    migration: Literal["live", "checkpoint"] = Field(
        "live",
        description="live: workers stay and state moves device to device; checkpoint: workers save with DCP, exit, "
        "and new workers load with resharding (the baseline).",
    )
    prepare: Literal["on", "off"] = Field(
        "on",
        description="on: a worker that hears of a new generation enters its store and forms its migration "
        "group, and a member of a gloo job its training groups and (with job.start(build, build_ahead=True)) "
        "its new state, while it still trains (the new shards' memory is then held from earlier on); off: all at "
        "the switch.",
    )
    spare_worker: Literal["on", "off"] = Field(
        "on",
        description="on: a node whose workers use the worker API keeps one warm spare process (the script run up "
        "to etc_agent.init(), no rank, no state) that takes a crashed worker's place without a process start; "
        "off: a crashed worker is forked again.",
    )
    checkpoint_dir: str | None = Field(
        None,
        description="Directory every node can reach: --migration checkpoint saves there; "
        "with --checkpoint-interval, periodic checkpoints.",
    )
    checkpoint_interval: int = Field(
        0,
        ge=0,
        description="Every N steps, an asynchronous DCP checkpoint in --checkpoint-dir; "
        "state that a failure leaves without any live copy is restored from it (only that "
        "state), and the steps since are trained again. 0: none.",
    )
    checkpoint_keep: int = Field(2, ge=1, description="Complete periodic checkpoints kept (older ones are deleted).")
    fresh_start: bool = Field(
        False,
        description="Start training from scratch although --checkpoint-dir holds complete checkpoints "
        "(without it a job started on such a directory resumes from the newest).",
    )
    placement: Literal["fast", "resilient"] = Field(
        "fast",
        description="fast: move the least state, with the DP replicas of a stage on different nodes where that "
        "costs nothing (first generation, ties); resilient: the DP replicas of every pipeline stage on different nodes "
        "where the devices allow (a node loss then loses no state), then the least state moved. A generation where one "
        "node's loss would lose state says so in its record and log.",
    )
    sidecar: bool = Field(
        False,
        description="Start no workers: run beside --nproc-per-node worker-API processes that another "
        "launcher starts with ETC_AGENT_ADDR and LOCAL_RANK (what `etc-agent sidecar` runs).",
    )
    control_addr: str | None = Field(
        None,
        description="host:port the workers reach this agent on (ETC_AGENT_ADDR); default "
        "127.0.0.1 on a free port, or 127.0.0.1:29401 with --sidecar.",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve this agent's Prometheus metrics on this port (GET /metrics only; 0: a free "
        "port, said in the `metrics_serving` event). Default: none served.",
    )
    metrics_addr: str | None = Field(
        None,
        description="The address the metrics port listens on (default: the agent's own address, "
        "--local-addr; 0.0.0.0 for every interface).",
    )

    @property
    def job_restarts(self) -> int:
        """Restarts of a job whose workers do not use the worker API (torchrun's meaning)."""
        return self.max_restarts if self.max_restarts is not None else 0

    @property
    def node_crash_restarts(self) -> int:
        """Crash restarts per node of a live job; the next crash takes the node out of the job."""
        return self.max_restarts if self.max_restarts is not None else LIVE_RESTARTS

    @field_validator("max_nodes")
    @classmethod
    def _not_below_min(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_nodes")
        if low is not None and value < low:
            raise ValueError(f"MAX ({value}) is below MIN ({low})")
        return value

    @field_validator("model")
    @classmethod
    def _model_spec_loads(cls, value: str | None) -> str | None:
        if value is not None:
            from etc_agent.layout.model import ModelSpec

            if not Path(value).exists():
                raise ValueError(f"{value}: no such file")
            ModelSpec.from_yaml(value)  # a bad spec fails here, not in the leader later
        return value

    @field_validator("parallel")
    @classmethod
    def _parallel_fits(cls, value: str | None, info: ValidationInfo) -> str | None:
        """The spec in its short form; what no membership can ever satisfy fails now rather than after join_timeout."""
        if not value:
            return None
        from etc_agent.layout.config import ParallelSpec

        try:
            spec = ParallelSpec.parse(value)
        except ValueError as err:  # its text names --parallel already, as does etcrun's line
            raise ValueError(str(err).replace("bad --parallel ", "", 1)) from None
        nproc, nodes = info.data.get("nproc_per_node"), info.data.get("max_nodes")
        if (spec.tp is None or spec.pp is None) and info.data.get("model") is None:
            raise ValueError(f"{value}: tp/pp auto needs --model (a model spec YAML for the policy)")
        if spec.tp is not None and nproc is not None and spec.tp > nproc:
            raise ValueError(
                f"{value}: a TP group stays inside one node, and nodes run {nproc} workers (--nproc-per-node)"
            )
        needed = spec.num_devices
        if needed is not None and nproc is not None and nodes is not None:
            if needed > nodes * nproc:
                raise ValueError(
                    f"{value} needs {needed} workers; --nnodes MAX {nodes} x --nproc-per-node "
                    f"{nproc} allows at most {nodes * nproc}"
                )
        return spec.short()

    @field_validator("control_addr")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None:
            from etc_agent.utils.jsonline import parse_address

            parse_address(value)
        return value

    @model_validator(mode="after")
    def _checkpoints_have_a_directory(self) -> AgentConfig:
        if self.checkpoint_dir is None:
            if self.migration == "checkpoint":
                raise ValueError(f"--migration checkpoint needs --checkpoint-dir {_SHARED_DIR}")
            if self.checkpoint_interval:
                raise ValueError(f"--checkpoint-interval needs --checkpoint-dir {_SHARED_DIR}")
        return self
