"""Gone agents: a refused liveness port, after one that answered, takes a member out at once."""

from __future__ import annotations

from etc_agent.agent.gone import GoneAgents
from etc_agent.rendezvous.records import NodeRecord
from etc_agent.utils.liveness import LivenessPort, probe


def node(node_id: str, port: int | None) -> NodeRecord:
    return NodeRecord(node_id=node_id, host="127.0.0.1", num_devices=1, pid=1, probe_port=port)


def test_a_liveness_port_answers_while_open_and_refuses_once_closed():
    port = LivenessPort()
    assert probe("127.0.0.1", port.port) == "alive"
    assert probe("127.0.0.1", port.port) == "alive"  # it accepts again and again
    port.close()
    assert probe("127.0.0.1", port.port) == "gone"


def test_only_a_node_that_answered_before_can_be_found_gone_and_each_piece_of_evidence_checks_once():
    answers = {"b": "alive", "c": "gone", "d": "alive"}  # c refused from the start (a firewall, say)
    asked = []

    def prober(host, port, timeout_s):
        asked.append(port)
        return answers[{1: "b", 2: "c", 3: "d"}[port]]

    gone = GoneAgents("a", prober)
    records = [node("a", 0), node("b", 1), node("c", 2), node("d", 3), node("e", None)]
    gone.learn(records)
    gone.learn(records)  # each node once
    assert asked == [1, 2, 3]
    members = ["a", "b", "c", "d", "e"]
    assert gone.check(5, 0, members, records) == []  # no failure reported: nothing probed
    answers["b"] = "gone"
    assert gone.check(5, 1, members, records) == ["b"]  # c's refusal does not count, e has no port
    assert gone.check(5, 1, members, records) == []  # the same evidence: checked already
    answers["d"] = "gone"
    assert gone.check(5, 2, members, records) == ["b", "d"]
