"""etcrun's flags: torchrun's options with their names, defaults and ``PET_*`` variables, plus ETC's
own, as one typed model (each field's description is its help), and the checks of what they say.

The agent's settings (SETTING_FLAGS) take their help from AgentConfig's field descriptions, and
AgentConfig checks their values; the rest shape how this node's workers start (help marked
``[workers]``) or how the nodes find each other (``[rendezvous]``), and are checked here.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from etc_agent.agent.config import AgentConfig
from etc_agent.cli.options import TORCHRUN, Cli

WORKERS, RDZV = "[workers]", "[rendezvous]"
"""The end of the help of a flag that goes to how this node's workers start, or to how nodes find each other."""

SETTING_FLAGS: dict[str, str] = {
    "run_id": "--rdzv-id",
    "max_restarts": "--max-restarts",
    "monitor_interval": "--monitor-interval",
    "local_addr": "--local-addr",
    "node_rank": "--node-rank",
    "shutdown_timeout": "--shutdown-timeout",
    "migration": "--migration",
    "prepare": "--prepare",
    "spare_worker": "--spare-worker",
    "checkpoint_dir": "--checkpoint-dir",
    "checkpoint_interval": "--checkpoint-interval",
    "checkpoint_keep": "--checkpoint-keep",
    "fresh_start": "--fresh-start",
    "parallel": "--parallel",
    "model": "--model",
    "reconfig_delay": "--reconfig-delay",
    "lease_ttl": "--lease-ttl",
    "peer_timeout": "--peer-timeout",
    "log_format": "--log-format",
    "worker_heartbeat_timeout": "--worker-heartbeat-timeout",
    "placement": "--placement",
    "sidecar": "--sidecar",
    "control_addr": "--control-addr",
    "metrics_port": "--metrics-port",
    "metrics_addr": "--metrics-addr",
}
"""AgentConfig field -> the flag that sets it (and nothing else): the flag's help is the field's description."""
SHARED_FLAG_PARAMS = {
    "min_nodes": "nnodes",
    "max_nodes": "nnodes",
    "nproc_per_node": "nproc_per_node",
    "join_timeout": "rdzv_conf",
    "local_interface": "local_addr",
}
"""AgentConfig field -> the etcrun parameter of a flag that sets it among other things (its help names the field)."""


def _describe(field: str) -> str:
    return AgentConfig.model_fields[field].description or ""


class EtcrunFlags(BaseModel):
    """Everything etcrun is told, in the order ``etcrun --help`` lists it (:func:`flags_command`)."""

    model_config = ConfigDict(extra="forbid")

    training_script: Annotated[str | None, Cli(argument=True)] = Field(
        None, description="Script to run (or module with -m, executable with --no-python)."
    )
    training_script_args: Annotated[list[str] | None, Cli(argument=True)] = Field(
        None, description="Arguments for the script."
    )
    nnodes: Annotated[str, TORCHRUN] = Field(
        "1:1",
        description=f"N, or MIN:MAX for an elastic job. MIN: {_describe('min_nodes')} MAX: {_describe('max_nodes')}",
    )
    nproc_per_node: Annotated[str, TORCHRUN] = Field(
        "1", description=f"{_describe('nproc_per_node')} N, auto (the GPUs, else the CPUs), cpu or gpu."
    )
    rdzv_backend: Annotated[str, TORCHRUN] = Field(
        "static", description=f"etcd-v3 (etcd), or embedded (c10d, static): a store hosted by one agent. {RDZV}"
    )
    rdzv_endpoint: Annotated[str, TORCHRUN] = Field(
        "", description=f"host:port of etcd or of the embedded store. {RDZV}"
    )
    rdzv_id: Annotated[str, TORCHRUN] = Field("none", description=_describe("run_id"))
    rdzv_conf: Annotated[str, TORCHRUN] = Field(
        "",
        description=f"key=value,... Agent settings: join_timeout: {_describe('join_timeout')} "
        f"lease_ttl: as --lease-ttl (wins over it). Store options {RDZV}: is_host: 1 if this agent "
        "hosts the embedded store, 0 if not; read_timeout: seconds per etcd request; secret_file: a file "
        "holding the job's secret (embedded store; or ETC_AGENT_SECRET).",
    )
    standalone: Annotated[bool, TORCHRUN] = Field(
        False, description=f"One node, embedded store on a free local port, random run id. {RDZV}"
    )
    max_restarts: Annotated[int | None, TORCHRUN] = Field(None, description=_describe("max_restarts"))
    monitor_interval: Annotated[float, TORCHRUN] = Field(0.1, description=_describe("monitor_interval"))
    start_method: Annotated[str, TORCHRUN] = Field(
        "forkserver",
        description="forkserver (default): Python workers are forked from one process per node that imported "
        "torch once (milliseconds per worker, also for a restart); spawn: each worker is a new "
        f"interpreter (seconds). fork: as forkserver. {WORKERS}",
    )
    role: Annotated[str, TORCHRUN] = Field("default", description=f"Worker role name (ROLE_NAME). {WORKERS}")
    module: Annotated[bool, Cli(short=("-m",), torchrun=True)] = Field(
        False, description=f"Run the script as a Python module. {WORKERS}"
    )
    no_python: Annotated[bool, TORCHRUN] = Field(
        False, description=f"Run the script directly, not through python. {WORKERS}"
    )
    run_path: Annotated[bool, TORCHRUN] = Field(
        False, description=f"Run the script as a path (the default way here). {WORKERS}"
    )
    log_dir: Annotated[Path | None, TORCHRUN] = Field(
        None, description=f"Directory for worker logs and error files. {WORKERS}"
    )
    redirects: Annotated[str, Cli(short=("-r",), torchrun=True)] = Field(
        "0", description=f"Workers' std streams to files in --log-dir: 0-3 or rank:value,... {WORKERS}"
    )
    tee: Annotated[str, Cli(short=("-t",), torchrun=True)] = Field(
        "0", description=f"Like --redirects but also to the console. {WORKERS}"
    )
    local_ranks_filter: Annotated[str, TORCHRUN] = Field(
        "", description=f"Only these local ranks' output on the console, e.g. 0,1. {WORKERS}"
    )
    node_rank: Annotated[int, TORCHRUN] = Field(0, description=_describe("node_rank"))
    master_addr: Annotated[str, TORCHRUN] = Field(
        "127.0.0.1", description=f"Static rendezvous: address of node rank 0. {RDZV}"
    )
    master_port: Annotated[int, TORCHRUN] = Field(29500, description=f"Static rendezvous: port on node rank 0. {RDZV}")
    local_addr: Annotated[str | None, TORCHRUN] = Field(None, description=_describe("local_addr"))
    shutdown_timeout: Annotated[int | None, TORCHRUN] = Field(None, description=_describe("shutdown_timeout"))
    event_log_handler: Annotated[str, TORCHRUN] = Field(
        "null",
        description="Accepted for compatibility: torch's event handlers are not called; the agent's events go to its log (--log-format json for one JSON line each).",
    )
    duplicate_stdout_filters: Annotated[str, TORCHRUN] = Field(
        "",
        description="Comma-separated substrings: workers' stdout lines containing any of them are also written to filtered_stdout.log in the attempt's log directory (',,' is a literal comma). "
        + WORKERS,
    )
    duplicate_stderr_filters: Annotated[str, TORCHRUN] = Field(
        "", description=f"Like --duplicate-stdout-filters, for stderr (filtered_stderr.log). {WORKERS}"
    )
    logs_specs: Annotated[str | None, TORCHRUN] = Field(
        None,
        description=f"torchrun.logs_specs entry point: only the default layout is supported (log files under --log-dir). {WORKERS}",
    )
    numa_binding: Annotated[str | None, TORCHRUN] = Field(
        None,
        description=f"node, socket, exclusive or core-complex: not supported (CPU affinity is left to the system); rejected rather than ignored. {WORKERS}",
    )
    signals_to_handle: Annotated[str, TORCHRUN] = Field(
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        description="Signals that end this node's part of the job (planned departure; a second one stops at once), comma-separated.",
    )
    virtual_local_rank: Annotated[bool, TORCHRUN] = Field(
        False,
        description=f"LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES narrowed to its own device (index 0). {WORKERS}",
    )
    migration: str = Field("live", description=_describe("migration"))
    prepare: str = Field("on", description=_describe("prepare"))
    spare_worker: str = Field("on", description=_describe("spare_worker"))
    checkpoint_dir: Path | None = Field(None, description=_describe("checkpoint_dir"))
    checkpoint_interval: int = Field(0, description=_describe("checkpoint_interval"))
    checkpoint_keep: int = Field(2, description=_describe("checkpoint_keep"))
    fresh_start: bool = Field(False, description=_describe("fresh_start"))
    parallel: str | None = Field(None, description=_describe("parallel"))
    model: Path | None = Field(None, description=_describe("model"))
    etcd_ca_cert: str | None = Field(None, description=f"CA bundle for etcd TLS. {RDZV}")
    etcd_cert: str | None = Field(None, description=f"Client certificate for etcd mutual TLS. {RDZV}")
    etcd_key: str | None = Field(None, description=f"Client key for etcd mutual TLS. {RDZV}")
    etcd_user: str | None = Field(None, description=f"etcd user name. {RDZV}")
    etcd_password: Annotated[str | None, Cli(envvar="ETC_AGENT_ETCD_PASSWORD")] = Field(
        None, description=f"etcd password (or ETC_AGENT_ETCD_PASSWORD). {RDZV}"
    )
    reconfig_delay: float = Field(1.0, description=_describe("reconfig_delay"))
    lease_ttl: float = Field(5.0, description=_describe("lease_ttl"))
    peer_timeout: float = Field(1.0, description=_describe("peer_timeout"))
    log_format: str = Field("text", description=_describe("log_format"))
    log_level: str | None = Field(
        None,
        description="What the console says: notice (the default: one line per generation, warnings and "
        "failures, as quiet as torchrun), info (every agent event), debug, warning, error. Default: "
        "torchrun's LOGLEVEL variable, else notice. The agent's log file (agent.log in its directory "
        "under --log-dir) has every event.",
    )
    worker_heartbeat_timeout: float = Field(30.0, description=_describe("worker_heartbeat_timeout"))
    placement: str = Field("fast", description=_describe("placement"))
    sidecar: bool = Field(False, description=_describe("sidecar"))
    control_addr: str | None = Field(None, description=_describe("control_addr"))
    metrics_port: Annotated[int | None, TORCHRUN] = Field(None, description=_describe("metrics_port"))
    metrics_addr: str | None = Field(None, description=_describe("metrics_addr"))
    config: Path | None = Field(
        None,
        description="Job YAML (configs/jobs/*.yaml): etcrun's options by name, "
        "script and script_args; flags given here win.",
    )

    def check_supported(self) -> None:
        """What etcrun cannot honour is refused rather than ignored."""
        if self.logs_specs is not None:
            raise ValueError(
                f"--logs-specs {self.logs_specs}: custom LogsSpecs are not supported; worker logs go under --log-dir "
                "(<run>_<node>/attempt_<n>/<local_rank>/stdout.log)"
            )
        if self.numa_binding is not None:
            raise ValueError(
                f"--numa-binding {self.numa_binding}: not supported by etcrun (set CPU affinity with numactl or your scheduler)"
            )
        if self.sidecar and self.training_script is not None:
            raise ValueError(
                f"--sidecar starts no workers: remove the training script ({self.training_script}); start it with "
                "`etc-agent workers` or your own launcher, ETC_AGENT_ADDR pointing here"
            )
        if not self.sidecar and self.training_script is None:
            raise ValueError(
                "the training script is missing (or use --sidecar / `etc-agent sidecar` to run beside workers started elsewhere)"
            )
        if self.module and self.no_python:
            raise ValueError("-m/--module and --no-python cannot be used together")


def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``N`` or ``MIN:MAX``. The range is checked here as well as in AgentConfig:
    --standalone replaces it before AgentConfig sees it, and torchrun rejects it even then."""
    lo, sep, hi = text.partition(":")
    try:
        low = int(lo)
        high = int(hi) if sep else low
    except ValueError:
        raise ValueError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if low < 1 or high < low:
        raise ValueError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return low, high


def parse_nproc(text: str) -> int:
    if text in ("cpu", "auto"):
        try:
            import torch

            if text == "auto" and torch.cuda.is_available():
                return torch.cuda.device_count()
        except ImportError:
            pass
        return os.cpu_count() or 1
    if text == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--nproc-per-node gpu: no CUDA device here")
        return torch.cuda.device_count()
    if not text.isdigit():  # 0 is AgentConfig's to reject
        raise ValueError(f"--nproc-per-node {text!r}: expected a positive integer, auto, cpu or gpu")
    return int(text)


def parse_rdzv_conf(text: str) -> dict[str, str]:
    out = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--rdzv-conf item {item!r}: expected key=value")
        out[key.strip()] = value.strip()
    return out


def parse_filters(text: str) -> list[str]:
    """torchrun's comma-separated filter list: ``a,b`` is two filters, ``a,,b`` the one filter ``a,b``."""
    if not text:
        return []
    escaped = "\0"
    return [part.replace(escaped, ",") for part in text.replace(",,", escaped).split(",") if part]


def parse_signals(text: str) -> list[signal.Signals]:
    out: list[signal.Signals] = []
    for name in (n.strip().upper() for n in text.split(",")):
        if not name:
            continue
        try:
            sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        except KeyError:
            raise ValueError(f"--signals-to-handle: {name!r} is not a signal name (e.g. SIGTERM,SIGUSR1)") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"--signals-to-handle: {sig.name} cannot be handled")
        out.append(sig)
    if not out:
        raise ValueError("--signals-to-handle needs at least one signal (default SIGTERM,SIGINT,SIGHUP,SIGQUIT)")
    return out
