"""``etc-agent``: planning and inspection commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from etc_agent.cli._entry import run_app
from etc_agent.cli.options import OptionsError, build_model, model_options
from etc_agent.layout.config import ParallelConfig
from etc_agent.layout.devices import Device, DeviceSet
from etc_agent.layout.model import ModelSpec
from etc_agent.rendezvous.store import StoreError

if TYPE_CHECKING:
    from rich.table import Table

app = typer.Typer(
    name="etc-agent",
    help="ETC agent: elastic hybrid-parallel training with live state migration.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

GiB = 1 << 30


@app.callback()
def _root() -> None:
    """ETC agent: elastic hybrid-parallel training with live state migration."""


class UserError(Exception):
    """A mistake in the command line or its inputs: one line on stderr, exit code 2."""


def parse_failed(text: str | None, old_devices: DeviceSet) -> list[Device]:
    """``n1`` (every old device of node n1) or ``n1:3`` items, comma separated."""
    if not text:
        return []
    out: list[Device] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if ":" in item:
            device = Device.parse(item)
            if device not in old_devices:
                raise ValueError(f"--failed {item}: not in the old device set {old_devices.short()}")
            out.append(device)
        else:
            devices = old_devices.node_devices(item)
            if not devices:
                raise ValueError(f"--failed {item}: no node of that name in the old device set {old_devices.short()}")
            out += devices
    return list(dict.fromkeys(out))


def _bandwidth_model():
    from etc_agent.planner.bandwidth import BandwidthModel

    return BandwidthModel


@app.command()
@model_options(
    _bandwidth_model(), "bandwidth_flags", panel="Bandwidth model for the estimates (GB/s = 1e9 bytes/s per direction)"
)
def plan(
    model: Annotated[Path, typer.Option("--model", help="Model spec YAML (configs/models/*.yaml).")],
    from_: Annotated[str, typer.Option("--from", help="Current parallel config, e.g. tp=4,pp=2,dp=2,zero=1.")],
    old: Annotated[str, typer.Option("--old", help="Current devices, e.g. n0:8,n1:8 (old rank r runs on the r-th).")],
    to: Annotated[str, typer.Option("--to", help="New parallel config, or 'auto' to let the policy choose.")],
    new: Annotated[str, typer.Option("--new", help="New devices, e.g. n0:8 or n0:[0-2,4-7].")],
    failed: Annotated[
        str | None, typer.Option("--failed", help="Old devices or nodes whose state is lost (crash), e.g. n1 or n0:3.")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG heatmap of bytes between nodes/devices.")
    ] = None,
    mem_cap_gib: Annotated[
        float, typer.Option("--mem-cap", help="GiB of send and of receive buffers per device and round.")
    ] = 2.0,
    max_messages: Annotated[
        int, typer.Option("--max-messages-per-round", help="Messages a device sends (and receives) per round.")
    ] = 64,
    device_memory_gib: Annotated[
        float, typer.Option("--device-memory-gib", help="Device memory, for --to auto.")
    ] = 80.0,
    seq_length: Annotated[int, typer.Option(help="Sequence length, for --to auto.")] = 2048,
    micro_batch_size: Annotated[int, typer.Option(help="Micro-batch size, for --to auto.")] = 1,
    global_batch_size: Annotated[int, typer.Option(help="Global batch size, for --to auto.")] = 512,
    placement: Annotated[
        str,
        typer.Option(
            "--placement",
            help="fast (the default, as etcrun's): fewest bytes moved, copies spread "
            "over nodes where that costs nothing (the report says what a node loss would lose and "
            "what the resilient placement would move to avoid it); resilient: spread the copies of "
            "every shard over nodes first, then move the fewest bytes.",
        ),
    ] = "fast",
    bandwidth_flags: dict | None = None,
) -> None:
    """Plan a migration between two parallel configurations and show what it moves."""
    from etc_agent.cli.report import plot_heatmap, policy_table, print_plan
    from etc_agent.planner.bandwidth import BandwidthModel
    from etc_agent.planner.core import PlannerOptions, plan_model_migration, resilience_advice
    from etc_agent.planner.policy import PolicyOptions, choose_config

    if plot is not None:
        _check_output(plot, "--plot")
    spec = ModelSpec.from_yaml(model)
    old_config = ParallelConfig.parse(from_)
    old_devices = DeviceSet.parse(old)
    new_devices = DeviceSet.parse(new)
    old_config.check_world_size(len(old_devices))
    spec.check_parallel(old_config)
    failed_devices = parse_failed(failed, old_devices)
    if mem_cap_gib <= 0:
        raise UserError(f"--mem-cap must be positive, got {mem_cap_gib}")
    bandwidth = build_model(BandwidthModel, bandwidth_flags or {})
    if placement not in ("fast", "resilient"):
        raise UserError(f"--placement {placement!r}: use fast or resilient")
    options = PlannerOptions(
        mem_cap_bytes=int(mem_cap_gib * GiB),
        max_messages_per_round=max_messages,
        bandwidth=bandwidth,
        placement=placement,
    )
    console = Console(stderr=False)
    decision = None
    if to.strip() == "auto":
        policy = PolicyOptions(
            device_memory_gib=device_memory_gib,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            intra_node_gbps=bandwidth.intra_node_gbps,
            inter_node_gbps=bandwidth.inter_node_gbps,
        )
        decision = choose_config(
            spec,
            new_devices,
            policy,
            old_config=old_config,
            old_devices=old_devices,
            failed=failed_devices,
            planner_options=options,
        )
        new_config = decision.winner.config
    else:
        new_config = ParallelConfig.parse(to)
        new_config.check_world_size(len(new_devices))
        spec.check_parallel(new_config)
    result = plan_model_migration(
        spec, old_config, old_devices, new_config, new_devices, failed=failed_devices, options=options
    )
    domains = result.failure_domains
    if placement == "fast" and domains and domains["single_domain_bytes"] > domains["unavoidable_single_domain_bytes"]:
        resilient = plan_model_migration(
            spec,
            old_config,
            old_devices,
            new_config,
            new_devices,
            failed=failed_devices,
            options=options.model_copy(update={"placement": "resilient"}),
        )
        result.resilient_alternative = resilience_advice(result, resilient)
    if plot is not None:
        plot_heatmap(result, plot)
    if json_out:
        data = result.to_json()
        if decision is not None:
            data["policy"] = {
                "reason": decision.reason,
                "candidates": [
                    {
                        "config": c.config.short(),
                        "memory_bytes": c.memory_bytes,
                        "step_seconds": c.step_seconds,
                        "fits": c.fits,
                        "bytes_moved": c.bytes_moved,
                        "migration_seconds": c.migration_seconds,
                    }
                    for c in decision.candidates
                ],
            }
        sys.stdout.write(json.dumps(data) + "\n")
        return
    if decision is not None:
        console.print(policy_table(decision))
    print_plan(console, result)
    if plot is not None:
        console.print(f"heatmap written to {plot}")


# Options of the commands that talk to a job's membership store.
RdzvEndpoint = Annotated[str, typer.Option("--rdzv-endpoint", help="host:port of etcd or of the embedded store.")]
RdzvId = Annotated[str, typer.Option("--rdzv-id", help="Job id.")]
RdzvBackend = Annotated[str, typer.Option("--rdzv-backend", help="etcd-v3 or embedded.")]
EtcdCaCert = Annotated[str | None, typer.Option("--etcd-ca-cert")]
EtcdCert = Annotated[str | None, typer.Option("--etcd-cert")]
EtcdKey = Annotated[str | None, typer.Option("--etcd-key")]
EtcdUser = Annotated[str | None, typer.Option("--etcd-user")]
EtcdPassword = Annotated[str | None, typer.Option("--etcd-password", envvar="ETC_AGENT_ETCD_PASSWORD")]


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


@app.command()
def status(
    rdzv_endpoint: RdzvEndpoint,
    rdzv_id: RdzvId,
    rdzv_backend: RdzvBackend = "etcd-v3",
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object instead of tables.")] = False,
    etcd_ca_cert: EtcdCaCert = None,
    etcd_cert: EtcdCert = None,
    etcd_key: EtcdKey = None,
    etcd_user: EtcdUser = None,
    etcd_password: EtcdPassword = None,
) -> None:
    """Show a job's members, leader, generation and worker status from the membership store."""
    from rich.table import Table

    from etc_agent.rendezvous.records import GenerationRecord, LeaderRecord, MigrationRecord, NodeRecord, NodeStatus

    store = _open_store(
        rdzv_backend, rdzv_endpoint, rdzv_id, etcd_ca_cert, etcd_cert, etcd_key, etcd_user, etcd_password
    )
    with store:
        nodes, rejected = [], []
        for kv in store.get_prefix("nodes/"):
            try:
                nodes.append(NodeRecord.loads(kv.value))
            except ValueError as err:
                rejected.append({"key": kv.key, "reason": str(err)})
        leader_kv = store.get("leader")
        gen_kv = store.get("generation")
        leader = LeaderRecord.loads(leader_kv.value).node_id if leader_kv else None
        generation = GenerationRecord.loads(gen_kv.value) if gen_kv else None
        statuses = {}
        if generation is not None:
            for kv in store.get_prefix(f"generations/{generation.number}/status/"):
                statuses[kv.key.rsplit("/", 1)[-1]] = NodeStatus.loads(kv.value)
        migration = None
        migration_kv = store.get("last_migration")
        if migration_kv is not None:
            try:
                migration = MigrationRecord.loads(migration_kv.value)
            except ValueError as err:
                rejected.append({"key": "last_migration", "reason": str(err)})
    data = {
        "run_id": rdzv_id,
        "leader": leader,
        "nodes": [n.model_dump() for n in nodes],
        "generation": generation.model_dump() if generation else None,
        "status": {k: v.model_dump() for k, v in statuses.items()},
        "last_migration": migration.model_dump() if migration else None,
        "rejected": rejected,
    }
    if json_out:
        sys.stdout.write(json.dumps(data) + "\n")
        return
    console = Console()
    if generation is None:
        console.print(f"run {rdzv_id}: no generation yet ({len(nodes)} nodes registered)")
    else:
        console.print(
            f"run {rdzv_id}: generation {generation.number} {generation.status}, world size {generation.world_size}, "
            f"restarts {generation.restart_count}; {generation.reason}"
        )
        if generation.not_resilient:
            console.print(f"not resilient to one node's loss: {'; '.join(generation.not_resilient)}")
    table = Table(title="members", header_style="bold")
    for col in ("node", "host", "devices", "group rank", "role", "workers"):
        table.add_column(col)
    members = generation.members if generation else []
    for n in nodes:
        rank = str(members.index(n.node_id)) if n.node_id in members else "-"
        role = "leader" if n.node_id == leader else ("leaving" if n.leaving else "")
        state = statuses[n.node_id].state if n.node_id in statuses else ("spare" if rank == "-" else "")
        table.add_row(n.node_id, n.host, str(n.num_devices), rank, role, state)
    console.print(table)
    if migration is not None:
        console.print(migration_table(migration))


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
    with _open_store(
        rdzv_backend, rdzv_endpoint, rdzv_id, etcd_ca_cert, etcd_cert, etcd_key, etcd_user, etcd_password
    ) as store:
        _check_fits_the_job(spec, store, rdzv_id)
        store.put("parallel", json.dumps({"spec": spec.short()}))
    sys.stdout.write(f"requested {spec.short()} for run {rdzv_id}\n")


def _simulate_costs():
    from etc_agent.sim.costs import CostModel

    return CostModel


@app.command()
@model_options(_simulate_costs(), "cost_flags", panel="Cost model (GB/s = 1e9 bytes/s per direction)")
def simulate(
    suite: Annotated[
        str,
        typer.Option(
            "--suite",
            help="paper: Megatron-style jobs on 8-1024 GPUs; fsdp: FSDP2 / HSDP jobs (llama-70b HSDP 8x128, "
            "llama-13b FSDP 64 and HSDP 4x16) losing or gaining a node; bench: the transitions of "
            "scripts/bench_migration.py (1 GB example GPT, this machine's shape).",
        ),
    ] = "paper",
    models: Annotated[
        str | None, typer.Option("--models", help="paper suite: comma-separated model names (default: all four).")
    ] = None,
    costs_file: Annotated[
        Path | None,
        typer.Option("--costs", help="JSON of cost fields (scripts/calibrate_sim.py writes one); flags override it."),
    ] = None,
    measured: Annotated[
        Path | None,
        typer.Option(
            "--measured",
            help="bench suite: the JSON line of scripts/bench_migration.py "
            "to compare with; exit 1 when a prediction is off by more than --tolerance.",
        ),
    ] = None,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Relative error allowed by --measured.")] = 0.3,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON line after the tables.")] = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="PNG to write (default simulate-<suite>.png; '-' for none).")
    ] = None,
    cost_flags: dict | None = None,
) -> None:
    """Estimate migration stalls, live vs checkpoint, with the real planner on real model specs."""
    from etc_agent.sim import report
    from etc_agent.sim.costs import CostModel
    from etc_agent.sim.estimate import simulate as run
    from etc_agent.sim.suites import PAPER_SIZES, bench_suite, fsdp_suite, paper_suite

    plot_path = plot if plot is not None else Path(f"simulate-{suite}.png")
    if str(plot_path) != "-":
        _check_output(plot_path, "--plot")
    values = CostModel.from_file(costs_file) if costs_file else {}
    if values:
        build_model(CostModel, values, str(costs_file))
    costs = build_model(CostModel, {**values, **(cost_flags or {})})
    if suite == "paper":
        sizes = PAPER_SIZES
        if models is not None:
            wanted = [m.strip() for m in models.split(",") if m.strip()]
            unknown = [m for m in wanted if m not in PAPER_SIZES]
            if unknown or not wanted:
                raise UserError(
                    f"--models: unknown {', '.join(unknown) or '(none given)'}; the paper suite has {', '.join(PAPER_SIZES)}"
                )
            sizes = {m: PAPER_SIZES[m] for m in wanted}
        scenarios = paper_suite(sizes)
    elif suite == "bench":
        if models is not None:
            raise UserError("--models applies to the paper suite only")
        scenarios = bench_suite()
    elif suite == "fsdp":
        if models is not None:
            raise UserError("--models applies to the paper suite only")
        scenarios = fsdp_suite()
    else:
        raise UserError(f"--suite {suite!r}: use paper, fsdp or bench")
    if measured is not None and suite != "bench":
        raise UserError("--measured compares with scripts/bench_migration.py: use it with --suite bench")
    if tolerance <= 0:
        raise UserError(f"--tolerance must be positive, got {tolerance}")
    measured_data = None
    if measured is not None:
        try:
            measured_data = json.loads(measured.read_text().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError) as err:
            raise UserError(f"--measured {measured}: not a bench_migration.py JSON line ({err})") from None
        if not isinstance(measured_data, dict) or not isinstance(measured_data.get("transitions"), list):
            raise UserError(f"--measured {measured}: not a bench_migration.py JSON line (no transitions)")
    console = Console()
    results = [run(s, costs) for s in scenarios]
    console.print(report.costs_table(costs))
    console.print(report.results_table(results, f"simulated stall, suite {suite}"))
    data = {
        "suite": suite,
        "costs": costs.model_dump(),
        "results": [r.to_json() for r in results],
        **report.summary(results),
    }
    if data["median_ratio"] is None:
        raise UserError("no scenario to simulate")
    console.print(
        f"median ratio {data['median_ratio']:.2f}x (range {data['min_ratio']:.2f}x-{data['max_ratio']:.2f}x); by scenario: "
        + ", ".join(f"{k} {v:.2f}x" for k, v in data["median_ratio_by_scenario"].items())
    )
    failed = []
    if measured_data is not None:
        table, rows = report.compare(results, measured_data, tolerance)
        console.print(table)
        data["comparison"] = rows
        failed = [r["name"] for r in rows if not r["ok"]]
        if not rows:
            raise UserError(f"--measured {measured}: no transition of the bench suite has both stalls")
    if str(plot_path) != "-":
        report.plot(results, plot_path, f"simulated migration stall ({suite} suite)")
        console.print(f"plot written to {plot_path}")
    if json_out:
        sys.stdout.write(json.dumps(data) + "\n")
    if failed:
        console.print(f"[red]off by more than {tolerance:.0%}[/]: {', '.join(failed)}")
        raise typer.Exit(1)


def _check_fits_the_job(spec, store, rdzv_id: str) -> None:
    """A layout the running job's devices cannot take is refused here, not parked by the leader."""
    from etc_agent.rendezvous.records import GenerationRecord

    kv = store.get("generation")
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


def _check_output(path: Path, flag: str) -> None:
    """A file the command will write: its directory must exist (said before any work is done)."""
    if path.is_dir():
        raise UserError(f"{flag} {path}: a directory; give a file name")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: no directory {path.parent}")


def _open_store(rdzv_backend, rdzv_endpoint, rdzv_id, ca_cert, cert, key, user, password):
    from etc_agent.rendezvous.embedded import EmbeddedStore
    from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore

    backend = rdzv_backend.lower()
    if backend in ("etcd", "etcd-v2", "etcd-v3"):
        return EtcdStore(
            EtcdOptions(
                endpoint=rdzv_endpoint, ca_cert=ca_cert, cert_key=key, cert_cert=cert, user=user, password=password
            ),
            rdzv_id,
        )
    if backend in ("embedded", "c10d", "static"):
        return EmbeddedStore(rdzv_endpoint, rdzv_id)
    raise UserError(f"--rdzv-backend {rdzv_backend!r}: use etcd-v3 or embedded")


def migration_table(m, title: str = "last migration") -> Table:
    """One migration record: what changed, what moved, and where the stall went."""
    from rich.table import Table

    table = Table(title=f"{title}: generation {m.generation} ({m.reason})", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("config", f"{m.old_config} ({m.old_world_size} ranks) -> {m.new_config} ({m.new_world_size} ranks)")
    table.add_row("resumed at step", str(m.step))
    if m.senders or m.lost:
        table.add_row("departed / lost devices", f"{', '.join(m.senders) or '-'} / {', '.join(m.lost) or '-'}")
    table.add_row("state", _mb(m.state_bytes))
    table.add_row(
        "moved",
        f"{_mb(m.bytes_moved)} (intra-node {_mb(m.bytes_moved_intra_node)}, inter-node {_mb(m.bytes_moved_inter_node)}); "
        f"kept in place {_mb(m.bytes_reused)}",
    )
    table.add_row("a checkpoint would move", f"{_mb(m.checkpoint_bytes)} (write once, every new rank reads its shards)")
    table.add_row(
        "stall",
        f"{m.total_stall_s:.3f} s: detect {m.detect_s:.3f}, agree {m.agree_s:.3f}, rebuild {m.rebuild_s:.3f}, "
        f"plan {m.plan_s:.3f}, transfer {m.transfer_s:.3f}",
    )
    return table


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def main(argv: list[str] | None = None) -> None:
    """Entry point: user mistakes become one line on stderr and exit code 2."""
    run_app(app, argv, "etc-agent", (UserError, ValueError, StoreError, OptionsError))


if __name__ == "__main__":
    main()
