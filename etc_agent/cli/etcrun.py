"""``etcrun``: a drop-in replacement for ``torchrun`` (same flags, names and defaults, plus ETC's own).

    etcrun --nnodes 1:4 --nproc-per-node 8 --rdzv-backend etcd-v3 --rdzv-endpoint etcd:2379 \\
           --rdzv-id job42 train.py --lr 3e-4

The flags (:class:`~etc_agent.cli.etcrun_flags.EtcrunFlags`, one field per flag) become a
WorkerSpec (how this node's workers start), the rendezvous (how the nodes find each other,
:mod:`~etc_agent.cli.rdzv`) and an AgentConfig, which owns the agent settings' checks and help
texts: etcrun maps each setting's flag to its field (SETTING_FLAGS) and turns a rejected value into
one line naming the flag, --rdzv-conf key, variable or --config key it came from
(:mod:`~etc_agent.cli.etcrun_config`); :mod:`~etc_agent.cli.launch` then runs the agent.
"""

from __future__ import annotations

from typing import Any

import typer

from etc_agent.cli._entry import run_app
from etc_agent.cli.etcrun_config import agent_config, parameter_source, worker_spec
from etc_agent.cli.etcrun_flags import (
    RDZV,
    SETTING_FLAGS,
    SHARED_FLAG_PARAMS,
    WORKERS,
    EtcrunFlags,
    parse_filters,
    parse_signals,
)
from etc_agent.cli.launch import run_agent
from etc_agent.cli.options import flags_command
from etc_agent.cli.rdzv import resolve_rendezvous
from etc_agent.rendezvous.store import StoreError

__all__ = ["SETTING_FLAGS", "SHARED_FLAG_PARAMS", "app", "etcrun", "main", "parse_filters"]

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@app.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    help="Launch a training script on this node like torchrun, with live re-configuration when nodes come and go. "
    "Every torchrun option can also be set by its PET_* environment variable (PET_NPROC_PER_NODE=2); a flag wins over it. "
    f"Options marked {WORKERS} shape how this node's workers start, {RDZV} how the nodes find each other; "
    "the others are the agent's settings.",
)
@flags_command(EtcrunFlags, "flags")
def etcrun(ctx: typer.Context, flags: EtcrunFlags) -> None:
    """Parse the flags -> WorkerSpec and AgentConfig (a rejected value: one line) -> run."""
    if (
        parameter_source(ctx, "training_script") == "COMMANDLINE"
        and parameter_source(ctx, "training_script_args") == "DEFAULT_MAP"
    ):  # a script named on the command line comes with its own arguments
        flags = flags.model_copy(update={"training_script_args": None})
    flags.check_supported()
    handled_signals = parse_signals(flags.signals_to_handle)
    rdzv = resolve_rendezvous(flags)
    config = agent_config(ctx, flags, rdzv)
    spec = worker_spec(flags, config.nproc_per_node)
    raise typer.Exit(run_agent(config, spec, rdzv, flags, handled_signals))


def _with_job_config(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
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
