"""``etc-agent``: planning and inspection commands, and the two halves of the sidecar deployment.

Each command with a page of options lives in its own module (``plan``, ``simulate``, ``status``);
they are registered here in the order ``etc-agent --help`` lists them.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from etc_agent.cli._entry import UserError, run_app
from etc_agent.cli.jobstore import (
    EtcdCaCert,
    EtcdCert,
    EtcdKey,
    EtcdPassword,
    EtcdUser,
    RdzvBackend,
    RdzvEndpoint,
    RdzvId,
    open_job_store,
)
from etc_agent.cli.options import OptionsError
from etc_agent.cli.plan import parse_failed, plan
from etc_agent.cli.simulate import simulate
from etc_agent.cli.status import migration_table, status
from etc_agent.cli.timeline import timeline
from etc_agent.protocol import keys
from etc_agent.rendezvous.store import MembershipStore, StoreError

if TYPE_CHECKING:
    from etc_agent.layout.config import ParallelSpec

__all__ = ["UserError", "app", "main", "migration_table", "parse_failed"]

app = typer.Typer(
    name="etc-agent",
    help="ETC agent: elastic hybrid-parallel training with live state migration.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """ETC agent: elastic hybrid-parallel training with live state migration."""


app.command()(plan)

_FORWARD = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command(context_settings=_FORWARD, add_help_option=False)
def sidecar(ctx: typer.Context) -> None:
    """The per-node agent without its workers: etcrun's flags (no training script), plus --control-addr
    (default 127.0.0.1:29401). Workers started by another launcher (`etc-agent workers`, a container,
    srun) attach with ETC_AGENT_ADDR and LOCAL_RANK; membership, leader, generations and migrations are
    etcrun's."""
    from etc_agent.cli import etcrun

    etcrun.main(["--sidecar", *ctx.args], prog="etc-agent sidecar")


@app.command(context_settings=_FORWARD, add_help_option=False)
def workers(ctx: typer.Context) -> None:
    """Start one node's worker processes beside an `etc-agent sidecar` and start again any that dies
    (`etc-agent workers --nproc-per-node N [--agent HOST:PORT] script.py args...`)."""
    from etc_agent.agent.spawn import main as spawn_main

    raise typer.Exit(spawn_main(list(ctx.args)))


app.command()(status)


@app.command()
def reconfigure(
    parallel: Annotated[str, typer.Option("--parallel", help="New layout, e.g. tp=1,pp=2,dp=auto,zero=1.")],
    rdzv_endpoint: RdzvEndpoint,
    rdzv_id: RdzvId,
    rdzv_backend: RdzvBackend = "etcd-v3",
    etcd_ca_cert: EtcdCaCert = None,
    etcd_cert: EtcdCert = None,
    etcd_key: EtcdKey = None,
    etcd_user: EtcdUser = None,
    etcd_password: EtcdPassword = None,
) -> None:
    """Ask a running worker-API job to switch layout on the same devices (the leader plans and publishes
    it like a membership change; it wins over etcrun's --parallel from then on)."""
    from etc_agent.layout.config import ParallelSpec

    spec = ParallelSpec.parse(parallel)
    with open_job_store(
        rdzv_backend, rdzv_endpoint, rdzv_id, etcd_ca_cert, etcd_cert, etcd_key, etcd_user, etcd_password
    ) as store:
        _check_fits_the_job(spec, store, rdzv_id)
        store.put(keys.REQUESTED_PARALLEL, json.dumps({"spec": spec.short()}))
    sys.stdout.write(f"requested {spec.short()} for run {rdzv_id}\n")


app.command()(simulate)
app.command()(timeline)


def _check_fits_the_job(spec: ParallelSpec, store: MembershipStore, rdzv_id: str) -> None:
    """A layout the running job's devices cannot take is refused here, not parked by the leader."""
    from etc_agent.rendezvous.records import GenerationRecord

    kv = store.get(keys.GENERATION)
    if kv is None:
        raise UserError(f"run {rdzv_id}: no generation in the store (is the job running, and is this its run id?)")
    gen = GenerationRecord.loads(kv.value)
    if gen.status in ("failed", "succeeded"):
        raise UserError(f"run {rdzv_id}: the job {gen.status}; nothing to reconfigure")
    total = sum(gen.num_devices)
    if spec.tp is None or spec.pp is None:
        raise UserError(f"--parallel {spec.short()}: tp and pp must be given (dp may be auto)")
    if spec.resolve(total) is None:
        raise UserError(
            f"--parallel {spec.short()}: does not fit the job's {total} devices (tp*pp = {spec.tp * spec.pp}"
            f"{'' if spec.dp is None else f', dp = {spec.dp}'})"
        )
    if any(n % spec.tp for n in gen.num_devices):
        raise UserError(
            f"--parallel {spec.short()}: a TP group stays inside one node, and the job's nodes have "
            f"{', '.join(map(str, gen.num_devices))} devices"
        )


def main(argv: list[str] | None = None) -> None:
    """Entry point: user mistakes become one line on stderr and exit code 2."""
    run_app(app, argv, "etc-agent", (UserError, ValueError, StoreError, OptionsError))


if __name__ == "__main__":
    main()
