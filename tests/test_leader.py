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


def _electing_agent_b(
    store: EmbeddedStore, run_id: str, events: list
) -> tuple[Leader, threading.Event, threading.Thread]:
    """Agent ``b``'s election loop on ``store`` (a 30 s lease), running in a thread; its events go to ``events``."""
    config = AgentConfig(run_id=run_id, min_nodes=1, max_nodes=2, nproc_per_node=2, lease_ttl=30)
    emit = lambda event, fields: events.append((event, fields))  # noqa: E731
    stop = threading.Event()
    agent_b = Leader(
        store, config, "b", emit, RecordReader(emit), threading.Event(), stop, lease=lambda: None, latest=lambda: None
    )
    thread = threading.Thread(target=agent_b.run_election, daemon=True)
    thread.start()
    return agent_b, stop, thread


def test_an_agent_probes_a_leader_whose_node_record_came_late_and_takes_over_when_it_dies(server):
    """Agent b sees leader a before a's node record exists (a busy start), so its first look cannot
    probe a's liveness port. It looks again within a second, not a fifth of its 30 s lease: a refusal
    counts only from a port that answered before, so a leader killed right after the start (before a
    later look) would otherwise leave b waiting for a's lease."""
    import socket

    from etc_agent.rendezvous.records import LeaderRecord

    run_id = "late-leader-record"
    writer = EmbeddedStore(server.endpoint, run_id, secret=TEST_SECRET)
    writer.put("leader", LeaderRecord(node_id="a").dumps())
    listener = socket.create_server(("127.0.0.1", 0))
    events: list[tuple[str, dict]] = []
    agent_b, stop, thread = _electing_agent_b(
        EmbeddedStore(server.endpoint, run_id, secret=TEST_SECRET), run_id, events
    )
    try:
        time.sleep(0.5)  # b's first look found the leader key and no node record
        assert not agent_b._gone.knows("a")
        writer.put("nodes/a", _node("a", probe_port=listener.getsockname()[1]))
        deadline = time.monotonic() + 2.0
        while not agent_b._gone.knows("a") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent_b._gone.knows("a"), "b did not probe the leader's port within 2 s"
        listener.close()  # a dies: its port refuses connections from now on
        agent_b.notify_peer_failure()  # b's workers saw a collective fail
        deadline = time.monotonic() + 5.0
        while not any(e == "agent_gone" for e, _ in events) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = [fields for event, fields in events if event == "agent_gone"]
        assert gone and gone[0]["node"] == "a", events
        assert LeaderRecord.loads(writer.get("leader").value).node_id == "b"
    finally:
        stop.set()
        agent_b._dirty.set()  # wake its leader loop, which now sees the stop
        thread.join(timeout=10)


class _LosesTheRace(EmbeddedStore):
    """A store on which agent a creates the leader key right after b's first read found none."""

    def __init__(self, endpoint: str, run_id: str, winner: EmbeddedStore):
        super().__init__(endpoint, run_id, secret=TEST_SECRET)
        self.winner, self.raced = winner, False

    def get(self, key: str):
        found = super().get(key)
        if key == "leader" and not self.raced:
            self.raced = True
            from etc_agent.rendezvous.records import LeaderRecord

            self.winner.create("leader", LeaderRecord(node_id="a").dumps())
        return found


def test_an_agent_that_loses_the_leader_key_race_probes_the_winner_at_once(server):
    """Agents a and b start together and a wins the key between b's read and b's create: b learns the
    winner (and probes its port) at once, not a fifth of its 30 s lease later, so a leader killed in
    the job's first seconds is found gone (the 2x4-leader test's flake)."""
    import socket

    run_id = "lost-race"
    writer = EmbeddedStore(server.endpoint, run_id, secret=TEST_SECRET)
    listener = socket.create_server(("127.0.0.1", 0))
    writer.put("nodes/a", _node("a", probe_port=listener.getsockname()[1]))
    agent_b, stop, thread = _electing_agent_b(_LosesTheRace(server.endpoint, run_id, writer), run_id, [])
    try:
        deadline = time.monotonic() + 2.0
        while not agent_b._gone.knows("a") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agent_b._gone.knows("a"), "b did not probe the winner's port within 2 s"
        assert not agent_b.is_leader
    finally:
        stop.set()
        agent_b.notify_peer_failure()  # wakes its election loop, which now sees the stop
        listener.close()
        thread.join(timeout=10)
