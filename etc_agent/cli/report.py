"""Human-facing rendering of plans: rich tables and a PNG heatmap."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from etc_agent.layout.devices import format_ranges
from etc_agent.planner.plan import MigrationPlan
from etc_agent.planner.policy import PolicyDecision

MAX_ASSIGNMENT_ROWS = 64
MAX_NODE_LOSS_ROWS = 8


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def transition_title(plan: MigrationPlan) -> str:
    old = plan.old_config.short() if plan.old_config else "old layout"
    new = plan.new_config.short() if plan.new_config else "new layout"
    return f"{old} on {len(plan.devices_old)} devices -> {new} on {len(plan.devices_new)} devices"


Row = tuple[str, str, str]
"""One line of the summary: figure, value, note."""


def summary_table(plan: MigrationPlan) -> Table:
    table = Table(title=transition_title(plan), show_header=True, header_style="bold")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("", style="dim")
    rows = _figure_rows(plan)
    if plan.failure_domains is not None:
        rows += _failure_domain_rows(plan.failure_domains)
    advice = plan.resilient_alternative
    if advice is not None:
        rows.append(
            (
                "resilient placement would move",
                fmt_bytes(advice["bytes_moved"]),
                f"+{fmt_bytes(advice['extra_bytes_moved'])}; then a node loss loses "
                f"{fmt_bytes(advice['worst_node_loss']['bytes_lost'] if advice['worst_node_loss'] else 0)} "
                "(--placement resilient applies it)",
            )
        )
    if plan.failed:
        rows.insert(0, ("failed devices", str(len(plan.failed)), ", ".join(map(str, plan.failed[:8]))))
    for row in rows:
        table.add_row(*row)
    return table


def _figure_rows(plan: MigrationPlan) -> list[Row]:
    """What the plan moves and costs, beside what the naive and checkpoint ways would."""
    moved = plan.bytes_moved
    resident = sum(plan.resident_bytes.values())
    return [
        ("state (each element once)", fmt_bytes(plan.state_bytes), ""),
        ("new layout needs (all devices)", fmt_bytes(sum(plan.need_bytes.values())), ""),
        ("already resident", fmt_bytes(resident), "no copy over a link"),
        ("moved, intra-node", fmt_bytes(moved - plan.bytes_moved_inter_node), ""),
        ("moved, inter-node", fmt_bytes(plan.bytes_moved_inter_node), ""),
        ("moved, total", fmt_bytes(moved), f"{moved:,} bytes"),
        (
            "lower bound",
            fmt_bytes(plan.lower_bound_bytes) if plan.lower_bound_bytes is not None else "-",
            "no placement moves less",
        ),
        ("naive placement moves", fmt_bytes(plan.naive_bytes_moved), "new rank r on the r-th device"),
        ("checkpoint way moves", fmt_bytes(plan.checkpoint_bytes), "write all + read every new shard"),
        (
            "messages / rounds",
            f"{plan.num_messages} / {plan.num_rounds}",
            f"mem cap {fmt_bytes(plan.mem_cap_bytes)} per device and round",
        ),
        ("estimated seconds (ETC)", f"{plan.estimated_seconds:.3f}", "bandwidth model"),
        ("estimated seconds (checkpoint)", f"{plan.checkpoint_estimated_seconds:.3f}", "save + restart + load"),
        ("plan seconds", f"{plan.plan_seconds:.3f}", "time to compute this plan"),
        ("plan hash", plan.plan_hash, ""),
    ]


def _failure_domain_rows(domains: dict[str, Any]) -> list[Row]:
    """State whose every copy sits in one node, and what the loss of each node would lose."""
    rows: list[Row] = [
        (
            "shards with one failure domain",
            str(domains["single_domain_shards"]),
            f"{fmt_bytes(domains['single_domain_bytes'])} with every copy in one node"
            + (
                f" ({fmt_bytes(domains['unavoidable_single_domain_bytes'])} held once: ZeRO ranges, dp=1)"
                if domains["unavoidable_single_domain_bytes"]
                else ""
            ),
        ),
    ]
    worst = domains["worst_node_loss"]
    if worst is None or domains["num_nodes"] <= 1:
        return rows
    rows.append(
        (
            "worst single node loss",
            f"{fmt_bytes(worst['bytes_lost'])} lost",
            f"{worst['node']}: {fmt_bytes(worst['bytes_from_peers'])} from peers",
        )
    )
    losing = [n for n in domains["node_loss"] if n["bytes_lost"]]
    for node in losing[:MAX_NODE_LOSS_ROWS]:
        rows.append((f"  loss of {node['node']}", f"{fmt_bytes(node['bytes_lost'])} lost", "only a checkpoint has it"))
    if len(losing) > MAX_NODE_LOSS_ROWS:
        rows.append(("", f"{len(losing) - MAX_NODE_LOSS_ROWS} more nodes", "see --json node_loss"))
    return rows


def assignment_table(plan: MigrationPlan) -> Table:
    old_rank_on = {d: r for r, d in enumerate(plan.old_assignment)}
    received: dict = defaultdict(int)
    for t in plan.transfers:
        received[t.dst] += t.num_bytes
    cfg = plan.new_config
    if len(plan.assignment) > MAX_ASSIGNMENT_ROWS:
        return _node_table(plan, received)
    table = Table(title="assignment (new rank -> device)", header_style="bold")
    for name in ("rank", "(pp,dp,tp)", "device", "old rank there", "needs", "resident", "receives"):
        table.add_column(name, justify="right" if name not in ("device", "(pp,dp,tp)") else "left")
    for rank, device in enumerate(plan.assignment):
        coord = cfg.coord(rank) if cfg else None
        old = old_rank_on.get(device)
        table.add_row(
            str(rank),
            f"({coord.pp},{coord.dp},{coord.tp})" if coord else "",
            str(device),
            "-" if old is None else str(old),
            fmt_bytes(plan.need_bytes[device]),
            fmt_bytes(plan.resident_bytes[device]),
            fmt_bytes(received[device]),
        )
    idle = [d for d in plan.devices_new if d not in set(plan.assignment)]
    if idle:
        table.caption = f"idle: {', '.join(map(str, idle))}"
    return table


def _node_table(plan: MigrationPlan, received: dict) -> Table:
    table = Table(title=f"assignment by node ({len(plan.assignment)} ranks)", header_style="bold")
    for name in ("node", "ranks", "needs", "resident", "receives"):
        table.add_column(name, justify="right" if name != "node" else "left")
    ranks: dict[str, list[int]] = defaultdict(list)
    for rank, device in enumerate(plan.assignment):
        ranks[device.node].append(rank)
    for node in dict.fromkeys(d.node for d in plan.devices_new):
        devs = [d for d in plan.devices_new if d.node == node]
        rs = ranks.get(node, [])
        table.add_row(
            node,
            format_ranges(sorted(rs)) or "idle",
            fmt_bytes(sum(plan.need_bytes[d] for d in devs)),
            fmt_bytes(sum(plan.resident_bytes[d] for d in devs)),
            fmt_bytes(sum(received[d] for d in devs)),
        )
    return table


def policy_table(decision: PolicyDecision, limit: int = 12) -> Table:
    table = Table(title="candidate configurations (fastest first)", header_style="bold")
    for name in ("config", "devices", "memory/device", "step s (est)", "moved", "migration s (est)", "note"):
        table.add_column(name, justify="left" if name in ("config", "note") else "right")
    for c in decision.candidates[:limit]:
        style = "bold green" if c is decision.winner else None
        table.add_row(
            c.config.short(),
            str(c.config.world_size),
            fmt_bytes(c.memory_bytes),
            f"{c.step_seconds:.3g}",
            "" if c.bytes_moved is None else fmt_bytes(c.bytes_moved),
            "" if c.migration_seconds is None else f"{c.migration_seconds:.3g}",
            c.note,
            style=style,
        )
    table.caption = f"{len(decision.candidates)} candidates; winner {decision.reason}"
    return table


def print_plan(console: Console, plan: MigrationPlan) -> None:
    console.print(summary_table(plan))
    console.print(assignment_table(plan))


def plot_heatmap(plan: MigrationPlan, path: str | Path) -> None:
    """Bytes sent between nodes (or devices, when there are at most 16) as a PNG heatmap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    devices = list(dict.fromkeys(list(plan.devices_old) + list(plan.devices_new)))
    by_device = len(devices) <= 16
    labels = [str(d) for d in devices] if by_device else list(dict.fromkeys(d.node for d in devices))
    index = {name: i for i, name in enumerate(labels)}
    matrix = np.zeros((len(labels), len(labels)))
    for t in plan.transfers:
        s = index[str(t.src) if by_device else t.src.node]
        d = index[str(t.dst) if by_device else t.dst.node]
        matrix[s, d] += t.num_bytes
    size = min(14, 3 + 0.35 * len(labels))
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    im = ax.imshow(matrix / 2**20, cmap="viridis")
    ticks = range(len(labels)) if len(labels) <= 40 else range(0, len(labels), max(1, len(labels) // 20))
    ax.set_xticks(list(ticks), [labels[i] for i in ticks], rotation=90, fontsize=7)
    ax.set_yticks(list(ticks), [labels[i] for i in ticks], fontsize=7)
    ax.set_xlabel("receiver")
    ax.set_ylabel("sender")
    fig.colorbar(im, ax=ax, label="MiB sent")
    ax.set_title(
        f"{transition_title(plan)}\nmoved {fmt_bytes(plan.bytes_moved)} "
        f"({fmt_bytes(plan.bytes_moved_inter_node)} inter-node), lower bound {fmt_bytes(plan.lower_bound_bytes) if plan.lower_bound_bytes is not None else '-'}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
