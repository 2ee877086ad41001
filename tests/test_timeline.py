"""The run timeline (``etc-agent timeline``) built from agents' event records: pure, plus the CLI's
one-line refusal of a directory without records. A real run is drawn in tests/test_metrics.py."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from etc_agent.agent.timeline import build_timeline, read_events
from etc_agent.rendezvous.records import StallParts


def _event(ts: float, node: str, event: str, **fields) -> dict:
    return {"ts": ts, "event": event, "node": node, **fields}


def _run() -> list[dict]:
    parts = {name: 0.0 for name in StallParts.model_fields}
    parts.update(stop_s=0.1, build_s=0.2, transfer_s=0.3)
    return [
        _event(100.0, "a", "registered"),
        _event(100.5, "b", "registered"),
        _event(101.0, "a", "workers_started", generation=0),
        _event(101.0, "b", "workers_started", generation=0),
        _event(105.0, "c", "registered"),
        _event(
            106.6,
            "a",
            "migration",
            generation=1,
            total_stall_s=0.6,
            stall_parts=parts,
            bytes_moved=2048,
            old_config="tp=2",
            old_world_size=4,
            new_world_size=6,
            lost=[],
            devices=["a:0", "b:0", "c:0"],
        ),
        _event(106.0, "c", "workers_started", generation=1),
        _event(108.0, "b", "workers_failed", exit_codes={"1": -9}, restarting=[1]),
        _event(109.0, "b", "workers_warm"),
        _event(110.0, "c", "signal", signal="SIGTERM"),
        _event(110.5, "c", "departed"),
        _event(112.0, "a", "workers_succeeded"),
    ]


def test_a_run_becomes_rows_of_states_switches_with_their_parts_and_marks():
    line = build_timeline(reversed(_run()))  # any order
    assert line.nodes == ["a", "b", "c"] and line.duration == pytest.approx(12.0)
    states = {(s.node, s.state): (round(s.start, 3), round(s.end, 3)) for s in line.segments}
    assert states[("a", "training")] == (1.0, 12.0)
    assert states[("b", "training")] == (1.0, 8.0) and states[("b", "restarting")] == (8.0, 9.0)
    assert states[("c", "training")] == (6.0, 10.5)  # it left: nothing drawn after "departed"
    [switch] = line.switches
    assert (switch.generation, switch.kind, switch.nodes) == (1, "join", ("a", "b", "c"))
    assert switch.start == pytest.approx(6.0) and switch.end == pytest.approx(6.6)
    spans = {name: (round(s, 3), round(e, 3)) for name, s, e in switch.parts}
    assert spans["stop"] == (6.0, 6.1) and spans["build"] == (6.1, 6.3) and spans["transfer"] == (6.3, 6.6)
    assert switch.parts[-1][2] == pytest.approx(switch.end)  # the parts add up to the stall
    marks = {(m.node, m.kind) for m in line.markers}
    assert {("c", "join"), ("b", "crash"), ("c", "leave")} <= marks


def test_records_are_read_from_every_agent_directory_and_a_directory_without_any_is_one_line(tmp_path):
    for node in ("a", "b"):
        folder = tmp_path / f"run_{node}"
        folder.mkdir()
        lines = [json.dumps(e) for e in _run() if e["node"] == node] + ['{"ts": 1, "event": "cut sho']
        (folder / "events.jsonl").write_text("\n".join(lines) + "\n")
    assert len(read_events(tmp_path)) == sum(e["node"] in ("a", "b") for e in _run())
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run_cli("timeline", str(empty))
    assert out.returncode != 0 and "no agent records" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
