"""The fence: a node cut off from the store stops; a store outage every node shares is ridden through."""

from __future__ import annotations

import pytest

from etc_agent.agent.contact import SLOW_S, ContactedStore, StoreContact
from etc_agent.agent.fence import (
    CONFIRM_S,
    OUTAGE_END_GRACE_S,
    REACH_WINDOW_S,
    RELAPSE_WINDOW_S,
    Fence,
    PeerView,
    fence_after,
    fence_verdict,
)
from etc_agent.rendezvous.store import StoreError
from etc_agent.utils.liveness import LivenessPort, ask_many


def view(node: str, heard: float, generation: int | None = 4, silent: bool | None = None) -> PeerView:
    return PeerView(node, heard, heard > 1.0 if silent is None else silent, generation)


AFTER = fence_after(5.0)


@pytest.mark.parametrize(
    "silence,peers,state,says",
    [
        (AFTER, {"b": view("b", 0.1), "c": view("c", 9.0)}, "fenced", "while b reach it"),
        (AFTER, {"b": view("b", 0.1, silent=True)}, "shared_outage", "(b) lost it too"),
        (AFTER, {"b": view("b", 9.0, generation=5)}, "fenced", "b serve a newer generation"),
        (AFTER, {"b": view("b", 9.0, generation=4)}, "shared_outage", "lost it too"),
        (AFTER, {"b": None, "c": None}, "fenced", "no peer answers (b, c)"),
        (AFTER, {}, "fenced", "no other member can vouch"),
        (AFTER, {"b": view("b", 4.0), "c": None}, "shared_outage", "every peer asked (b) lost it too"),
        (AFTER, {"b": view("b", REACH_WINDOW_S, silent=False), "c": view("c", 3.5)}, "shared_outage", "(b, c)"),
    ],
)
def test_the_verdict(silence, peers, state, says):
    verdict = fence_verdict(silence, 4, peers)
    assert verdict.state == state and says in verdict.reason
    if state == "shared_outage":  # generation 0 is a generation like any other
        renumbered = {n: v and PeerView(v.node_id, v.heard_s, v.silent, 0) for n, v in peers.items()}
        assert fence_verdict(silence, 0, renumbered).state == "shared_outage"


def _lease_confirmed(contact: StoreContact) -> None:
    token, at = contact.sent()
    contact.answered(token, at, lease=True)


def test_the_fence_asks_the_peers_once_the_lease_is_old_and_says_each_change_once():
    clock = [100.0]
    contact = StoreContact(clock=lambda: clock[0])
    events: list[tuple[str, dict]] = []
    answers = {"b": view("b", 0.2).to_line()}
    asked: list[dict] = []

    def ask(targets, timeout_s):
        asked.append(dict(targets))
        return {k: answers.get(k) for k in targets}

    fence = Fence("a", 5.0, contact, lambda e, f: events.append((e, f)), ask=ask)
    peers = [("b", "10.0.0.2", 7001), ("c", "10.0.0.3", 7002)]
    _lease_confirmed(contact)
    assert fence.check(4, peers) == "clear" and asked == []
    clock[0] += 1.0
    token, _ = contact.sent()
    contact.failed(token)  # silent from 101.0
    clock[0] += CONFIRM_S + 0.1
    assert fence.check(4, peers) == "clear" and asked == []  # the lease is not old enough yet
    clock[0] = 100.0 + AFTER + 0.01
    assert fence.check(4, peers) == "fenced" and fence.fenced
    assert asked == [{"b": ("10.0.0.2", 7001), "c": ("10.0.0.3", 7002)}]
    clock[0] += 1.0
    assert fence.check(4, peers) == "fenced" and len(asked) == 1  # fenced until the store answers
    _lease_confirmed(contact)
    assert fence.check(4, peers) == "clear"
    assert [e for e, _ in events] == ["fenced", "unfenced"]
    assert "while b reach it" in events[0][1]["reason"]


def test_peers_are_asked_only_once_the_silence_is_known_for_a_while():
    """Every agent learns of an outage at about the same time: asked at once, a peer whose request
    has not failed yet would vouch for a store that no longer answers."""
    clock = [0.0]
    contact = StoreContact(clock=lambda: clock[0])
    asked: list[dict] = []
    fence = Fence("a", 5.0, contact, lambda e, f: None, ask=lambda t, s: asked.append(t) or {})
    _lease_confirmed(contact)
    clock[0] = AFTER + 1.0
    token, _ = contact.sent()
    contact.failed(token)
    assert fence.check(4, [("b", "h", 1)]) == "clear" and asked == []
    clock[0] += CONFIRM_S
    assert fence.check(4, [("b", "h", 1)]) == "fenced" and len(asked) == 1  # nobody answered


def test_a_shared_outage_goes_on_and_turns_into_a_fence_when_a_peer_reaches_the_store_again():
    clock = [0.0]
    contact = StoreContact(clock=lambda: clock[0])
    events: list[str] = []
    answers = {"b": view("b", 5.0).to_line()}
    fence = Fence("a", 5.0, contact, lambda e, f: events.append(e), ask=lambda t, s: dict(answers))
    token, _ = contact.sent()
    clock[0] = AFTER + 0.5
    contact.failed(token)
    clock[0] += CONFIRM_S
    assert fence.check(4, [("b", "h", 1)]) == "shared_outage"
    clock[0] += 0.2
    answers["b"] = view("b", 0.1).to_line()
    assert fence.check(4, [("b", "h", 1)]) == "shared_outage"  # asked again only every ASK_INTERVAL_S
    clock[0] += 0.5
    # The outage is ending and b heard the store first: a lease's grace before this node fences.
    assert fence.check(4, [("b", "h", 1)]) == "shared_outage"
    clock[0] += 0.5
    assert fence.check(4, [("b", "h", 1)]) == "shared_outage"
    clock[0] += 0.6
    assert fence.check(4, [("b", "h", 1)]) == "fenced"
    assert events == ["store_outage_shared", "fenced"]


def test_a_failed_request_right_after_a_shared_outage_ends_gets_the_same_grace_before_a_fence():
    """Seen in the quorum-loss test on two loaded cores: the store answered, the outage was over, a
    request failed a moment later while the peer already heard the store: that fenced the node for
    0.25 s. A relapse within RELAPSE_WINDOW_S of the outage's end waits OUTAGE_END_GRACE_S first; a
    silence that outlasts the grace still fences, and one long after the outage fences at once."""
    clock = [0.0]
    contact = StoreContact(clock=lambda: clock[0])
    events: list[str] = []
    answers = {"b": view("b", 5.0).to_line()}
    fence = Fence("a", 5.0, contact, lambda e, f: events.append(e), ask=lambda t, s: dict(answers))
    peers = [("b", "h", 1)]
    token, _ = contact.sent()
    clock[0] = AFTER + 0.5
    contact.failed(token)
    clock[0] += CONFIRM_S
    assert fence.check(4, peers) == "shared_outage"
    clock[0] += 0.5
    token, at = contact.sent()
    contact.answered(token, at)  # the new etcd leader answers: the outage is over
    assert fence.check(4, peers) == "clear"
    token, _ = contact.sent()
    clock[0] += 0.1
    contact.failed(token)  # and a request fails right after, while b already hears the store
    answers["b"] = view("b", 0.1).to_line()
    clock[0] += CONFIRM_S
    assert fence.check(4, peers) == "clear"  # the grace, as at the end of the outage itself
    clock[0] += OUTAGE_END_GRACE_S / 2
    assert fence.check(4, peers) == "clear"
    clock[0] += OUTAGE_END_GRACE_S
    assert fence.check(4, peers) == "fenced"  # still silent after the grace: cut off after all
    assert events == ["store_outage_shared", "store_outage_over", "fenced"]
    # Long after an outage, the same silence fences without a grace.
    token, at = contact.sent()
    contact.answered(token, at)
    assert fence.check(4, peers) == "clear"
    clock[0] += RELAPSE_WINDOW_S + 10.0
    token, _ = contact.sent()
    contact.failed(token)
    clock[0] += CONFIRM_S
    assert fence.check(4, peers) == "fenced"


def test_a_request_still_waiting_counts_as_silence_a_busy_caller_does_not():
    clock = [0.0]
    contact = StoreContact(clock=lambda: clock[0])
    clock[0] = 10.0
    assert contact.silence_s() == 0.0  # no request: nothing says the store is silent
    contact.sent()
    clock[0] += SLOW_S / 2
    assert contact.silence_s() == 0.0
    clock[0] += SLOW_S
    assert contact.silence_s() == pytest.approx(10.0 + 1.5 * SLOW_S)  # since the last answer (at 0)


def test_the_contacted_store_times_every_request():
    from test_decision import DictStore

    class Flaky(DictStore):
        broken = False

        def get(self, key):
            if self.broken:
                raise StoreError("down")
            return super().get(key)

    clock = [0.0]
    contact = StoreContact(clock=lambda: clock[0])
    inner = Flaky()
    store = ContactedStore(inner, contact)
    store.put("k", "v")
    inner.broken = True
    clock[0] = 3.0
    with pytest.raises(StoreError):
        store.get("k")
    assert contact.silence_s() == pytest.approx(3.0)
    inner.broken = False
    assert store.get("k").value == "v" and contact.silence_s() == 0.0


def test_a_liveness_port_tells_a_peer_its_view_and_a_prober_still_gets_in():
    contact = StoreContact()
    fence = Fence("a", 5.0, contact, lambda e, f: None)
    port = LivenessPort(lambda: fence.status_line(7))
    try:
        answers = ask_many({"a": ("127.0.0.1", port.port)}, 1.0)
        seen = PeerView.from_line(answers["a"])
        assert seen is not None and seen.node_id == "a" and seen.generation == 7 and seen.heard_s < 1.0
        assert not seen.silent and seen.reaches_store
    finally:
        port.close()
    assert ask_many({"a": ("127.0.0.1", port.port)}, 0.3) == {"a": None}  # closed: no answer


def _node(store, events):
    from pathlib import Path

    from etc_agent.agent.config import AgentConfig
    from etc_agent.agent.controlauth import ControlKeys
    from etc_agent.agent.node import Node
    from etc_agent.agent.node_state import NodeStateMachine
    from etc_agent.agent.records import RecordReader
    from etc_agent.agent.workers import WorkerSpec

    emit = lambda e, f: events.append((e, f))  # noqa: E731
    return Node(
        config=AgentConfig(run_id="fence", min_nodes=1, max_nodes=2, nproc_per_node=1),
        spec=WorkerSpec(entrypoint=["train.py"]),
        store=store,
        node_id="a",
        host="10.0.0.1",
        emit=emit,
        run_dir=Path("/nonexistent"),
        state=NodeStateMachine("agent a"),
        reader=RecordReader(emit),
        control_keys=ControlKeys(1, False),
    )


def test_a_job_that_finished_through_a_store_outage_is_marked_finished_once_the_store_answers():
    """Rank 0 reports the last step while the store is down: the marker waits and is written on the
    next pass that finds the store answering, so the job is reported finished, never failed."""
    from test_decision import DictStore

    class Down(DictStore):
        down = True

        def put(self, key, value, lease=None):
            if self.down:
                raise StoreError("etcd put failed: no leader")
            super().put(key, value, lease)

    store, events = Down(), []
    node = _node(store, events)
    node.mark_finished(step=200, generation=3)
    assert store.get("finished") is None and node.job_finished()  # this node knows; the store does not yet
    assert [e for e, _ in events] == ["store_unreachable"]
    node.report_pending()
    assert store.get("finished") is None
    store.down = False
    node.report_pending()
    assert store.get("finished").value == '{"step": 200, "generation": 3}'
    node.report_pending()  # written once
    assert store.get("finished").version == 1


def test_a_checkpoint_commit_is_fenced_on_its_generations_revision(tmp_path):
    """Rank 0's commit: committed while the generation key is at the revision its generation was
    published at (the state file renamed, the record in the store); kept waiting while the node is
    fenced or the store silent, and tried again on the next pass; refused, atomically and with its
    directory removed, once a newer generation replaced its own; a path outside the checkpoint
    directory is never touched."""
    from test_decision import DictStore

    from etc_agent.agent.commits import Commits
    from etc_agent.protocol.checkpoints import PENDING_FILE, STATE_FILE, checkpoint_path
    from etc_agent.protocol.control import CommitCheckpoint
    from etc_agent.rendezvous.records import CheckpointRecord, GenerationRecord

    class Flaky(DictStore):
        down = False

        def put_if_unchanged(self, key, value, guard_key, guard_revision):
            if self.down:
                raise StoreError("etcd transaction failed: no leader")
            return super().put_if_unchanged(key, value, guard_key, guard_revision)

    store, events = Flaky(), []
    node = _node(store, events)
    node.config = node.config.model_copy(update={"checkpoint_dir": str(tmp_path), "checkpoint_keep": 2})
    store.write("generation", GenerationRecord(number=4, status="running", members=["a"], num_devices=[1]).dumps())
    node.generation = node.read_generation()
    commits = Commits(node)

    def written(step: int, generation: int) -> CommitCheckpoint:
        path = checkpoint_path(tmp_path, step, generation)
        path.mkdir(parents=True)
        (path / PENDING_FILE).write_text("{}")
        return CommitCheckpoint(step=step, generation=generation, path=str(path))

    first = written(10, 4)
    assert commits.request(first).outcome == "committed"
    assert (checkpoint_path(tmp_path, 10, 4) / STATE_FILE).exists()
    record = CheckpointRecord.loads(store.get("checkpoint").value)
    assert (record.step, record.generation, record.revision) == (10, 4, store.get("generation").mod_revision)

    node.fenced = True
    assert commits.request(written(15, 4)).outcome == "pending"  # fenced: nothing is committed
    node.fenced, store.down = False, True
    commits.retry()  # the store is silent: still waiting
    assert CheckpointRecord.loads(store.get("checkpoint").value).step == 10
    store.down = False
    commits.retry()
    assert CheckpointRecord.loads(store.get("checkpoint").value).step == 15

    store.down = True
    stale = written(20, 4)
    assert commits.request(stale).outcome == "pending"
    store.write("generation", GenerationRecord(number=5, status="running", members=["b"], num_devices=[1]).dumps())
    store.down = False
    commits.retry()  # generation 4 was replaced meanwhile: refused, directory removed
    assert CheckpointRecord.loads(store.get("checkpoint").value).step == 15
    assert not checkpoint_path(tmp_path, 20, 4).exists()
    assert [e for e, _ in events if e.startswith("checkpoint_")] == [
        "checkpoint_committed",
        "checkpoint_commit_waiting",
        "checkpoint_committed",
        "checkpoint_commit_waiting",
        "checkpoint_commit_refused",
    ]
    outside = tmp_path.parent / "elsewhere"
    with pytest.raises(ValueError, match="is not step 30 of generation 4 under --checkpoint-dir"):
        commits.request(CommitCheckpoint(step=30, generation=4, path=str(outside)))
