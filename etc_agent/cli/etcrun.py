"""``etcrun``: a drop-in replacement for ``torchrun`` (same flags, names and defaults, plus ETC's own).

    etcrun --nnodes 1:4 --nproc-per-node 8 --rdzv-backend etcd-v3 --rdzv-endpoint etcd:2379 \\
           --rdzv-id job42 train.py --lr 3e-4
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Annotated, Optional

import typer

from etc_agent.agent.agent import Agent, install_signal_handlers
from etc_agent.agent.config import AgentConfig
from etc_agent.cli._entry import run_app
from etc_agent.agent.workers import WorkerSpec, parse_std_spec
from etc_agent.rendezvous.embedded import EmbeddedStore, EmbeddedStoreServer
from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore
from etc_agent.rendezvous.store import StoreError

ETCD_BACKENDS = {"etcd", "etcd-v2", "etcd-v3"}
EMBEDDED_BACKENDS = {"embedded", "c10d", "static"}

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


def parse_nnodes(text: str) -> tuple[int, int]:
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
    if not text.isdigit() or int(text) < 1:
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
    out = []
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


def open_store(backend: str, endpoint: str, run_id: str, host_store: bool | None, etcd: EtcdOptions | None, wait_s: float):
    """The membership store for this agent (and, for the embedded backend, the server when we host it)."""
    if backend in ETCD_BACKENDS:
        assert etcd is not None
        return EtcdStore(etcd, run_id), None
    host, _, port = endpoint.rpartition(":")
    if host_store is None:
        host_store = _is_local(host)
    server = None
    if host_store:
        try:
            server = EmbeddedStoreServer(host if host not in ("", "localhost") else "127.0.0.1", int(port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            server = None  # another local agent hosts it (torchrun's c10d does the same)
    return EmbeddedStore(endpoint, run_id, connect_timeout_s=wait_s), server


STATIC_ENDPOINT_KEY = "etc_agent/membership_store"
"""Key in the static rendezvous' TCPStore that names the embedded membership store's address."""


def open_static_store(master_addr: str, master_port: int, node_rank: int, run_id: str, wait_s: float):
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
            workers_store = TCPStore(master_addr, master_port, is_master=True, wait_for_workers=False,
                                     timeout=timedelta(seconds=wait_s))
        except RuntimeError as err:
            raise ValueError(f"--master-port {master_port}: cannot listen on it ({str(err).splitlines()[0]}); "
                             "is another job using it?") from None
        bind = "127.0.0.1" if master_addr in ("", "localhost") else master_addr
        if not _is_local(bind):
            bind = "0.0.0.0"
        server = EmbeddedStoreServer(bind, 0)
        endpoint = f"{master_addr}:{server.port}"
        workers_store.set(STATIC_ENDPOINT_KEY, endpoint)
        return EmbeddedStore(endpoint, run_id, connect_timeout_s=wait_s), server, workers_store
    try:
        bootstrap = TCPStore(master_addr, master_port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=wait_s))
        endpoint = bootstrap.get(STATIC_ENDPOINT_KEY).decode()
    except RuntimeError as err:
        raise StoreError(f"static rendezvous: node rank 0 did not answer at {master_addr}:{master_port} within {wait_s:.0f} s "
                         f"({str(err).splitlines()[0]})") from None
    return EmbeddedStore(endpoint, run_id, connect_timeout_s=wait_s), None, None


@app.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    help="Launch a training script on this node like torchrun, with live re-configuration when nodes come and go. "
         "Every torchrun option can also be set by its PET_* environment variable (PET_NPROC_PER_NODE=2); a flag wins over it.",
)
def etcrun(
    ctx: typer.Context,
    training_script: Annotated[Optional[str], typer.Argument(help="Script to run (or module with -m, executable with --no-python).")] = None,
    training_script_args: Annotated[Optional[list[str]], typer.Argument(help="Arguments for the script.")] = None,
    nnodes: Annotated[str, typer.Option("--nnodes", envvar="PET_NNODES", show_envvar=False, help="Number of nodes, or MIN:MAX for an elastic job.")] = "1:1",
    nproc_per_node: Annotated[str, typer.Option("--nproc-per-node", "--nproc_per_node", envvar="PET_NPROC_PER_NODE", show_envvar=False, help="Workers per node: N, auto, cpu or gpu.")] = "1",
    rdzv_backend: Annotated[str, typer.Option("--rdzv-backend", "--rdzv_backend", envvar="PET_RDZV_BACKEND", show_envvar=False, help="etcd-v3 (etcd), or embedded (c10d, static): a store hosted by one agent.")] = "static",
    rdzv_endpoint: Annotated[str, typer.Option("--rdzv-endpoint", "--rdzv_endpoint", envvar="PET_RDZV_ENDPOINT", show_envvar=False, help="host:port of etcd or of the embedded store.")] = "",
    rdzv_id: Annotated[str, typer.Option("--rdzv-id", "--rdzv_id", envvar="PET_RDZV_ID", show_envvar=False, help="Job id shared by all nodes.")] = "none",
    rdzv_conf: Annotated[str, typer.Option("--rdzv-conf", "--rdzv_conf", envvar="PET_RDZV_CONF", show_envvar=False, help="key=value,...: join_timeout, lease_ttl, is_host.")] = "",
    standalone: Annotated[bool, typer.Option("--standalone", envvar="PET_STANDALONE", show_envvar=False, help="One node, embedded store on a free local port, random run id.")] = False,
    max_restarts: Annotated[int, typer.Option("--max-restarts", "--max_restarts", envvar="PET_MAX_RESTARTS", show_envvar=False, help="Worker-failure restarts before the job fails.")] = 0,
    monitor_interval: Annotated[float, typer.Option("--monitor-interval", "--monitor_interval", envvar="PET_MONITOR_INTERVAL", show_envvar=False, help="Seconds between worker checks.")] = 0.1,
    start_method: Annotated[str, typer.Option("--start-method", "--start_method", envvar="PET_START_METHOD", show_envvar=False, help="Accepted for compatibility; workers are always separate processes.")] = "spawn",
    role: Annotated[str, typer.Option("--role", envvar="PET_ROLE", show_envvar=False, help="Worker role name (ROLE_NAME).")] = "default",
    module: Annotated[bool, typer.Option("-m", "--module", envvar="PET_MODULE", show_envvar=False, help="Run the script as a Python module.")] = False,
    no_python: Annotated[bool, typer.Option("--no-python", "--no_python", envvar="PET_NO_PYTHON", show_envvar=False, help="Run the script directly, not through python.")] = False,
    run_path: Annotated[bool, typer.Option("--run-path", "--run_path", envvar="PET_RUN_PATH", show_envvar=False, help="Run the script as a path (the default way here).")] = False,
    log_dir: Annotated[Optional[Path], typer.Option("--log-dir", "--log_dir", envvar="PET_LOG_DIR", show_envvar=False, help="Directory for worker logs and error files.")] = None,
    redirects: Annotated[str, typer.Option("-r", "--redirects", envvar="PET_REDIRECTS", show_envvar=False, help="Workers' std streams to files in --log-dir: 0-3 or rank:value,...")] = "0",
    tee: Annotated[str, typer.Option("-t", "--tee", envvar="PET_TEE", show_envvar=False, help="Like --redirects but also to the console.")] = "0",
    local_ranks_filter: Annotated[str, typer.Option("--local-ranks-filter", "--local_ranks_filter", envvar="PET_LOCAL_RANKS_FILTER", show_envvar=False, help="Only these local ranks' output on the console, e.g. 0,1.")] = "",
    node_rank: Annotated[int, typer.Option("--node-rank", "--node_rank", envvar="PET_NODE_RANK", show_envvar=False, help="This node's rank (static rendezvous; a position hint otherwise).")] = 0,
    master_addr: Annotated[str, typer.Option("--master-addr", "--master_addr", envvar="PET_MASTER_ADDR", show_envvar=False, help="Static rendezvous: address of node rank 0.")] = "127.0.0.1",
    master_port: Annotated[int, typer.Option("--master-port", "--master_port", envvar="PET_MASTER_PORT", show_envvar=False, help="Static rendezvous: port on node rank 0.")] = 29500,
    local_addr: Annotated[Optional[str], typer.Option("--local-addr", "--local_addr", envvar="PET_LOCAL_ADDR", show_envvar=False, help="Address other nodes use to reach this node.")] = None,
    shutdown_timeout: Annotated[Optional[int], typer.Option("--shutdown-timeout", "--shutdown_timeout", envvar="PET_SHUTDOWN_TIMEOUT", show_envvar=False, help="Seconds between SIGTERM and SIGKILL for workers (default 30).")] = None,
    event_log_handler: Annotated[str, typer.Option("--event-log-handler", "--event_log_handler", envvar="PET_EVENT_LOG_HANDLER", show_envvar=False, help="Accepted for compatibility: torch's event handlers are not called; the agent's events go to its log (--log-format json for one JSON line each).")] = "null",
    duplicate_stdout_filters: Annotated[str, typer.Option("--duplicate-stdout-filters", "--duplicate_stdout_filters", envvar="PET_DUPLICATE_STDOUT_FILTERS", show_envvar=False, help="Comma-separated substrings: workers' stdout lines containing any of them are also written to filtered_stdout.log in the attempt's log directory (',,' is a literal comma).")] = "",
    duplicate_stderr_filters: Annotated[str, typer.Option("--duplicate-stderr-filters", "--duplicate_stderr_filters", envvar="PET_DUPLICATE_STDERR_FILTERS", show_envvar=False, help="Like --duplicate-stdout-filters, for stderr (filtered_stderr.log).")] = "",
    logs_specs: Annotated[Optional[str], typer.Option("--logs-specs", "--logs_specs", envvar="PET_LOGS_SPECS", show_envvar=False, help="torchrun.logs_specs entry point: only the default layout is supported (log files under --log-dir).")] = None,
    numa_binding: Annotated[Optional[str], typer.Option("--numa-binding", "--numa_binding", envvar="PET_NUMA_BINDING", show_envvar=False, help="node, socket, exclusive or core-complex: not supported (CPU affinity is left to the system); rejected rather than ignored.")] = None,
    signals_to_handle: Annotated[str, typer.Option("--signals-to-handle", "--signals_to_handle", envvar="PET_SIGNALS_TO_HANDLE", show_envvar=False, help="Signals that end this node's part of the job (planned departure; a second one stops at once), comma-separated.")] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    virtual_local_rank: Annotated[bool, typer.Option("--virtual-local-rank", "--virtual_local_rank", envvar="PET_VIRTUAL_LOCAL_RANK", show_envvar=False, help="LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES narrowed to its own device (index 0).")] = False,
    migration: Annotated[str, typer.Option("--migration", help="live (device to device) or checkpoint (DCP save, restart, load: the baseline).")] = "live",
    checkpoint_dir: Annotated[Optional[Path], typer.Option("--checkpoint-dir", help="Directory every node can reach: --migration checkpoint saves there; with --checkpoint-interval, periodic checkpoints.")] = None,
    checkpoint_interval: Annotated[int, typer.Option("--checkpoint-interval", help="Every N steps, an asynchronous DCP checkpoint in --checkpoint-dir; state that a failure leaves without any live copy is restored from it (only that state), and the steps since are trained again. 0: none.")] = 0,
    checkpoint_keep: Annotated[int, typer.Option("--checkpoint-keep", help="Complete periodic checkpoints kept (older ones are deleted).")] = 2,
    parallel: Annotated[Optional[str], typer.Option("--parallel", help="Initial parallel config (tp=..,pp=..,dp=..) or auto, for worker-API scripts.")] = None,
    model: Annotated[Optional[Path], typer.Option("--model", help="Model spec YAML for the --parallel auto policy.")] = None,
    etcd_ca_cert: Annotated[Optional[str], typer.Option("--etcd-ca-cert", help="CA bundle for etcd TLS.")] = None,
    etcd_cert: Annotated[Optional[str], typer.Option("--etcd-cert", help="Client certificate for etcd mutual TLS.")] = None,
    etcd_key: Annotated[Optional[str], typer.Option("--etcd-key", help="Client key for etcd mutual TLS.")] = None,
    etcd_user: Annotated[Optional[str], typer.Option("--etcd-user", help="etcd user name.")] = None,
    etcd_password: Annotated[Optional[str], typer.Option("--etcd-password", help="etcd password (or ETC_AGENT_ETCD_PASSWORD).", envvar="ETC_AGENT_ETCD_PASSWORD")] = None,
    reconfig_delay: Annotated[float, typer.Option("--reconfig-delay", help="Seconds of quiet that close one generation's membership changes.")] = 1.0,
    lease_ttl: Annotated[float, typer.Option("--lease-ttl", help="Seconds after which a silent node counts as dead.")] = 5.0,
    log_format: Annotated[str, typer.Option("--log-format", help="text or json (one JSON line per agent event).")] = "text",
    worker_heartbeat_timeout: Annotated[float, typer.Option("--worker-heartbeat-timeout", help="Seconds a worker-API process may stay "
                                                            "silent before it counts as hung (killed, handled as a crash); 0: never.")] = 30.0,
    placement: Annotated[str, typer.Option("--placement", help="fast: move the least state, with the DP replicas of a stage on "
                                           "different nodes where that costs nothing (first generation, ties; a generation where one "
                                           "node's loss would lose state says so in its record and log); resilient: put them on "
                                           "different nodes first (a node loss then loses no state), then move the least.")] = "fast",
    sidecar: Annotated[bool, typer.Option("--sidecar", help="Start no workers: run beside --nproc-per-node worker-API processes that "
                                          "another launcher starts with ETC_AGENT_ADDR and LOCAL_RANK (what `etc-agent sidecar` runs).")] = False,
    control_addr: Annotated[Optional[str], typer.Option("--control-addr", help="host:port the workers reach this agent on "
                                                        "(ETC_AGENT_ADDR); default 127.0.0.1, a free port, or 127.0.0.1:29401 with --sidecar.")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="Job YAML (configs/jobs/*.yaml): etcrun's options by name, "
                                                   "script and script_args; flags given here win.")] = None,
) -> None:
    # Compared by name: click's ParameterSource lives in typer's vendored copy of click, not in an importable package.
    if _source(ctx, "training_script") == "COMMANDLINE" and _source(ctx, "training_script_args") == "DEFAULT_MAP":
        training_script_args = None  # a script named on the command line comes with its own arguments
    if logs_specs is not None:
        raise ValueError(f"--logs-specs {logs_specs}: custom LogsSpecs are not supported; worker logs go under --log-dir "
                         "(<run>_<node>/attempt_<n>/<local_rank>/stdout.log)")
    if numa_binding is not None:
        raise ValueError(f"--numa-binding {numa_binding}: not supported by etcrun (set CPU affinity with numactl or your scheduler)")
    handled_signals = parse_signals(signals_to_handle)
    if sidecar and training_script is not None:
        raise ValueError(f"--sidecar starts no workers: remove the training script ({training_script}); start it with "
                         "`etc-agent workers` or your own launcher, ETC_AGENT_ADDR pointing here")
    if not sidecar and training_script is None:
        raise ValueError("the training script is missing (or use --sidecar / `etc-agent sidecar` to run beside workers started elsewhere)")
    if control_addr is not None:
        from etc_agent.utils.jsonline import parse_address

        parse_address(control_addr)
    low, high = parse_nnodes(nnodes)
    nproc = parse_nproc(nproc_per_node)
    conf = parse_rdzv_conf(rdzv_conf)
    if module and no_python:
        raise ValueError("-m/--module and --no-python cannot be used together")
    if log_format not in ("text", "json"):
        raise ValueError(f"--log-format {log_format!r}: use text or json")
    if monitor_interval <= 0:
        raise ValueError("--monitor-interval must be positive")
    if worker_heartbeat_timeout < 0:
        raise ValueError("--worker-heartbeat-timeout must be 0 (never) or positive")
    backend = rdzv_backend.strip().lower()
    if backend not in ETCD_BACKENDS | EMBEDDED_BACKENDS:
        raise ValueError(f"--rdzv-backend {rdzv_backend!r}: use etcd-v3 or embedded (c10d, static)")
    run_id = rdzv_id
    host_store: bool | None = None
    if standalone:
        low = high = 1
        backend, run_id, host_store = "embedded", f"standalone-{uuid.uuid4().hex[:8]}", True
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            rdzv_endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    elif backend == "static":
        rdzv_endpoint = f"{master_addr}:{master_port}"
        host_store = node_rank == 0
    elif not rdzv_endpoint:
        raise ValueError(f"--rdzv-endpoint is required with --rdzv-backend {rdzv_backend}")
    if "is_host" in conf:
        host_store = conf["is_host"].lower() in ("1", "true", "yes")
    shutdown = float(shutdown_timeout if shutdown_timeout is not None else os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    join_timeout = float(conf.get("join_timeout", 600))
    etcd = None
    if backend in ETCD_BACKENDS:
        etcd = EtcdOptions(endpoint=rdzv_endpoint, ca_cert=etcd_ca_cert, cert_key=etcd_key, cert_cert=etcd_cert,
                           user=etcd_user, password=etcd_password, timeout_s=float(conf.get("read_timeout", 5)))
    filter_ranks = {int(r) for r in local_ranks_filter.split(",") if r.strip()} if local_ranks_filter.strip() else None
    spec = WorkerSpec(
        entrypoint=[training_script, *(training_script_args or [])] if training_script else [],
        module=module, no_python=no_python, role=role, log_dir=log_dir,
        redirects=parse_std_spec(redirects, nproc), tee=parse_std_spec(tee, nproc), local_ranks_filter=filter_ranks,
        duplicate_filters={"stdout": parse_filters(duplicate_stdout_filters), "stderr": parse_filters(duplicate_stderr_filters)},
        virtual_local_rank=virtual_local_rank,
    )
    parallel_spec = None
    if parallel:
        from etc_agent.layout.config import ParallelSpec

        parallel_spec = ParallelSpec.parse(parallel)
        if (parallel_spec.tp is None or parallel_spec.pp is None) and model is None:
            raise ValueError(f"--parallel {parallel}: tp/pp auto needs --model (a model spec YAML for the policy)")
        # What no membership can ever satisfy fails now rather than after --rdzv-conf join_timeout.
        if parallel_spec.tp is not None and parallel_spec.tp > nproc:
            raise ValueError(f"--parallel {parallel}: a TP group stays inside one node, and nodes run {nproc} workers (--nproc-per-node)")
        if parallel_spec.fully_fixed and parallel_spec.tp * parallel_spec.pp * parallel_spec.dp > high * nproc:
            raise ValueError(f"--parallel {parallel} needs {parallel_spec.tp * parallel_spec.pp * parallel_spec.dp} workers; "
                             f"--nnodes {nnodes} x --nproc-per-node {nproc} allows at most {high * nproc}")
    if placement not in ("fast", "resilient"):
        raise ValueError(f"--placement {placement!r}: use fast or resilient")
    if migration not in ("live", "checkpoint"):
        raise ValueError(f"--migration {migration!r}: use live or checkpoint")
    if migration == "checkpoint" and checkpoint_dir is None:
        raise ValueError("--migration checkpoint needs --checkpoint-dir (a directory every node can reach)")
    if checkpoint_interval < 0 or checkpoint_keep < 1:
        raise ValueError(f"--checkpoint-interval must be >= 0 and --checkpoint-keep >= 1 (got {checkpoint_interval}, {checkpoint_keep})")
    if checkpoint_interval and checkpoint_dir is None:
        raise ValueError("--checkpoint-interval needs --checkpoint-dir (a directory every node can reach)")
    if model is not None:
        from etc_agent.layout.model import ModelSpec

        if not model.exists():
            raise ValueError(f"--model {model}: no such file")
        ModelSpec.from_yaml(model)  # a bad spec is a one-line error now, not in the leader later
    if (any(spec.redirects.values()) or any(spec.tee.values())) and log_dir is None:
        raise ValueError("--redirects/--tee need --log-dir")
    config = AgentConfig(
        run_id=run_id, min_nodes=low, max_nodes=high, nproc_per_node=nproc, max_restarts=max_restarts,
        monitor_interval=monitor_interval, reconfig_delay=reconfig_delay, lease_ttl=float(conf.get("lease_ttl", lease_ttl)),
        join_timeout=join_timeout, shutdown_timeout=shutdown, local_addr=local_addr or ("127.0.0.1" if standalone else None),
        node_rank=node_rank if backend == "static" or "--node-rank" in sys.argv or "--node_rank" in sys.argv else None,
        log_format=log_format, parallel=parallel_spec.short() if parallel_spec else None,
        model=str(model) if model is not None and parallel_spec is not None else None,
        migration=migration, checkpoint_dir=str(checkpoint_dir.resolve()) if checkpoint_dir else None,
        checkpoint_interval=checkpoint_interval, checkpoint_keep=checkpoint_keep,
        worker_heartbeat_timeout=worker_heartbeat_timeout, sidecar=sidecar, control_addr=control_addr, placement=placement,
    )
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s etcrun %(levelname)s %(message)s", stream=sys.stderr)
    workers_store = None
    if backend == "static" and "is_host" not in conf:
        store, server, workers_store = open_static_store(master_addr, master_port, node_rank, run_id, wait_s=min(join_timeout, 60.0))
    else:
        store, server = open_store(backend, rdzv_endpoint, run_id, host_store, etcd, wait_s=min(join_timeout, 60.0))
    agent = Agent(config, spec, store, workers_store=workers_store)
    install_signal_handlers(agent, handled_signals)
    try:
        code = agent.run()
        if server is not None and agent.leaving.is_set():
            _keep_serving_store(store, agent)
    finally:
        store.close()
        if server is not None:
            server.stop()
    raise typer.Exit(code)


def _source(ctx: typer.Context, name: str) -> str:
    source = ctx.get_parameter_source(name)
    return source.name if source is not None else ""


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
            agent.emit("store_host_staying", {"other_agents": len(others),
                                              "note": "this agent hosts the embedded store and serves it until the others leave; "
                                                      "a second SIGTERM stops it now (use etcd to avoid this)"})
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
    return argv, {"default_map": load_job_config(path, etcrun)}


def main(argv: list[str] | None = None, prog: str = "etcrun") -> None:
    """Entry point: one line and exit code 2 for bad flags or input."""
    run_app(app, argv, prog, (ValueError, StoreError, TimeoutError), prepare=_with_job_config)


if __name__ == "__main__":
    main()
