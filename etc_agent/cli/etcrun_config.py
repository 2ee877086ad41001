"""etcrun's flags -> the agent's settings (an AgentConfig, whose checks reject a value in one line
naming the flag, ``--rdzv-conf`` key, variable or ``--config`` key it came from) and this node's
workers (a WorkerSpec, with what every worker would fail on at once said before anything starts).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import typer

from etc_agent.agent.config import AgentConfig
from etc_agent.agent.workers import WorkerSpec, parse_std_spec
from etc_agent.cli.etcrun_flags import (
    SETTING_FLAGS,
    SHARED_FLAG_PARAMS,
    EtcrunFlags,
    parse_filters,
    parse_nnodes,
    parse_nproc,
)
from etc_agent.cli.options import build_model
from etc_agent.cli.rdzv import Rendezvous
from etc_agent.utils.netaddr import choose_advertised

RDZV_CONF_SETTINGS = ("join_timeout", "lease_ttl")
"""--rdzv-conf keys that are AgentConfig fields (the others, is_host and read_timeout, go to the store)."""
SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
AGENT_FLAGS = (
    "max_restarts",
    "monitor_interval",
    "reconfig_delay",
    "log_format",
    "parallel",
    "migration",
    "prepare",
    "spare_worker",
    "checkpoint_interval",
    "checkpoint_keep",
    "fresh_start",
    "worker_heartbeat_timeout",
    "sidecar",
    "control_addr",
    "placement",
    "peer_timeout",
    "metrics_port",
    "metrics_addr",
)
"""AgentConfig fields that take their flag's value as it is."""


def parameter_source(ctx: typer.Context, name: str) -> str:
    """Where the value of etcrun's parameter ``name`` came from: COMMANDLINE, ENVIRONMENT, DEFAULT_MAP
    (the --config file) or DEFAULT. Compared by name: click's ParameterSource lives in typer's vendored
    copy of click, not in an importable package."""
    source = ctx.get_parameter_source(name)
    return source.name if source is not None else ""


def agent_config(ctx: typer.Context, f: EtcrunFlags, rdzv: Rendezvous) -> AgentConfig:
    """The agent's settings; a rejected value is one line naming how the user set it."""
    return build_model(AgentConfig, _settings(ctx, f, rdzv), names=_setting_names(ctx, f, rdzv.conf))


def _settings(ctx: typer.Context, f: EtcrunFlags, rdzv: Rendezvous) -> dict[str, Any]:
    """AgentConfig's fields from the flags, as given: checking them is AgentConfig's part."""
    low, high = parse_nnodes(f.nnodes)
    advertised = choose_advertised(f.local_addr or ("127.0.0.1" if f.standalone else None), rdzv.first_host)
    values = {name: getattr(f, name) for name in AGENT_FLAGS}
    values.update(
        run_id=rdzv.run_id,
        min_nodes=1 if f.standalone else low,
        max_nodes=1 if f.standalone else high,
        nproc_per_node=parse_nproc(f.nproc_per_node),
        lease_ttl=f.lease_ttl,
        shutdown_timeout=f.shutdown_timeout if f.shutdown_timeout is not None else os.environ.get(SHUTDOWN_ENV, 30),
        local_addr=advertised.addr,
        local_interface=advertised.interface,
        node_rank=f.node_rank if rdzv.backend == "static" or parameter_source(ctx, "node_rank") != "DEFAULT" else None,
        model=str(f.model) if f.model is not None else None,
        checkpoint_dir=str(f.checkpoint_dir.resolve()) if f.checkpoint_dir else None,
    )
    values.update({key: rdzv.conf[key] for key in RDZV_CONF_SETTINGS if key in rdzv.conf})
    return values


def _setting_names(ctx: typer.Context, f: EtcrunFlags, conf: dict[str, str]) -> dict[str, str]:
    """AgentConfig field -> how the user set it, for the one line that rejects its value: the flag
    (with its --rdzv-conf key), its PET_* variable, or the --config file and key."""
    names, envvars = {}, {param.name: param.envvar for param in ctx.command.params}
    for field in AgentConfig.model_fields:
        if field in RDZV_CONF_SETTINGS and field in conf:
            param, key = "rdzv_conf", f" {field}"
        else:
            param, key = SHARED_FLAG_PARAMS.get(field) or SETTING_FLAGS[field].removeprefix("--").replace("-", "_"), ""
        source = parameter_source(ctx, param)
        if source == "DEFAULT_MAP":
            names[field] = f"--config {f.config}: {param}{key}"
        elif source == "ENVIRONMENT":
            names[field] = f"{envvars[param]}{key}"
        elif field == "shutdown_timeout" and f.shutdown_timeout is None:
            names[field] = SHUTDOWN_ENV
        else:
            names[field] = "--" + param.replace("_", "-") + key
    return names


def worker_spec(f: EtcrunFlags, nproc: int) -> WorkerSpec:
    """How this node's ``nproc`` workers start."""
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
