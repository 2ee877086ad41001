"""The leader's reachability watch (etc_agent.agent.reach) on a fake prober and a fake clock, and the
liveness probes it makes (etc_agent.utils.liveness.probe_many) against ports of this host."""

from __future__ import annotations

import socket
from collections.abc import Mapping

import pytest

from etc_agent.agent.reach import Reachability, probe_interval
from etc_agent.rendezvous.records import NodeRecord
from etc_agent.utils.liveness import LivenessPort, Probe, probe_many

TIMEOUT = 1.0
"""--peer-timeout of every test here."""


class FakeClock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeProber:
    """Answers each node as ``answers`` says (a node not in it: ``unknown``); remembers what it was asked."""

    def __init__(self) -> None:
        self.answers: dict[str, Probe] = {}
        self.asked: list[dict[str, tuple[str, int]]] = []
        self.timeouts: list[float] = []

    def __call__(self, targets: Mapping[str, tuple[str, int]], timeout_s: float) -> dict[str, Probe]:
        self.asked.append(dict(targets))
        self.timeouts.append(timeout_s)
        return {node_id: self.answers.get(node_id, "unknown") for node_id in targets}


def record(node_id: str, probe_port: int | None = 7000) -> NodeRecord:
    return NodeRecord(
        node_id=node_id, host=f"10.0.0.{ord(node_id[0]) % 200}", num_devices=1, pid=1, probe_port=probe_port
    )


@pytest.fixture
def watch() -> tuple[Reachability, FakeProber, FakeClock]:
    prober, clock = FakeProber(), FakeClock()
    return Reachability("leader", TIMEOUT, prober=prober, clock=clock), prober, clock


def probe_at(
    watch: tuple[Reachability, FakeProber, FakeClock], when: float, records: list[NodeRecord], **answers: Probe
) -> tuple[list[str], bool]:
    """One round at ``when`` with ``answers``; (the ids returned as never answering, went_silent)."""
    reach, prober, clock = watch
    clock.now = when
    prober.answers = dict(answers)
    found = reach.round(records)
    return [r.node_id for r in found.never], found.went_silent


@pytest.mark.parametrize(
    ("peer_timeout", "interval"), [(1.0, 0.25), (10.0, 0.25), (0.4, 0.1), (0.1, 0.05), (0.0, 0.05)]
)
def test_probe_interval_fits_four_probes_in_the_timeout_within_bounds(peer_timeout: float, interval: float):
    assert probe_interval(peer_timeout) == pytest.approx(interval)


def test_a_silent_node_is_unreachable_only_once_its_unanswered_probes_reach_past_the_timeout(watch):
    reach, prober, _ = watch
    nodes = [record("a"), record("b")]
    assert probe_at(watch, 0.0, nodes, a="alive", b="alive") == ([], False)
    assert prober.timeouts == [probe_interval(TIMEOUT)]
    for when in (0.25, 0.5, 0.75, 1.0):
        assert probe_at(watch, when, nodes, a="alive") == ([], False)
        assert reach.unreachable(["a", "b"]) == [], when
    assert reach.silent_for("b") == pytest.approx(1.0)  # not more than the timeout yet
    assert probe_at(watch, 1.25, nodes, a="alive") == ([], True)
    assert reach.unreachable(["a", "b"]) == ["b"]
    assert reach.silent_for("b") == pytest.approx(1.25) and reach.silent_for("a") == 0.0
    assert probe_at(watch, 1.5, nodes, a="alive") == ([], False)  # said once, not again
    assert reach.unreachable(["a", "b"]) == ["b"]


def test_a_refused_connection_counts_as_silence_too(watch):
    reach, _, _ = watch
    nodes = [record("a")]
    probe_at(watch, 0.0, nodes, a="alive")
    probe_at(watch, 0.5, nodes, a="gone")
    assert reach.silent_for("a") == pytest.approx(0.5)
    assert probe_at(watch, 1.5, nodes, a="gone") == ([], True)
    assert reach.unreachable(["a"]) == ["a"]


def test_time_without_probes_is_no_silence(watch):
    """Only probes made count: a prober that was not scheduled for a minute finds nothing unreachable,
    and a node that answers once probes resume never was."""
    reach, _, clock = watch
    nodes = [record("a")]
    probe_at(watch, 0.0, nodes, a="alive")
    clock.now = 60.0
    assert reach.unreachable(["a"]) == [] and reach.silent_for("a") == 0.0
    assert probe_at(watch, 60.0, nodes, a="alive") == ([], False)
    assert reach.unreachable(["a"]) == [] and reach.silent_for("a") == 0.0


def test_a_pause_of_the_prober_before_a_silent_probe_is_not_counted_as_silence(watch):
    """Answered at 0, no probe for a minute, then unanswered: the silence observed starts at the first
    unanswered probe, so it takes --peer-timeout of unanswered probes from there."""
    reach, _, _ = watch
    nodes = [record("a")]
    probe_at(watch, 0.0, nodes, a="alive")
    assert probe_at(watch, 60.0, nodes) == ([], False)
    assert reach.silent_for("a") == 0.0 and reach.unreachable(["a"]) == []
    assert silent_rounds(watch, 60.25, 61.25, nodes) == [False] * 4 + [True]
    assert reach.silent_for("a") == pytest.approx(1.25)


def silent_rounds(watch, start: float, end: float, nodes: list[NodeRecord], **answers: Probe) -> list[bool]:
    """A round every probe interval from ``start`` to ``end`` (inclusive); their went_silent."""
    steps = round((end - start) / probe_interval(TIMEOUT))
    return [probe_at(watch, start + i * probe_interval(TIMEOUT), nodes, **answers)[1] for i in range(steps + 1)]


def test_a_round_says_when_an_unreachable_node_answers_again_once(watch):
    """What lets a leader admit a host back at once after a cut, not at its next periodic decision."""
    reach, prober, clock = watch
    nodes = [record("a"), record("b")]

    def back_at(when: float, probed: list[NodeRecord], **answers: Probe) -> bool:
        clock.now, prober.answers = when, dict(answers)
        return reach.round(probed).answered_again

    probe_at(watch, 0.0, nodes, a="alive", b="alive")
    silent_rounds(watch, 0.25, 1.25, nodes, a="alive")
    assert reach.unreachable(["a", "b"]) == ["b"]
    assert back_at(1.5, nodes, a="alive") is False  # still silent
    assert back_at(1.75, nodes, a="alive", b="alive") is True
    assert back_at(2.0, nodes, a="alive", b="alive") is False  # said once
    # Cut again: its record goes with its lease (not probed meanwhile), it registers again after
    # the heal and answers its first probe: back, though no round saw it unreachable since.
    silent_rounds(watch, 2.25, 3.5, nodes, a="alive")
    assert reach.unreachable(["b"]) == ["b"]
    assert back_at(3.75, [record("a")], a="alive") is False
    assert back_at(9.0, nodes, a="alive", b="alive") is True


def test_a_node_that_answers_again_is_reachable(watch):
    reach, _, _ = watch
    nodes = [record("a")]
    probe_at(watch, 0.0, nodes, a="alive")
    assert silent_rounds(watch, 0.25, 1.25, nodes) == [False] * 4 + [True]
    assert reach.unreachable(["a"]) == ["a"]
    assert probe_at(watch, 1.5, nodes, a="alive") == ([], False)
    assert reach.unreachable(["a"]) == [] and reach.silent_for("a") == 0.0
    assert probe_at(watch, 1.75, nodes) == ([], False)
    assert reach.silent_for("a") == pytest.approx(0.25)  # counted from its newest answer
    assert silent_rounds(watch, 2.0, 2.75, nodes) == [False] * 3 + [True]  # silent anew: said again
    assert reach.unreachable(["a"]) == ["a"]


def test_a_node_that_never_answered_is_said_once_and_never_unreachable(watch):
    reach, _, _ = watch
    nodes = [record("a"), record("b")]
    assert probe_at(watch, 0.0, nodes, a="alive") == (["b"], False)
    for when in (1.0, 5.0, 50.0):
        assert probe_at(watch, when, nodes, a="alive") == ([], False)
    assert reach.unreachable(["a", "b"]) == [] and reach.silent_for("b") == 0.0
    # Once it answers it counts like any other node.
    probe_at(watch, 51.0, nodes, a="alive", b="alive")
    assert silent_rounds(watch, 51.25, 52.25, nodes, a="alive")[-1] is True
    assert reach.unreachable(["a", "b"]) == ["b"]


def test_the_node_itself_and_nodes_without_a_liveness_port_are_not_probed(watch):
    reach, prober, _ = watch
    nodes = [record("leader"), record("a"), record("p", probe_port=None)]
    assert probe_at(watch, 0.0, nodes) == (["a"], False)
    assert prober.asked == [{"a": (record("a").host, 7000)}]
    assert probe_at(watch, 5.0, [record("leader"), record("p", probe_port=None)]) == ([], False)
    assert len(prober.asked) == 1  # nothing to probe: no call at all
    assert reach.unreachable(["leader", "p"]) == []


def test_a_node_whose_record_went_and_came_back_while_silent_is_still_unreachable(watch):
    reach, prober, _ = watch
    a, b = record("a"), record("b")
    probe_at(watch, 0.0, [a, b], a="alive", b="alive")
    assert silent_rounds(watch, 0.25, 1.25, [a, b], a="alive")[-1] is True
    probe_at(watch, 2.0, [a], a="alive")  # the leader deleted b's record
    assert "b" not in prober.asked[-1]
    assert reach.unreachable(["a", "b"]) == ["b"]
    never, _ = probe_at(watch, 3.0, [a, b], a="alive")  # registered again, still cut off
    assert never == [] and reach.unreachable(["a", "b"]) == ["b"]
    assert reach.silent_for("b") == pytest.approx(3.0)
    probe_at(watch, 3.25, [a, b], a="alive", b="alive")
    assert reach.unreachable(["a", "b"]) == []


def test_unreachable_is_sorted_and_limited_to_the_nodes_asked_about(watch):
    reach, _, _ = watch
    nodes = [record("c"), record("a"), record("b")]
    probe_at(watch, 0.0, nodes, a="alive", b="alive", c="alive")
    silent_rounds(watch, 0.25, 1.25, nodes, b="alive")
    assert reach.unreachable(["c", "a", "b", "a"]) == ["a", "c"]
    assert reach.unreachable(["c"]) == ["c"] and reach.unreachable([]) == []
    assert reach.silent_for("unknown-node") == 0.0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_many_tells_a_listening_port_from_a_closed_one():
    port = LivenessPort()
    try:
        closed = _closed_port()
        results = probe_many({"live": ("127.0.0.1", port.port), "dead": ("127.0.0.1", closed)}, 2.0)
        assert results == {"live": "alive", "dead": "gone"}
    finally:
        port.close()
    assert probe_many({"was": ("127.0.0.1", port.port)}, 2.0) == {"was": "gone"}  # closed: refused


def test_probe_many_of_nothing_is_nothing():
    assert probe_many({}, 0.1) == {}
