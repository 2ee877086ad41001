"""``etc-agent timeline LOG_DIR``: a run's timeline as a PNG (for reports) and a self-contained HTML
file (hover for detail), drawn from :func:`etc_agent.agent.timeline.build_timeline`."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Annotated, Any

import typer

from etc_agent.agent.timeline import Timeline, build_timeline, read_events

STATE_COLORS = {"training": "#4c9a5a", "spare": "#b9c4cc", "restarting": "#e0a040", "waiting": "#dfe6ea"}
PART_COLORS = {
    "stop": "#8c564b",
    "agree": "#9467bd",
    "build": "#e377c2",
    "plan": "#17becf",
    "transfer": "#d62728",
    "swap": "#7f7f7f",
}
MARK_STYLES = {
    "join": ("^", "#1f77b4"),
    "leave": ("v", "#ff7f0e"),
    "crash": ("X", "#d62728"),
    "fence": ("s", "#000000"),
    "unfence": ("s", "#999999"),
    "leader": ("*", "#bcbd22"),
    "abandoned": ("x", "#8c564b"),
}
ROW_H = 1.0
BAR_H = 0.5
PART_H = 0.22


def timeline(
    log_dir: Annotated[
        Path, typer.Argument(help="The --log-dir of an etcrun run (every agent's events.jsonl under it).")
    ],
    png: Annotated[Path | None, typer.Option(help="The picture (default LOG_DIR/timeline.png).")] = None,
    out_html: Annotated[
        Path | None, typer.Option("--html", help="The hover-able page (default LOG_DIR/timeline.html).")
    ] = None,
) -> None:
    """Draw a run: a row per node (training, spare, restarting), each switch with its parts and its
    bytes and stall, and the joins, leaves, crashes and fences that marked it."""
    line = build_timeline(read_events(log_dir))
    png = png or log_dir / "timeline.png"
    out_html = out_html or log_dir / "timeline.html"
    draw_png(line, png)
    write_html(line, out_html)
    typer.echo(
        f"{len(line.nodes)} nodes, {len(line.switches)} switches, {line.duration:.1f} s: wrote {png} and {out_html}"
    )


def _row_y(line: Timeline) -> dict[str, float]:
    return {node: (len(line.nodes) - 1 - i) * ROW_H for i, node in enumerate(line.nodes)}


def draw_png(line: Timeline, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = _row_y(line)
    fig, ax = plt.subplots(figsize=(max(10.0, min(24.0, line.duration / 3 + 6)), 1.2 + 0.9 * len(line.nodes)))
    for seg in line.segments:
        ax.broken_barh(
            [(seg.start, seg.end - seg.start)], (rows[seg.node] - BAR_H / 2, BAR_H), color=STATE_COLORS[seg.state]
        )
    for index, sw in enumerate(line.switches):
        for node in sw.nodes:
            if node not in rows:
                continue
            for part, start, end in sw.parts:
                ax.broken_barh([(start, end - start)], (rows[node] + BAR_H / 2, PART_H), color=PART_COLORS[part])
        top = max((rows[n] for n in sw.nodes if n in rows), default=0.0)
        # Staggered: switches a fraction of a second apart would print over each other.
        ax.annotate(
            f"g{sw.generation} {sw.kind}\n{sw.stall_s:.2f} s, {_bytes(sw.bytes_moved)}",
            (sw.start, top + BAR_H / 2 + PART_H + 0.02 + 0.42 * (index % 2)),
            fontsize=7,
            va="bottom",
        )
        ax.axvspan(sw.start, sw.end, color="#d62728", alpha=0.08)
    for mark in line.markers:
        symbol, color = MARK_STYLES[mark.kind]
        ax.plot(mark.at, rows[mark.node] - BAR_H / 2 - 0.08, marker=symbol, color=color, markersize=8, linestyle="")
    ax.set_yticks(list(rows.values()), [_short(n) for n in rows])
    ax.set_xlabel("seconds since the first record")
    ax.set_xlim(0, max(line.duration, 1.0))
    ax.set_ylim(-0.8, len(line.nodes) * ROW_H + 0.7)
    handles: list[Any] = [Patch(color=c, label=s) for s, c in STATE_COLORS.items()]
    handles += [Patch(color=c, label=f"switch: {p}") for p, c in PART_COLORS.items()]
    handles += [plt.Line2D([], [], marker=m, color=c, linestyle="", label=k) for k, (m, c) in MARK_STYLES.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax.set_title(f"{len(line.nodes)} nodes, {len(line.switches)} switches")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bytes(num_bytes: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"


def _short(node: str) -> str:
    return node if len(node) <= 24 else node[:10] + "..." + node[-10:]


def write_html(line: Timeline, path: Path) -> None:
    """One SVG in one page, no scripts or outside resources: each bar and mark has a hover title."""
    width, left, row_px = 1200, 200, 56
    scale = (width - left - 20) / max(line.duration, 1.0)
    height = 40 + row_px * len(line.nodes) + 30
    y_of = {node: 30 + i * row_px for i, node in enumerate(line.nodes)}
    shapes: list[str] = []
    for node, y in y_of.items():
        shapes.append(f'<text x="4" y="{y + 22}" font-size="11">{html.escape(_short(node))}</text>')
    for seg in line.segments:
        shapes.append(
            _rect(
                left + seg.start * scale,
                y_of[seg.node] + 14,
                (seg.end - seg.start) * scale,
                16,
                STATE_COLORS[seg.state],
            )
            + f"<title>{html.escape(seg.node)}: {seg.state} {seg.start:.2f}-{seg.end:.2f} s</title></rect>"
        )
    for sw in line.switches:
        title = html.escape(f"{sw.label} ({sw.reason}); " + ", ".join(f"{p} {e - s:.3f} s" for p, s, e in sw.parts))
        for node in sw.nodes:
            if node in y_of:
                for part, start, end in sw.parts:
                    shapes.append(
                        _rect(
                            left + start * scale, y_of[node] + 4, max((end - start) * scale, 0.5), 8, PART_COLORS[part]
                        )
                        + f"<title>{title}</title></rect>"
                    )
        shapes.append(
            f'<g class="switch" data-generation="{sw.generation}" data-kind="{sw.kind}">'
            + _rect(left + sw.start * scale, 20, max(sw.stall_s * scale, 1.0), height - 50, "#d62728", 0.08)
            + f"<title>{title}</title></rect></g>"
        )
    for mark in line.markers:
        x, y = left + mark.at * scale, y_of[mark.node] + 36
        shapes.append(
            f'<circle cx="{x:.1f}" cy="{y}" r="4" fill="{MARK_STYLES[mark.kind][1]}" class="mark" '
            f'data-kind="{mark.kind}"><title>{html.escape(mark.label)} at {mark.at:.2f} s</title></circle>'
        )
    legend = " ".join(
        f'<span style="background:{c};padding:0 6px">&nbsp;</span> {html.escape(n)}'
        for n, c in [*STATE_COLORS.items(), *((f"switch: {p}", c) for p, c in PART_COLORS.items())]
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>etc-agent timeline</title></head>"
        f"<body style='font-family:sans-serif'><h3>{len(line.nodes)} nodes, {len(line.switches)} switches, "
        f"{line.duration:.1f} s</h3><p style='font-size:12px'>{legend}</p>"
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>{''.join(shapes)}</svg>"
        "</body></html>\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")


def _rect(x: float, y: float, w: float, h: float, color: str, opacity: float = 1.0) -> str:
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h}" fill="{color}" fill-opacity="{opacity}">'
