"""``etcrun``: a drop-in replacement for ``torchrun`` (same flags, names and defaults, plus ETC's own).

    etcrun --nnodes 1:4 --nproc-per-node 8 --rdzv-backend etcd-v3 --rdzv-endpoint etcd:2379 \\
           --rdzv-id job42 train.py --lr 3e-4

The flags become a WorkerSpec (how this node's workers start), the rendezvous (how the nodes find
each other) and an AgentConfig, which owns the agent settings' checks and help texts: etcrun maps
each setting's flag to its field (SETTING_FLAGS) and turns a rejected value into one line naming
the flag, --rdzv-conf key, variable or --config key it came from.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import typer

from etc_agent.agent.agent import Agent, install_signal_handlers
from etc_agent.agent.config import AgentConfig
from etc_agent.agent.console import add_log_file, configure_logging, console_level
from etc_agent.agent.workers import WorkerSpec, parse_std_spec
from etc_agent.cli._entry import run_app
from etc_agent.cli.options import build_model
from etc_agent.rendezvous.embedded import EmbeddedStore, EmbeddedStoreServer, host_secret
from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore
from etc_agent.rendezvous.store import StoreError
from etc_agent.utils.jsonline import parse_address

ETCD_BACKENDS = {"etcd", "etcd-v2", "etcd-v3"}
EMBEDDED_BACKENDS = {"embedded", "c10d", "static"}

log = logging.getLogger("etc_agent.etcrun")
OMP_BANNER = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system "
    "being overloaded, please further tune the variable for optimal performance in your application as needed. \n"
    "*****************************************"
)
"""What torchrun says when it sets OMP_NUM_THREADS for the workers."""

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


SETTING_FLAGS: dict[str, str] = {
    "run_id": "--rdzv-id",
    "max_restarts": "--max-restarts",
    "monitor_interval": "--monitor-interval",
    "local_addr": "--local-addr",
    "node_rank": "--node-rank",
    "shutdown_timeout": "--shutdown-timeout",
    "migration": "--migration",
    "checkpoint_dir": "--checkpoint-dir",
    "checkpoint_interval": "--checkpoint-interval",
    "checkpoint_keep": "--checkpoint-keep",
    "fresh_start": "--fresh-start",
    "parallel": "--parallel",
    "model": "--model",
    "reconfig_delay": "--reconfig-delay",
    "lease_ttl": "--lease-ttl",
    "log_format": "--log-format",
    "worker_heartbeat_timeout": "--worker-heartbeat-timeout",
    "placement": "--placement",
    "sidecar": "--sidecar",
    "control_addr": "--control-addr",
}
"""AgentConfig field -> the flag that sets it (and nothing else): the flag's help is the field's description."""
SHARED_FLAG_PARAMS = {
    "min_nodes": "nnodes",
    "max_nodes": "nnodes",
    "nproc_per_node": "nproc_per_node",
    "join_timeout": "rdzv_conf",
}
"""AgentConfig field -> the etcrun parameter of a flag that sets it among other things (its help names the field)."""
RDZV_CONF_SETTINGS = ("join_timeout", "lease_ttl")
"""--rdzv-conf keys that are AgentConfig fields (the others, is_host and read_timeout, go to the store)."""
SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
WORKERS, RDZV = "[workers]", "[rendezvous]"
"""The end of the help of a flag that goes to how this node's workers start, or to how nodes find each other."""


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


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", ""):
        return True
    try:
        names = {socket.gethostname(), socket.getfqdn()}
        addrs = {info[4][0] for name in names for info in socket.getaddrinfo(name, None)}
        return host in names or host in addrs or socket.gethostbyname(host) in addrs
    except OSError:
        return False


def open_store(
    backend: str,
    endpoint: str,
    run_id: str,
    host_store: bool | None,
    etcd: EtcdOptions | None,
    wait_s: float,
    secret_file: str | None = None,
):
    """The membership store for this agent (and, for the embedded backend, the server when we host it)."""
    if backend in ETCD_BACKENDS:
        assert etcd is not None
        return EtcdStore(etcd, run_id), None
    host, _, port = endpoint.rpartition(":")
    parse_address(endpoint)  # a port out of range is the user's mistake, said in one line
    if host_store is None:
        host_store = _is_local(host)
    server = None
    if host_store:
        secret, fresh = host_secret(endpoint, secret_file)
        try:
            bind = host if host not in ("", "localhost") else "127.0.0.1"
            server = EmbeddedStoreServer(bind, int(port), secret=secret)
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            server = None  # another local agent hosts it (torchrun's c10d does the same)
        else:
            if fresh:  # a loopback store: its secret goes to this user's private file
                server.publish_local_secret(endpoint, run_id, secret)
    return EmbeddedStore(endpoint, run_id, connect_timeout_s=wait_s, secret_file=secret_file), server


STATIC_ENDPOINT_KEY = "etc_agent/membership_store"
"""Key in the static rendezvous' TCPStore that names the embedded membership store's address."""


def open_static_store(
    master_addr: str, master_port: int, node_rank: int, run_id: str, wait_s: float, secret_file: str | None = None
):
    """torchrun's static rendezvous: node rank 0 hosts a TCPStore on ``--master-addr:--master-port``,
    the store the workers reach at ``MASTER_ADDR:MASTER_PORT`` (``env://`` and ``tcp://`` inits
    alike). The membership store (embedded) listens on a free port beside it, and other nodes read
    its address from that TCPStore: the job needs no port but ``--master-port``.

    Returns ``(membership store, its server or None, the workers' TCPStore on node 0 or None)``.
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    if node_rank == 0:
        try:
            workers_store = TCPStore(
                master_addr, master_port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=wait_s)
            )
        except RuntimeError as err:
            raise ValueError(
                f"--master-port {master_port}: cannot listen on it ({str(err).splitlines()[0]}); "
                "is another job using it?"
            ) from None
        bind = "127.0.0.1" if master_addr in ("", "localhost") else master_addr
        if not _is_local(bind):
            bind = "0.0.0.0"
        secret, fresh = host_secret(f"{bind}:0", secret_file)
        server = EmbeddedStoreServer(bind, 0, secret=secret)
        endpoint = f"{master_addr}:{server.port}"
        if fresh:
            server.publish_local_secret(endpoint, run_id, secret)
        workers_store.set(STATIC_ENDPOINT_KEY, endpoint)
        store = EmbeddedStore(endpoint, run_id, connect_timeout_s=wait_s, secret=secret)
        return store, server, workers_store
    try:
        bootstrap = TCPStore(
            master_addr, master_port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=wait_s)
        )
        endpoint = bootstrap.get(STATIC_ENDPOINT_KEY).decode()
    except RuntimeError as err:
        raise StoreError(
            f"static rendezvous: node rank 0 did not answer at {master_addr}:{master_port} within {wait_s:.0f} s "
            f"({str(err).splitlines()[0]})"
        ) from None
    return EmbeddedStore(endpoint, run_id, connect_timeout_s=wait_s, secret_file=secret_file), None, None


def _describe(field: str) -> str:
    return AgentConfig.model_fields[field].description or ""


def _torchrun(flag: str, *short: str, help: str) -> Any:
    """A torchrun option: also spelled with underscores (--max_restarts) and read from its PET_* variable."""
    dest = flag.removeprefix("--").replace("-", "_")
    names = [*short, flag, *([f"--{dest}"] if "_" in dest else [])]
    return typer.Option(*names, envvar=f"PET_{dest.upper()}", show_envvar=False, help=help)


def _setting(field: str, torchrun: bool = False) -> Any:
    """The option of the AgentConfig setting ``field``: its flag from SETTING_FLAGS, its help the field's description."""
    if torchrun:
        return _torchrun(SETTING_FLAGS[field], help=_describe(field))
    return typer.Option(SETTING_FLAGS[field], help=_describe(field))


@app.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    help="Launch a training script on this node like torchrun, with live re-configuration when nodes come and go. "
    "Every torchrun option can also be set by its PET_* environment variable (PET_NPROC_PER_NODE=2); a flag wins over it. "
    f"Options marked {WORKERS} shape how this node's workers start, {RDZV} how the nodes find each other; "
    "the others are the agent's settings.",
)
def etcrun(
    ctx: typer.Context,
    training_script: Annotated[
        str | None, typer.Argument(help="Script to run (or module with -m, executable with --no-python).")
    ] = None,
    training_script_args: Annotated[list[str] | None, typer.Argument(help="Arguments for the script.")] = None,
    nnodes: Annotated[
        str,
        _torchrun(
            "--nnodes",
            help=f"N, or MIN:MAX for an elastic job. MIN: {_describe('min_nodes')} MAX: {_describe('max_nodes')}",
        ),
    ] = "1:1",
    nproc_per_node: Annotated[
        str,
        _torchrun(
            "--nproc-per-node", help=f"{_describe('nproc_per_node')} N, auto (the GPUs, else the CPUs), cpu or gpu."
        ),
    ] = "1",
    rdzv_backend: Annotated[
        str,
        _torchrun(
            "--rdzv-backend", help=f"etcd-v3 (etcd), or embedded (c10d, static): a store hosted by one agent. {RDZV}"
        ),
    ] = "static",
    rdzv_endpoint: Annotated[
        str, _torchrun("--rdzv-endpoint", help=f"host:port of etcd or of the embedded store. {RDZV}")
    ] = "",
    rdzv_id: Annotated[str, _setting("run_id", torchrun=True)] = "none",
    rdzv_conf: Annotated[
        str,
        _torchrun(
            "--rdzv-conf",
            help=f"key=value,... Agent settings: join_timeout: {_describe('join_timeout')} "
            f"lease_ttl: as --lease-ttl (wins over it). Store options {RDZV}: is_host: 1 if this agent "
            "hosts the embedded store, 0 if not; read_timeout: seconds per etcd request; secret_file: a file "
            "holding the job's secret (embedded store; or ETC_AGENT_SECRET).",
        ),
    ] = "",
    standalone: Annotated[
        bool, _torchrun("--standalone", help=f"One node, embedded store on a free local port, random run id. {RDZV}")
    ] = False,
    max_restarts: Annotated[int | None, _setting("max_restarts", torchrun=True)] = None,
    monitor_interval: Annotated[float, _setting("monitor_interval", torchrun=True)] = 0.1,
    start_method: Annotated[
        str,
        _torchrun(
            "--start-method",
            help="forkserver (default): Python workers are forked from one process per node that imported "
            "torch once (milliseconds per worker, also for a restart); spawn: each worker is a new "
            f"interpreter (seconds). fork: as forkserver. {WORKERS}",
        ),
    ] = "forkserver",
    role: Annotated[str, _torchrun("--role", help=f"Worker role name (ROLE_NAME). {WORKERS}")] = "default",
    module: Annotated[bool, _torchrun("--module", "-m", help=f"Run the script as a Python module. {WORKERS}")] = False,
    no_python: Annotated[
        bool, _torchrun("--no-python", help=f"Run the script directly, not through python. {WORKERS}")
    ] = False,
    run_path: Annotated[
        bool, _torchrun("--run-path", help=f"Run the script as a path (the default way here). {WORKERS}")
    ] = False,
    log_dir: Annotated[
        Path | None, _torchrun("--log-dir", help=f"Directory for worker logs and error files. {WORKERS}")
    ] = None,
    redirects: Annotated[
        str,
        _torchrun(
            "--redirects", "-r", help=f"Workers' std streams to files in --log-dir: 0-3 or rank:value,... {WORKERS}"
        ),
    ] = "0",
    tee: Annotated[str, _torchrun("--tee", "-t", help=f"Like --redirects but also to the console. {WORKERS}")] = "0",
    local_ranks_filter: Annotated[
        str,
        _torchrun("--local-ranks-filter", help=f"Only these local ranks' output on the console, e.g. 0,1. {WORKERS}"),
    ] = "",
    node_rank: Annotated[int, _setting("node_rank", torchrun=True)] = 0,
    master_addr: Annotated[
        str, _torchrun("--master-addr", help=f"Static rendezvous: address of node rank 0. {RDZV}")
    ] = "127.0.0.1",
    master_port: Annotated[
        int, _torchrun("--master-port", help=f"Static rendezvous: port on node rank 0. {RDZV}")
    ] = 29500,
    local_addr: Annotated[str | None, _setting("local_addr", torchrun=True)] = None,
    shutdown_timeout: Annotated[int | None, _setting("shutdown_timeout", torchrun=True)] = None,
    event_log_handler: Annotated[
        str,
        _torchrun(
            "--event-log-handler",
            help="Accepted for compatibility: torch's event handlers are not called; the agent's events go to its log (--log-format json for one JSON line each).",
        ),
    ] = "null",
    duplicate_stdout_filters: Annotated[
        str,
        _torchrun(
            "--duplicate-stdout-filters",
            help="Comma-separated substrings: workers' stdout lines containing any of them are also written to filtered_stdout.log in the attempt's log directory (',,' is a literal comma). "
            + WORKERS,
        ),
    ] = "",
    duplicate_stderr_filters: Annotated[
        str,
        _torchrun(
            "--duplicate-stderr-filters",
            help=f"Like --duplicate-stdout-filters, for stderr (filtered_stderr.log). {WORKERS}",
        ),
    ] = "",
    logs_specs: Annotated[
        str | None,
        _torchrun(
            "--logs-specs",
            help=f"torchrun.logs_specs entry point: only the default layout is supported (log files under --log-dir). {WORKERS}",
        ),
    ] = None,
    numa_binding: Annotated[
        str | None,
        _torchrun(
            "--numa-binding",
            help=f"node, socket, exclusive or core-complex: not supported (CPU affinity is left to the system); rejected rather than ignored. {WORKERS}",
        ),
    ] = None,
    signals_to_handle: Annotated[
        str,
        _torchrun(
            "--signals-to-handle",
            help="Signals that end this node's part of the job (planned departure; a second one stops at once), comma-separated.",
        ),
    ] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    virtual_local_rank: Annotated[
        bool,
        _torchrun(
            "--virtual-local-rank",
            help=f"LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES narrowed to its own device (index 0). {WORKERS}",
        ),
    ] = False,
    migration: Annotated[str, _setting("migration")] = "live",
    checkpoint_dir: Annotated[Path | None, _setting("checkpoint_dir")] = None,
    checkpoint_interval: Annotated[int, _setting("checkpoint_interval")] = 0,
    checkpoint_keep: Annotated[int, _setting("checkpoint_keep")] = 2,
    fresh_start: Annotated[bool, _setting("fresh_start")] = False,
    parallel: Annotated[str | None, _setting("parallel")] = None,
    model: Annotated[Path | None, _setting("model")] = None,
    etcd_ca_cert: Annotated[str | None, typer.Option("--etcd-ca-cert", help=f"CA bundle for etcd TLS. {RDZV}")] = None,
    etcd_cert: Annotated[
        str | None, typer.Option("--etcd-cert", help=f"Client certificate for etcd mutual TLS. {RDZV}")
    ] = None,
    etcd_key: Annotated[str | None, typer.Option("--etcd-key", help=f"Client key for etcd mutual TLS. {RDZV}")] = None,
    etcd_user: Annotated[str | None, typer.Option("--etcd-user", help=f"etcd user name. {RDZV}")] = None,
    etcd_password: Annotated[
        str | None,
        typer.Option(
            "--etcd-password",
            help=f"etcd password (or ETC_AGENT_ETCD_PASSWORD). {RDZV}",
            envvar="ETC_AGENT_ETCD_PASSWORD",
        ),
    ] = None,
    reconfig_delay: Annotated[float, _setting("reconfig_delay")] = 1.0,
    lease_ttl: Annotated[float, _setting("lease_ttl")] = 5.0,
    log_format: Annotated[str, _setting("log_format")] = "text",
    log_level: Annotated[
        str | None,
        typer.Option(
            "--log-level",
            help="What the console says: notice (the default: one line per generation, warnings and "
            "failures, as quiet as torchrun), info (every agent event), debug, warning, error. Default: "
            "torchrun's LOGLEVEL variable, else notice. The agent's log file (agent.log in its directory "
            "under --log-dir) has every event.",
        ),
    ] = None,
    worker_heartbeat_timeout: Annotated[float, _setting("worker_heartbeat_timeout")] = 30.0,
    placement: Annotated[str, _setting("placement")] = "fast",
    sidecar: Annotated[bool, _setting("sidecar")] = False,
    control_addr: Annotated[str | None, _setting("control_addr")] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Job YAML (configs/jobs/*.yaml): etcrun's options by name, "
            "script and script_args; flags given here win.",
        ),
    ] = None,
) -> None:
    flags = SimpleNamespace(
        **locals()
    )  # parse the flags -> WorkerSpec and AgentConfig (a rejected value: one line) -> run
    # Compared by name: click's ParameterSource lives in typer's vendored copy of click, not in an importable package.
    if _source(ctx, "training_script") == "COMMANDLINE" and _source(ctx, "training_script_args") == "DEFAULT_MAP":
        flags.training_script_args = None  # a script named on the command line comes with its own arguments
    _refuse_what_cannot_be_honoured(flags)
    handled_signals = parse_signals(flags.signals_to_handle)
    rdzv = _rendezvous(flags)
    agent_config = build_model(AgentConfig, _settings(ctx, flags, rdzv), names=_setting_names(ctx, flags, rdzv.conf))
    spec = _worker_spec(flags, agent_config.nproc_per_node)
    raise typer.Exit(_run(agent_config, spec, rdzv, flags, handled_signals))


def _source(ctx: typer.Context, name: str) -> str:
    source = ctx.get_parameter_source(name)
    return source.name if source is not None else ""


def _refuse_what_cannot_be_honoured(f: SimpleNamespace) -> None:
    if f.logs_specs is not None:
        raise ValueError(
            f"--logs-specs {f.logs_specs}: custom LogsSpecs are not supported; worker logs go under --log-dir "
            "(<run>_<node>/attempt_<n>/<local_rank>/stdout.log)"
        )
    if f.numa_binding is not None:
        raise ValueError(
            f"--numa-binding {f.numa_binding}: not supported by etcrun (set CPU affinity with numactl or your scheduler)"
        )
    if f.sidecar and f.training_script is not None:
        raise ValueError(
            f"--sidecar starts no workers: remove the training script ({f.training_script}); start it with "
            "`etc-agent workers` or your own launcher, ETC_AGENT_ADDR pointing here"
        )
    if not f.sidecar and f.training_script is None:
        raise ValueError(
            "the training script is missing (or use --sidecar / `etc-agent sidecar` to run beside workers started elsewhere)"
        )
    if f.module and f.no_python:
        raise ValueError("-m/--module and --no-python cannot be used together")


@dataclass
class Rendezvous:
    """How this node finds the others: the --rdzv-*, --master-*, --etcd-* and --standalone flags, resolved."""

    backend: str
    endpoint: str
    run_id: str
    conf: dict[str, str]
    host_store: bool | None = None
    etcd: EtcdOptions | None = None

    @property
    def secret_file(self) -> str | None:
        """``--rdzv-conf secret_file``: the job's secret for the embedded store (docs/security.md)."""
        return self.conf.get("secret_file")


ETCD_OPTION_FLAGS = {
    "endpoint": "--rdzv-endpoint",
    "ca_cert": "--etcd-ca-cert",
    "cert_key": "--etcd-key",
    "cert_cert": "--etcd-cert",
    "user": "--etcd-user",
    "password": "--etcd-password",
    "timeout_s": "--rdzv-conf read_timeout",
}


def _rendezvous(f: SimpleNamespace) -> Rendezvous:
    backend = f.rdzv_backend.strip().lower()
    if backend not in ETCD_BACKENDS | EMBEDDED_BACKENDS:
        raise ValueError(f"--rdzv-backend {f.rdzv_backend!r}: use etcd-v3 or embedded (c10d, static)")
    rdzv = Rendezvous(backend, f.rdzv_endpoint, f.rdzv_id, parse_rdzv_conf(f.rdzv_conf))
    if f.standalone:
        rdzv.backend, rdzv.run_id, rdzv.host_store = "embedded", f"standalone-{uuid.uuid4().hex[:8]}", True
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            rdzv.endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    elif backend == "static":
        rdzv.endpoint, rdzv.host_store = f"{f.master_addr}:{f.master_port}", f.node_rank == 0
    elif not rdzv.endpoint:
        raise ValueError(f"--rdzv-endpoint is required with --rdzv-backend {f.rdzv_backend}")
    if "is_host" in rdzv.conf:
        rdzv.host_store = rdzv.conf["is_host"].lower() in ("1", "true", "yes")
    if rdzv.backend in ETCD_BACKENDS:
        rdzv.etcd = build_model(
            EtcdOptions,
            dict(
                endpoint=rdzv.endpoint,
                ca_cert=f.etcd_ca_cert,
                cert_key=f.etcd_key,
                cert_cert=f.etcd_cert,
                user=f.etcd_user,
                password=f.etcd_password,
                timeout_s=rdzv.conf.get("read_timeout", 5),
            ),
            names=ETCD_OPTION_FLAGS,
        )
    return rdzv


def _settings(ctx: typer.Context, f: SimpleNamespace, rdzv: Rendezvous) -> dict[str, Any]:
    """AgentConfig's fields from the flags, as given: checking them is AgentConfig's part."""
    low, high = parse_nnodes(f.nnodes)
    values = {
        name: getattr(f, name)
        for name in (
            "max_restarts",
            "monitor_interval",
            "reconfig_delay",
            "log_format",
            "parallel",
            "migration",
            "checkpoint_interval",
            "checkpoint_keep",
            "fresh_start",
            "worker_heartbeat_timeout",
            "sidecar",
            "control_addr",
            "placement",
        )
    }
    values.update(
        run_id=rdzv.run_id,
        min_nodes=1 if f.standalone else low,
        max_nodes=1 if f.standalone else high,
        nproc_per_node=parse_nproc(f.nproc_per_node),
        lease_ttl=f.lease_ttl,
        shutdown_timeout=f.shutdown_timeout if f.shutdown_timeout is not None else os.environ.get(SHUTDOWN_ENV, 30),
        local_addr=f.local_addr or ("127.0.0.1" if f.standalone else None),
        node_rank=f.node_rank if rdzv.backend == "static" or _source(ctx, "node_rank") != "DEFAULT" else None,
        model=str(f.model) if f.model is not None else None,
        checkpoint_dir=str(f.checkpoint_dir.resolve()) if f.checkpoint_dir else None,
    )
    values.update({key: rdzv.conf[key] for key in RDZV_CONF_SETTINGS if key in rdzv.conf})
    return values


def _setting_names(ctx: typer.Context, f: SimpleNamespace, conf: dict[str, str]) -> dict[str, str]:
    """AgentConfig field -> how the user set it, for the one line that rejects its value: the flag
    (with its --rdzv-conf key), its PET_* variable, or the --config file and key."""
    names, envvars = {}, {param.name: param.envvar for param in ctx.command.params}
    for field in AgentConfig.model_fields:
        if field in RDZV_CONF_SETTINGS and field in conf:
            param, key = "rdzv_conf", f" {field}"
        else:
            param, key = SHARED_FLAG_PARAMS.get(field) or SETTING_FLAGS[field].removeprefix("--").replace("-", "_"), ""
        source = _source(ctx, param)
        if source == "DEFAULT_MAP":
            names[field] = f"--config {f.config}: {param}{key}"
        elif source == "ENVIRONMENT":
            names[field] = f"{envvars[param]}{key}"
        elif field == "shutdown_timeout" and f.shutdown_timeout is None:
            names[field] = SHUTDOWN_ENV
        else:
            names[field] = "--" + param.replace("_", "-") + key
    return names


def _worker_spec(f: SimpleNamespace, nproc: int) -> WorkerSpec:
    if f.start_method not in ("forkserver", "fork", "spawn"):
        raise ValueError(f"--start-method {f.start_method!r}: use forkserver, fork or spawn")
    filter_ranks = (
        {int(r) for r in f.local_ranks_filter.split(",") if r.strip()} if f.local_ranks_filter.strip() else None
    )
    spec = WorkerSpec(
        entrypoint=[f.training_script, *(f.training_script_args or [])] if f.training_script else [],
        module=f.module,
        no_python=f.no_python,
        role=f.role,
        log_dir=f.log_dir,
        redirects=parse_std_spec(f.redirects, nproc),
        tee=parse_std_spec(f.tee, nproc),
        local_ranks_filter=filter_ranks,
        duplicate_filters={
            "stdout": parse_filters(f.duplicate_stdout_filters),
            "stderr": parse_filters(f.duplicate_stderr_filters),
        },
        virtual_local_rank=f.virtual_local_rank,
        start_method="forkserver" if f.start_method == "fork" else f.start_method,
    )
    if (any(spec.redirects.values()) or any(spec.tee.values())) and f.log_dir is None:
        raise ValueError("--redirects/--tee need --log-dir")
    if f.log_dir is not None:
        _check_log_dir(Path(f.log_dir))
    if f.training_script:
        _check_entrypoint(f.training_script, module=f.module, no_python=f.no_python)
    return spec


def _check_log_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"--log-dir {path}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--log-dir {path}: cannot create it ({err.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--log-dir {path}: not writable")


def _check_entrypoint(script: str, module: bool, no_python: bool) -> None:
    """What every worker would fail on at once is said before anything starts (workers start in this
    process's working directory, so a relative path or a module of it is looked up here)."""
    if no_python:
        if shutil.which(script) is None and not (Path(script).is_file() and os.access(script, os.X_OK)):
            raise ValueError(f"--no-python {script}: no such executable (not a file here, not on PATH)")
        return
    if module:
        import importlib.util

        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(script)
        except ModuleNotFoundError:  # a parent package is missing
            found = None
        except Exception:  # noqa: BLE001 - a parent that fails to import here may import in a worker
            return
        finally:
            sys.path.pop(0)
        if found is None:
            raise ValueError(f"-m {script}: no module of that name (from {os.getcwd()} and this Python's path)")
        return
    path = Path(script)
    if not (path.is_file() or (path.is_dir() and (path / "__main__.py").is_file())):
        raise ValueError(f"the training script {script}: no such file")


def _run(
    config: AgentConfig, spec: WorkerSpec, rdzv: Rendezvous, f: SimpleNamespace, handled_signals: list[signal.Signals]
) -> int:
    """Open the stores, run the agent until the job ends for this node; its exit code."""
    configure_logging(console_level(f.log_level, os.environ))
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        log.warning(OMP_BANNER)
    workers_store = None
    wait_s = min(config.join_timeout, 60.0)
    if rdzv.backend == "static" and "is_host" not in rdzv.conf:
        store, server, workers_store = open_static_store(
            f.master_addr, f.master_port, f.node_rank, rdzv.run_id, wait_s=wait_s, secret_file=rdzv.secret_file
        )
    else:
        store, server = open_store(
            rdzv.backend,
            rdzv.endpoint,
            rdzv.run_id,
            rdzv.host_store,
            rdzv.etcd,
            wait_s=wait_s,
            secret_file=rdzv.secret_file,
        )
    agent = Agent(config, spec, store, workers_store=workers_store)
    log_file = add_log_file(agent.log_file)
    install_signal_handlers(agent, handled_signals)
    try:
        code = agent.run()
        if server is not None and agent.leaving.is_set():
            _keep_serving_store(store, agent)
    finally:
        logging.getLogger().removeHandler(log_file)
        log_file.close()
        store.close()
        if server is not None:
            server.stop()
    return code


def _keep_serving_store(store, agent: Agent) -> None:
    """A departing agent that hosts the embedded store keeps serving it while other agents remain.

    Its devices have left the job; the process stays until the others are gone, since they cannot
    go on without the store. (Jobs where any node may leave at any time should use etcd.)
    """
    announced = False
    while not agent.hard_stop.is_set():
        others = [kv for kv in store.get_prefix("nodes/") if not kv.key.endswith(agent.node_id)]
        if not others:
            return
        if not announced:
            agent.emit(
                "store_host_staying",
                {
                    "other_agents": len(others),
                    "note": "this agent hosts the embedded store and serves it until the others leave; "
                    "a second SIGTERM stops it now (use etcd to avoid this)",
                },
            )
            announced = True
        agent.hard_stop.wait(1.0)


def _with_job_config(argv: list[str]) -> tuple[list[str], dict]:
    """``--config FILE``: the file's values become the defaults of etcrun's parameters."""
    if not any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        return argv, {}  # the common case: no command to build twice
    from etc_agent.cli.jobconfig import load_job_config, split_config_flag

    command = typer.main.get_command(app)
    value_options = {name for param in command.params if not getattr(param, "is_flag", True) for name in param.opts}
    path, argv = split_config_flag(argv, value_options)
    if path is None:
        return argv, {}
    return argv, {
        "default_map": {**load_job_config(path, etcrun), "config": path}
    }  # config: to name the file in errors


def main(argv: list[str] | None = None, prog: str = "etcrun") -> None:
    """Entry point: one line and exit code 2 for bad flags or input."""
    run_app(app, argv, prog, (ValueError, StoreError, TimeoutError), prepare=_with_job_config)


if __name__ == "__main__":
    main()
