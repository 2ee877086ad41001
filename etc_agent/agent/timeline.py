"""A run's timeline from its agents' event records (``events.jsonl``): plain data in, plain data out.

Each agent writes every event it emits to ``<log-dir>/<run>_<node>/events.jsonl``
(:class:`~etc_agent.agent.console.EventFile`). :func:`build_timeline` turns the records of all the
agents of a run into one :class:`Timeline`: a row per node with what its workers did (training,
spare, restarting a crashed worker, waiting), each switch with its named parts on the rows of the
nodes that took part, and the events that caused or marked them (join, leave, crash, fence, a new
leader). ``etc-agent timeline`` draws it (:mod:`etc_agent.cli.timeline`).

A switch's record is logged by the agent of the new rank 0 once the switch is done; it ends then,
and began ``total_stall_s`` before. Its parts (:data:`~etc_agent.agent.metrics.STALL_PHASES`) are
laid out in their order from its start; they add up to the stall.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etc_agent.agent.metrics import stall_phases, switch_kind
from etc_agent.layout.devices import Device

EVENTS_FILE = "events.jsonl"

STARTS: dict[str, str] = {
    "registered": "waiting",
    "workers_started": "training",
    "workers_continue": "training",
    "spare": "spare",
    "workers_warm": "waiting",
}
"""Events after which a node's row is in this state."""

ENDS = frozenset({"workers_succeeded", "job_failed", "departed", "state_sent", "giving_up", "fatal"})
"""Events after which a node's row shows nothing more (it left, or the job ended)."""

MARKS: dict[str, str] = {
    "registered": "join",
    "signal": "leave",
    "departing": "leave",
    "workers_failed": "crash",
    "fenced": "fence",
    "unfenced": "unfence",
    "leader_elected": "leader",
    "generation_abandoned": "abandoned",
}
"""Events drawn as marks on their node's row, by the kind of mark."""


@dataclass(frozen=True)
class Segment:
    node: str
    start: float
    end: float
    state: str
    """training, spare, restarting, waiting."""


@dataclass(frozen=True)
class Marker:
    node: str
    at: float
    kind: str
    label: str


@dataclass(frozen=True)
class SwitchSpan:
    """One switch (a migration record), seconds from the timeline's start."""

    generation: int
    start: float
    end: float
    kind: str
    reason: str
    bytes_moved: int
    stall_s: float
    parts: tuple[tuple[str, float, float], ...]
    """(part, start, end) in order, from ``start`` to ``end``."""
    nodes: tuple[str, ...]
    """The nodes of its new generation (the members' devices' nodes)."""
    label: str


@dataclass
class Timeline:
    nodes: list[str]
    """Rows, in the order the nodes registered."""
    segments: list[Segment] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    switches: list[SwitchSpan] = field(default_factory=list)
    t0: float = 0.0
    """Wall-clock time of the first record (every time in the timeline is seconds after it)."""
    duration: float = 0.0


def read_events(log_dir: Path) -> list[dict[str, Any]]:
    """Every record of every ``events.jsonl`` under ``log_dir``; a ValueError in one line when there is none."""
    files = sorted(log_dir.rglob(EVENTS_FILE)) if log_dir.is_dir() else []
    events = []
    for path in files:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if isinstance(record, dict) and "ts" in record and "event" in record:
                events.append(record)
    if not events:
        raise ValueError(
            f"{log_dir}: no agent records ({EVENTS_FILE}) under it; give the --log-dir of an etcrun run "
            "(each agent writes <log-dir>/<run>_<node>/events.jsonl)"
        )
    return events


def build_timeline(events: Iterable[Mapping[str, Any]]) -> Timeline:
    """The timeline of a run from its agents' records (any order)."""
    ordered = sorted(events, key=lambda e: e["ts"])
    assert ordered, "read_events refuses a run without records"
    t0 = ordered[0]["ts"]
    nodes = list(dict.fromkeys(e["node"] for e in ordered if e.get("node")))
    timeline = Timeline(nodes=nodes, t0=t0, duration=ordered[-1]["ts"] - t0)
    for node in nodes:
        mine = [e for e in ordered if e.get("node") == node]
        timeline.segments += _segments(node, mine, t0)
        timeline.markers += [_marker(node, e, t0) for e in mine if e["event"] in MARKS]
    timeline.switches = [_switch(e, t0) for e in ordered if e["event"] == "migration" and "total_stall_s" in e]
    return timeline


def _segments(node: str, events: list[Mapping[str, Any]], t0: float) -> list[Segment]:
    out: list[Segment] = []
    state: str | None = None
    since = 0.0
    for e in events:
        name = e["event"]
        if name in ENDS:
            new = None
        elif name == "workers_failed":
            new = "restarting" if e.get("restarting") else None
        elif name in STARTS:
            new = STARTS[name]
        else:
            continue
        at = e["ts"] - t0
        if state is not None and at > since:
            out.append(Segment(node, since, at, state))
        state, since = new, at
    end = events[-1]["ts"] - t0 if events else since
    if state is not None and end > since:
        out.append(Segment(node, since, end, state))
    return out


def _marker(node: str, e: Mapping[str, Any], t0: float) -> Marker:
    kind = MARKS[e["event"]]
    if kind == "crash":
        detail = f"exit codes {e.get('exit_codes')}"
    elif kind == "leave":
        detail = str(e.get("signal") or e.get("reason") or "departing")
    elif kind == "fence":
        detail = str(e.get("reason", ""))
    else:
        detail = ""
    return Marker(node, e["ts"] - t0, kind, f"{kind}: {detail}" if detail else kind)


def _switch(e: Mapping[str, Any], t0: float) -> SwitchSpan:
    end = e["ts"] - t0
    stall = float(e["total_stall_s"])
    start = end - stall
    parts, at = [], start
    for name, seconds in stall_phases(e.get("stall_parts") or {}).items():
        parts.append((name, at, at + seconds))
        at += seconds
    nodes = tuple(dict.fromkeys(Device.parse(d).node for d in e.get("devices") or []))
    kind = switch_kind(e)
    moved = int(e.get("bytes_moved") or 0)
    label = f"generation {e['generation']}: {kind}, stall {stall:.2f} s, {moved} bytes moved"
    return SwitchSpan(
        generation=int(e["generation"]),
        start=start,
        end=end,
        kind=kind,
        reason=str(e.get("reason", "")),
        bytes_moved=moved,
        stall_s=stall,
        parts=tuple(parts),
        nodes=nodes,
        label=label,
    )
