"""The leader's decision on a real embedded store (in this process): what it publishes when a node's
record changes while the decision reads the store."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import TEST_SECRET

from etc_agent.agent.config import AgentConfig
from etc_agent.agent.leader import Leader
from etc_agent.agent.records import RecordReader
from etc_agent.rendezvous.embedded import EmbeddedStore, EmbeddedStoreServer
from etc_agent.rendezvous.records import GenerationRecord, NodeRecord


class _ChangesAfterReads(EmbeddedStore):
    """A store on which, after the ``after``-th read of ``nodes/``, the crashed worker's node takes
    itself out of the membership (what its agent does just before it reports the failure)."""

    def __init__(self, endpoint: str, run_id: str, after: int, change):
        super().__init__(endpoint, run_id, secret=TEST_SECRET)
        self.after, self.change, self.reads = after, change, 0

    def get_prefix(self, prefix: str):
        found = super().get_prefix(prefix)
        if prefix == "nodes/":
            self.reads += 1
            if self.reads == self.after:
                self.change()
        return found


@pytest.fixture
def server():
    server = EmbeddedStoreServer(secret=TEST_SECRET)
    yield server
    server.stop()


def _node(node_id: str, **changes) -> str:
    return NodeRecord(node_id=node_id, host="127.0.0.1", num_devices=2, pid=1, **changes).dumps()


@pytest.mark.parametrize("after", [1, 2, 3])
def test_a_node_taking_itself_out_during_a_decision_is_never_published_as_a_departure(server, after):
    """Node b's worker crashed: its agent rewrites b's record (not ready, restarting local rank 1,
    crashed in generation 0). Wherever in the leader's decision that write lands, the leader
    publishes nothing yet (it read the record before) or a generation that names the worker failure;
    never one that says b left (a decision that read the record twice saw b in the first read and
    gone in the second)."""
    run_id = f"leader-{after}"
    writer = EmbeddedStore(server.endpoint, run_id, secret=TEST_SECRET)
    writer.put("elastic", json.dumps({"node": "a"}))
    lease = writer.grant_lease(60)  # the leader admits only nodes registered under a lease
    writer.put("nodes/a", _node("a"), lease=lease)
    writer.put("nodes/b", _node("b"), lease=lease)
    current = GenerationRecord(
        number=0,
        status="running",
        members=["a", "b"],
        num_devices=[2, 2],
        parallel="tp=2,pp=1,dp=2,zero=0",
        started=True,
        published_at=time.time(),
        reason="start",
    )
    writer.put("generation", current.dumps())

    def take_b_out() -> None:
        writer.put("nodes/b", _node("b", ready=False, restarting=[1], crashed_in=0), lease=lease)

    store = _ChangesAfterReads(server.endpoint, run_id, after, take_b_out)
    config = AgentConfig(run_id=run_id, min_nodes=1, max_nodes=2, nproc_per_node=2, parallel="tp=2,dp=auto")
    events: list[tuple[str, dict]] = []
    emit = lambda event, fields: events.append((event, fields))  # noqa: E731
    leader = Leader(
        store,
        config,
        "a",
        emit,
        RecordReader(emit),
        threading.Event(),
        threading.Event(),
        lease=lambda: None,
        latest=lambda: None,
    )
    for _ in range(after + 1):  # the last decision starts after the record was written
        leader.decide()
    published = [GenerationRecord.loads(writer.get("generation").value)]
    reasons = [fields["reason"] for event, fields in events if event == "generation_published"]
    assert reasons and all("left" not in r for r in reasons), reasons
    assert reasons[0] == "worker failure on b", reasons
    assert published[0].members == ["a"] and published[0].parallel == "tp=2,pp=1,dp=1,zero=0", published
