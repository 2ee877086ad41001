"""``etc-agent simulate``: migration stalls, live vs checkpoint, estimated with the real planner on
real model specs under a cost model (:mod:`etc_agent.sim`), and compared with a measured
``scripts/bench_migration.py`` run when asked."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from etc_agent.cli._entry import UserError, check_output
from etc_agent.cli.options import Cli, build_model, flags_command, model_options

if TYPE_CHECKING:
    from etc_agent.sim.costs import CostModel
    from etc_agent.sim.estimate import Scenario, SimResult


def _simulate_costs() -> type[BaseModel]:
    from etc_agent.sim.costs import CostModel

    return CostModel


class SimulateFlags(BaseModel):
    """What ``etc-agent simulate`` is asked, in the order ``--help`` lists it (:func:`flags_command`)."""

    model_config = ConfigDict(extra="forbid")

    suite: str = Field(
        "paper",
        description="paper: Megatron-style jobs on 8-1024 GPUs; fsdp: FSDP2 / HSDP jobs (llama-70b HSDP 8x128, "
        "llama-13b FSDP 64 and HSDP 4x16) losing or gaining a node; bench: the transitions of "
        "scripts/bench_migration.py (1 GB example GPT, this machine's shape); scale: llama-70b tp=8 pp=8 on 1k, "
        "4k and 16k GPUs losing a node (notice, crash) or gaining a replica.",
    )
    models: str | None = Field(None, description="paper suite: comma-separated model names (default: all four).")
    costs_file: Annotated[Path | None, Cli(names=("--costs",))] = Field(
        None, description="JSON of cost fields (scripts/calibrate_sim.py writes one); flags override it."
    )
    control_plane: Path | None = Field(
        None,
        description="JSON line of scripts/bench_control_plane.py: control_s and control_per_node_s fitted to its "
        "measured event -> generation times (over the file's and the flags' values).",
    )
    measured: Path | None = Field(
        None,
        description="bench suite: the JSON line of scripts/bench_migration.py "
        "to compare with; exit 1 when a prediction is off by more than --tolerance.",
    )
    tolerance: float = Field(0.3, description="Relative error allowed by --measured.")
    json_out: Annotated[bool, Cli(names=("--json",))] = Field(
        False, description="Print one JSON line after the tables."
    )
    plot: Path | None = Field(None, description="PNG to write (default simulate-<suite>.png; '-' for none).")


@model_options(_simulate_costs(), "cost_flags", panel="Cost model (GB/s = 1e9 bytes/s per direction)")
@flags_command(SimulateFlags, "flags")
def simulate(flags: SimulateFlags, cost_flags: dict | None = None) -> None:
    """Estimate migration stalls, live vs checkpoint, with the real planner on real model specs."""
    from etc_agent.sim import report
    from etc_agent.sim.estimate import simulate as run

    plot_path = flags.plot if flags.plot is not None else Path(f"simulate-{flags.suite}.png")
    if str(plot_path) != "-":
        check_output(plot_path, "--plot")
    costs = _costs(flags.costs_file, cost_flags or {}, flags.control_plane)
    scenarios = _scenarios(flags.suite, flags.models)
    measured = _read_measured(flags)
    console = Console()
    results = [run(s, costs) for s in scenarios]
    data = _print_results(console, flags.suite, costs, results)
    failed = []
    if measured is not None:
        table, rows = report.compare(results, measured, flags.tolerance)
        console.print(table)
        data["comparison"] = rows
        failed = [r["name"] for r in rows if not r["ok"]]
        if not rows:
            raise UserError(f"--measured {flags.measured}: no transition of the bench suite has both stalls")
    if str(plot_path) != "-":
        report.plot(results, plot_path, f"simulated migration stall ({flags.suite} suite)")
        console.print(f"plot written to {plot_path}")
    if flags.json_out:
        sys.stdout.write(json.dumps(data) + "\n")
    if failed:
        console.print(f"[red]off by more than {flags.tolerance:.0%}[/]: {', '.join(failed)}")
        raise typer.Exit(1)


def _costs(costs_file: Path | None, cost_flags: dict[str, Any], control_plane: Path | None) -> CostModel:
    """The file's cost fields (checked on their own, to name the file), the flags over them, the
    control round fitted to ``--control-plane`` over both."""
    from etc_agent.sim.costs import CostModel

    try:
        values = CostModel.from_file(costs_file) if costs_file else {}
        fitted = CostModel.from_control_plane(control_plane) if control_plane else {}
    except ValueError as err:
        raise UserError(str(err)) from None
    if values:
        build_model(CostModel, values, str(costs_file))
    return build_model(CostModel, {**values, **cost_flags, **fitted})


def _scenarios(suite: str, models: str | None) -> list[Scenario]:
    from etc_agent.sim.suites import PAPER_SIZES, bench_suite, fsdp_suite, paper_suite, scale_suite

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
        return paper_suite(sizes)
    suites = {"bench": bench_suite, "fsdp": fsdp_suite, "scale": scale_suite}
    if suite not in suites:
        raise UserError(f"--suite {suite!r}: use paper, fsdp, bench or scale")
    if models is not None:
        raise UserError("--models applies to the paper suite only")
    return suites[suite]()


def _read_measured(flags: SimulateFlags) -> dict[str, Any] | None:
    """``--measured``: the JSON line of scripts/bench_migration.py, checked with ``--tolerance``."""
    if flags.measured is not None and flags.suite != "bench":
        raise UserError("--measured compares with scripts/bench_migration.py: use it with --suite bench")
    if flags.tolerance <= 0:
        raise UserError(f"--tolerance must be positive, got {flags.tolerance}")
    if flags.measured is None:
        return None
    try:
        measured = json.loads(flags.measured.read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError) as err:
        raise UserError(f"--measured {flags.measured}: not a bench_migration.py JSON line ({err})") from None
    if not isinstance(measured, dict) or not isinstance(measured.get("transitions"), list):
        raise UserError(f"--measured {flags.measured}: not a bench_migration.py JSON line (no transitions)")
    return measured


def _print_results(console: Console, suite: str, costs: CostModel, results: list[SimResult]) -> dict[str, Any]:
    """The cost and result tables and the median ratio; the JSON object of ``--json`` so far."""
    from etc_agent.sim import report

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
    return data
