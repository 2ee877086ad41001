"""Tables, comparison with measurements, and the plot of a simulated suite."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rich.table import Table

from etc_agent.sim.costs import CostModel
from etc_agent.sim.estimate import SimResult


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}" if n >= 1e8 else f"{n / 1e9:.3f}"


def results_table(results: list[SimResult], title: str) -> Table:
    table = Table(title=title)
    for col in (
        "model",
        "GPUs",
        "scenario",
        "from -> to",
        "state GB",
        "moved GB",
        "inter-node GB",
        "live s",
        "checkpoint s",
        "ratio",
    ):
        table.add_column(col, justify="right" if col not in ("model", "scenario", "from -> to") else "left")
    for r in results:
        s, p = r.scenario, r.plan
        gpus = (
            f"{len(s.old_devices)}"
            if len(s.old_devices) == len(s.new_devices)
            else f"{len(s.old_devices)}->{len(s.new_devices)}"
        )
        table.add_row(
            s.spec.name,
            gpus,
            s.name,
            f"{s.old_config.short()} -> {s.new_config.short()}",
            _gb(p.state_bytes),
            _gb(p.bytes_moved),
            _gb(p.bytes_moved_inter_node),
            f"{r.etc_s:.2f}",
            f"{r.ckpt_s:.2f}",
            f"{r.ratio:.1f}x",
        )
    return table


def costs_table(costs: CostModel) -> Table:
    table = Table(title="cost model (etc-agent simulate --help names each flag)", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", justify="right")
    table.add_column("meaning")
    for name, field in type(costs).model_fields.items():
        value = getattr(costs, name)
        table.add_row(name, "none" if value is None else f"{value:g}", field.description or "")
    return table


def summary(results: list[SimResult]) -> dict[str, Any]:
    """Median ratio overall and per scenario."""
    by_name: dict[str, list[float]] = {}
    for r in results:
        by_name.setdefault(r.scenario.name, []).append(r.ratio)
    return {
        "median_ratio": round(statistics.median(r.ratio for r in results), 3) if results else None,
        "min_ratio": round(min(r.ratio for r in results), 3) if results else None,
        "max_ratio": round(max(r.ratio for r in results), 3) if results else None,
        "median_ratio_by_scenario": {k: round(statistics.median(v), 3) for k, v in by_name.items()},
    }


def compare(results: list[SimResult], measured: dict[str, Any], tolerance: float) -> tuple[Table, list[dict[str, Any]]]:
    """Predicted vs measured stalls of the ``bench`` suite; ``measured`` is bench_migration.py's JSON
    line. A row passes when both predictions are within ``tolerance`` (relative) of the medians."""
    by_name = {t["name"]: t for t in measured.get("transitions", [])}
    table = Table(title=f"simulator vs measured (medians of {measured.get('repeat', '?')}), tolerance {tolerance:.0%}")
    for col in (
        "transition",
        "moved MB sim / meas",
        "live s sim / meas",
        "err",
        "checkpoint s sim / meas",
        "err",
        "ok",
    ):
        table.add_column(col, justify="left" if col == "transition" else "right")
    rows = []
    for r in results:
        m = by_name.get(r.scenario.name)
        if m is None or not m.get("etc_s") or not m.get("ckpt_s"):
            continue
        state = m.get("state_bytes")
        if state is not None and abs(state - r.plan.state_bytes) > 0.01 * r.plan.state_bytes:
            raise ValueError(
                f"measured {r.scenario.name!r} has {state / 1e6:.1f} MB of state, the simulated model "
                f"{r.plan.state_bytes / 1e6:.1f} MB: not the same benchmark"
            )
        etc_err = r.etc_s / m["etc_s"] - 1
        ckpt_err = r.ckpt_s / m["ckpt_s"] - 1
        ok = abs(etc_err) <= tolerance and abs(ckpt_err) <= tolerance
        rows.append(
            {
                "name": r.scenario.name,
                "sim_bytes_moved": r.plan.bytes_moved,
                "bytes_moved": m.get("bytes_moved"),
                "sim_etc_s": round(r.etc_s, 4),
                "etc_s": m["etc_s"],
                "etc_err": round(etc_err, 4),
                "sim_ckpt_s": round(r.ckpt_s, 4),
                "ckpt_s": m["ckpt_s"],
                "ckpt_err": round(ckpt_err, 4),
                "ok": ok,
            }
        )
        moved = "-" if m.get("bytes_moved") is None else f"{m['bytes_moved'] / 1e6:.1f}"
        table.add_row(
            r.scenario.name,
            f"{r.plan.bytes_moved / 1e6:.1f} / {moved}",
            f"{r.etc_s:.2f} / {m['etc_s']:.2f}",
            f"{etc_err:+.0%}",
            f"{r.ckpt_s:.2f} / {m['ckpt_s']:.2f}",
            f"{ckpt_err:+.0%}",
            "yes" if ok else "[red]no[/]",
        )
    return table, rows


def plot(results: list[SimResult], path: Path, title: str) -> None:
    """Stall of both ways per scenario (log scale), one panel per scenario name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.scenario.name for r in results))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = [r for r in results if r.scenario.name == name]
        labels = [f"{r.scenario.spec.name}\n{len(r.scenario.old_devices)}" for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r.etc_s for r in rows], width=0.4, label="live (ETC)")
        ax.bar([x + 0.2 for x in xs], [r.ckpt_s for r in rows], width=0.4, label="checkpoint")
        for x, r in zip(xs, rows):
            ax.annotate(f"{r.ratio:.1f}x", (x, max(r.etc_s, r.ckpt_s)), ha="center", va="bottom", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(list(xs), labels, fontsize=7, rotation=45, ha="right")
        ax.set_title(name)
        ax.set_ylabel("stall (s, simulated)")
    axes[0][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
