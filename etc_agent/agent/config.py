"""One agent's settings: what ``etcrun`` flags (and a job config file) set, validated once here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class AgentConfig(BaseModel):
    """One agent's settings (from ``etcrun`` flags)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(description="Job id shared by all agents (--rdzv-id).")
    min_nodes: int = Field(1, ge=1, description="Fewer members than this: the job waits.")
    max_nodes: int = Field(1, ge=1, description="At most this many members; more agents wait as spares.")
    nproc_per_node: int = Field(1, ge=1, description="Workers per agent.")
    max_restarts: int = Field(0, ge=0, description="Worker-failure restarts before the job fails (torchrun's count).")
    monitor_interval: float = Field(0.1, gt=0, description="Seconds between checks of the workers.")
    worker_heartbeat_timeout: float = Field(
        30.0, ge=0, description="Seconds without a word from a worker-API process (its control thread polls every 0.1 s) "
        "before it counts as hung: killed and handled as a crash. 0: never.")
    reconfig_delay: float = Field(1.0, ge=0, description="Quiet time collecting joins/leaves into one generation.")
    lease_ttl: float = Field(5.0, gt=0, description="A node whose lease is not refreshed for this long is dead.")
    join_timeout: float = Field(600.0, gt=0, description="How long the job may wait for --nnodes MIN members.")
    shutdown_timeout: float = Field(30.0, ge=0, description="Grace between SIGTERM and SIGKILL for workers.")
    local_addr: str | None = Field(None, description="Address other nodes use for this node (default: this host's name).")
    node_rank: int | None = Field(None, description="Fixed position in the group order (--node-rank), if given.")
    log_format: str = Field("text", description="'json': one JSON line per agent event.")
    parallel: str | None = Field(None, description="--parallel spec (e.g. tp=2,pp=1,dp=auto); the leader resolves it per world.")
    model: str | None = Field(None, description="--model spec YAML: the policy picks auto tp/pp from it.")
    migration: str = Field("live", pattern="^(live|checkpoint)$", description="live: workers stay and state moves device to device; "
                           "checkpoint: workers save with DCP, exit, and new workers load with resharding (the baseline).")
    checkpoint_dir: str | None = Field(None, description="Directory shared by all nodes for --migration checkpoint and periodic checkpoints.")
    checkpoint_interval: int = Field(0, ge=0, description="Steps between periodic asynchronous checkpoints (0: none); "
                                     "what a failure leaves without a live copy is restored from the last one.")
    checkpoint_keep: int = Field(2, ge=1, description="Complete periodic checkpoints kept.")
    placement: Literal["fast", "resilient"] = Field("fast", description="fast: the least state moved, DP replicas spread over "
                                                   "nodes where that moves nothing more (the first generation, ties); resilient: the DP "
                                                   "replicas of every pipeline stage on different nodes where the devices allow, then the "
                                                   "least state moved. A layout one node's loss would lose state in is named in the record.")
    sidecar: bool = Field(False, description="Run beside workers that another launcher starts (``etc-agent sidecar``): they attach "
                          "over the control channel instead of being this agent's children.")
    control_addr: str | None = Field(None, description="host:port of the control channel workers reach (ETC_AGENT_ADDR); "
                                     "default 127.0.0.1 on a free port, or 127.0.0.1:29401 for a sidecar.")
