"""The leader's decision as a pure function (etc_agent.agent.decision): one table of snapshots and
what each one calls for, no store and no clock; then the leader's shell on a dict-backed store, where
a snapshot made stale by another leader's publication publishes nothing."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import pytest

from etc_agent.agent.config import AgentConfig
from etc_agent.agent.decision import JOIN_HOLD_S, decide, settled
from etc_agent.agent.leader import Leader
from etc_agent.agent.records import RecordReader
from etc_agent.agent.snapshot import NodeEntry, Settings, Snapshot
from etc_agent.layout.config import ParallelSpec
from etc_agent.rendezvous.records import AbandonRecord, GenerationRecord, NodeRecord, NodeStatus
from etc_agent.rendezvous.store import KeyValue, MembershipStore

NOW = 1_000_000.0
LONG_AGO = NOW - 60  # longer ago than JOIN_HOLD_S
VERSION = 7
TP2 = "tp=2,pp=1,dp=2,zero=0"


def node(node_id: str, revision: int = 0, host: str = "127.0.0.1", **changes) -> NodeEntry:
    """A node with 2 devices; ``revision``: when it registered (the group order after hints)."""
    record = NodeRecord(node_id=node_id, host=host, num_devices=2, pid=1, **changes)
    return NodeEntry(record, revision or 100 + ord(node_id[0]))


def gen(members: list[str], status: str = "running", number: int = 3, **changes) -> GenerationRecord:
    fields = dict(number=number, status=status, members=members, num_devices=[2] * len(members), started=True)
    return GenerationRecord(**{**fields, "published_at": LONG_AGO, **changes})


def snap(*nodes: NodeEntry, current: GenerationRecord | None = None, **changes) -> Snapshot:
    """What the leader read: ``nodes``, and ``current`` at version ``VERSION`` (none: absent)."""
    settings = changes.pop("settings", Settings(min_nodes=1, max_nodes=4))
    version = changes.pop("generation_version", VERSION if current is not None else 0)
    return Snapshot(settings, NOW, version, current, nodes=nodes, **changes)


def crashed(node_id: str, generation: int = 3) -> NodeEntry:
    """A node whose agent restarts a crashed worker (local rank 1): out of the membership until it runs."""
    return node(node_id, ready=False, restarting=[1], crashed_in=generation)


def failed(message: str = "exit 1", fatal: bool = False) -> NodeStatus:
    return NodeStatus(state="failed", exit_codes={1: 1}, message=message, fatal=fatal)


OK = NodeStatus(state="succeeded", exit_codes={0: 0, 1: 0})
MIN2 = Settings(min_nodes=2, max_nodes=4)
MAX2 = Settings(min_nodes=1, max_nodes=2)
WITH_TP2 = Settings(min_nodes=1, max_nodes=4, spec=ParallelSpec.parse("tp=2,dp=auto"))
WITH_TP2_PP2 = Settings(min_nodes=1, max_nodes=4, spec=ParallelSpec.parse("tp=2,pp=2,dp=auto"))
PLAIN = Settings(min_nodes=1, max_nodes=4, job_restarts=2)
VANISHED = Settings(min_nodes=2, max_nodes=4, reregistration_grace_s=6.0)
CRASH_WITH_A_REPLICA = snap(
    node("a"), crashed("b"), current=gen(["a", "b"], parallel=TP2), settings=WITH_TP2, live_job=True
)


@dataclass(frozen=True)
class Expect:
    """What a decision publishes (``status`` None: nothing), and what else it says."""

    status: str | None = None
    members: tuple[str, ...] = ()
    reason: str = ""
    senders: tuple[str, ...] = ()
    number: int = 4
    parallel: str | None = None
    restart_count: int = 0
    started: bool = True
    drop: tuple[str, ...] = ()
    wait_until: float | None = None
    unreachable_hosts: tuple[str, ...] = ()


def on(host: str, *node_ids: str) -> tuple[NodeEntry, ...]:
    """Nodes on one host (its address)."""
    return tuple(node(n, host=host) for n in node_ids)


CASES = [
    # The first generation.
    ("start", snap(node("a"), node("b")), Expect("running", ("a", "b"), "start", number=0, started=False)),
    (
        "start below min_nodes",
        snap(node("a"), settings=MIN2),
        Expect("waiting", ("a",), "1 of at least 2 nodes", number=0, started=False),
    ),
    (
        "node-rank hints first, then registration",
        snap(node("a", 5), node("b", 9, node_rank_hint=0), node("c", 2)),
        Expect("running", ("b", "c", "a"), "start", number=0, started=False),
    ),
    # Membership changes of a running job.
    (
        "join",
        snap(node("a"), node("b"), node("c"), current=gen(["a", "b"])),
        Expect("running", ("a", "b", "c"), "1 joined"),
    ),
    (
        "join held until the current switch is done",
        snap(node("a"), node("b"), node("c"), current=gen(["a", "b"], published_at=NOW - 1), live_job=True),
        Expect(wait_until=NOW - 1 + JOIN_HOLD_S),
    ),
    (
        "join once the current switch is done",
        snap(
            node("a"),
            node("b"),
            node("c"),
            current=gen(["a", "b"], published_at=NOW - 1),
            live_job=True,
            migration_done=True,
        ),
        Expect("running", ("a", "b", "c"), "1 joined"),
    ),
    (
        "planned leave: the leaving node sends its state",
        snap(node("a"), node("b", leaving=True), current=gen(["a", "b"])),
        Expect("running", ("a",), "1 left", senders=("b",)),
    ),
    (
        "the leader's own departure (its last decision)",
        snap(node("a", leaving=True), node("b"), node("c"), current=gen(["a", "b", "c"])),
        Expect("running", ("b", "c"), "1 left", senders=("a",)),
    ),
    (
        "a member that stopped renewing its lease (its record lapsed)",
        snap(node("a"), current=gen(["a", "b"])),
        Expect("running", ("a",), "1 left"),
    ),
    (
        "a join and a leave in one window make one generation",
        snap(node("a"), node("b", leaving=True), node("c"), current=gen(["a", "b"])),
        Expect("running", ("a", "c"), "1 left, 1 joined", senders=("b",)),
    ),
    (
        "a member whose agent is gone leaves at once",
        snap(node("a"), node("b"), current=gen(["a", "b"]), gone=("b",), num_peer_failed=1),
        Expect("running", ("a",), "1 left", drop=("b",)),
    ),
    # Members whose liveness ports went silent (etc_agent.agent.reach).
    (
        "an unreachable member leaves at once and its host is named",
        snap(
            *on("10.0.0.1", "a"),
            *on("10.0.0.2", "b"),
            *on("10.0.0.3", "c"),
            current=gen(["a", "b", "c"]),
            unreachable=("b",),
        ),
        Expect("running", ("a", "c"), "1 left (unreachable: b)", drop=("b",), unreachable_hosts=("10.0.0.2",)),
    ),
    (
        "two unreachable members on two hosts",
        snap(
            *on("10.0.0.1", "a"),
            *on("10.0.0.2", "b"),
            *on("10.0.0.3", "c"),
            current=gen(["a", "b", "c"]),
            unreachable=("a", "c"),
        ),
        Expect(
            "running", ("b",), "2 left (unreachable: a, c)", drop=("a", "c"), unreachable_hosts=("10.0.0.1", "10.0.0.3")
        ),
    ),
    (
        "an unreachable member on a survivor's host: no host to cut",
        snap(*on("10.0.0.1", "a", "b"), *on("10.0.0.3", "c"), current=gen(["a", "b", "c"]), unreachable=("b",)),
        Expect("running", ("a", "c"), "1 left (unreachable: b)", drop=("b",)),
    ),
    (
        "a member gone and unreachable is dropped once",
        snap(*on("10.0.0.1", "a"), *on("10.0.0.2", "b"), current=gen(["a", "b"]), gone=("b",), unreachable=("b",)),
        Expect("running", ("a",), "1 left (unreachable: b)", drop=("b",), unreachable_hosts=("10.0.0.2",)),
    ),
    (
        "an unreachable node that is no member is neither dropped nor admitted",
        snap(
            *on("10.0.0.1", "a"),
            *on("10.0.0.2", "b"),
            *on("10.0.0.3", "c"),
            current=gen(["a", "b"]),
            unreachable=("c",),
        ),
        Expect(),
    ),
    (
        "an unreachable member that leaves the job below --nnodes MIN: the waiting record names its host",
        snap(*on("10.0.0.1", "a"), *on("10.0.0.2", "b"), current=gen(["a", "b"]), unreachable=("b",), settings=MIN2),
        Expect(
            "waiting",
            ("a",),
            "1 of at least 2 nodes (unreachable: b)",
            drop=("b",),
            unreachable_hosts=("10.0.0.2",),
        ),
    ),
    (
        "an unreachable node is not in the first generation",
        snap(*on("10.0.0.1", "a"), *on("10.0.0.2", "b"), unreachable=("b",)),
        Expect("running", ("a",), "start", number=0, started=False),
    ),
    # Bounds.
    (
        "below min_nodes",
        snap(node("a"), current=gen(["a", "b"]), settings=MIN2),
        Expect("waiting", ("a",), "1 of at least 2 nodes"),
    ),
    ("still below min_nodes", snap(node("a"), current=gen(["a"], status="waiting"), settings=MIN2), Expect()),
    (
        "above max_nodes: the third node is a spare",
        snap(node("a"), node("b"), node("c"), settings=MAX2),
        Expect("running", ("a", "b"), "start", number=0, started=False),
    ),
    (
        "a spare does not change a full job",
        snap(node("a"), node("b"), node("c"), current=gen(["a", "b"]), settings=MAX2),
        Expect(),
    ),
    ("nothing changed", snap(node("a"), node("b"), current=gen(["a", "b"])), Expect()),
    # Worker failures.
    (
        "crash with a replica: the others go on",
        CRASH_WITH_A_REPLICA,
        Expect("running", ("a",), "worker failure on b", ("b",), parallel="tp=2,pp=1,dp=1,zero=0", restart_count=1),
    ),
    (
        "crash without a replica: a restart in place",
        snap(
            node("a"),
            crashed("b"),
            current=gen(["a", "b"], parallel="tp=2,pp=2,dp=1,zero=0"),
            settings=WITH_TP2_PP2,
            live_job=True,
            statuses={"b": failed()},
        ),
        Expect(
            "running",
            ("a", "b"),
            "worker failure on b; waiting for its restart in place: the others alone do not fit (--nnodes MIN 1, --parallel)",
            parallel="tp=2,pp=2,dp=1,zero=0",
            restart_count=1,
        ),
    ),
    (
        "plain-script failure: a restart",
        snap(node("a"), node("b"), current=gen(["a", "b"]), settings=PLAIN, statuses={"b": failed()}),
        Expect("running", ("a", "b"), "worker failure on b (restart 1/2)", restart_count=1),
    ),
    (
        "plain-script failure with the restarts used: the job fails",
        snap(node("a"), node("b"), current=gen(["a", "b"], restart_count=2), settings=PLAIN, statuses={"b": failed()}),
        Expect("failed", ("a", "b"), "worker failure on b; 2/2 restarts used", restart_count=2),
    ),
    (
        "a fatal failure fails the job",
        snap(node("a"), node("b"), current=gen(["a", "b"]), live_job=True, statuses={"a": failed("state lost", True)}),
        Expect("failed", ("a", "b"), "state lost"),
    ),
    (
        "an abandoned generation is replaced",
        snap(
            node("a"),
            node("b"),
            current=gen(["a", "b"]),
            abandoned=(AbandonRecord(generation=3, reason="sender died"),),
        ),
        Expect("running", ("a", "b"), "generation 3 abandoned: sender died"),
    ),
    (
        "every member succeeded",
        snap(node("a"), current=gen(["a"]), statuses={"a": OK}),
        Expect("succeeded", ("a",), "all workers exited 0"),
    ),
    ("the job is over", snap(node("a"), node("b"), current=gen(["a"], status="succeeded")), Expect()),
    # Layouts.
    (
        "--parallel fits no group: waiting",
        snap(node("a"), node("b"), settings=replace(WITH_TP2, spec=ParallelSpec.parse("tp=3,dp=auto"))),
        Expect(
            "waiting",
            ("a", "b"),
            "--parallel tp=3,pp=1,dp=auto,zero=0 fits no group of the 2 nodes (4 devices)",
            number=0,
            started=False,
        ),
    ),
    (
        "etc-agent reconfigure",
        snap(
            node("a"),
            node("b"),
            current=gen(["a", "b"], parallel=TP2),
            settings=WITH_TP2,
            requested_spec=ParallelSpec.parse("tp=1,dp=auto"),
        ),
        Expect("running", ("a", "b"), "reconfigured to tp=1,pp=1,dp=4,zero=0", parallel="tp=1,pp=1,dp=4,zero=0"),
    ),
    # The store lost the job's records.
    (
        "records vanished: agents still putting theirs back",
        snap(node("a"), settings=VANISHED, latest=gen(["a", "b"], number=4), vanished_for_s=1.0),
        Expect(wait_until=NOW + 5.0),
    ),
    (
        "records vanished: the grace is over",
        snap(node("a"), settings=VANISHED, latest=gen(["a", "b"], number=4), vanished_for_s=7.0),
        Expect("waiting", ("a",), "1 of at least 2 nodes", number=5),
    ),
    (
        "records vanished: the members are back",
        snap(node("a"), node("b"), settings=VANISHED, latest=gen(["a", "b"], number=4), vanished_for_s=1.0),
        Expect("running", ("a", "b"), "records vanished from the store", number=5),
    ),
    (
        "a foreign generation value: numbered after every number used",
        snap(node("a"), generation_version=3, latest=gen(["a"], number=2), used_numbers=(0, 1, 6)),
        Expect("running", ("a",), "start", number=7),
    ),
]


@pytest.mark.parametrize(("snapshot", "expect"), [pytest.param(s, e, id=name) for name, s, e in CASES])
def test_decision(snapshot: Snapshot, expect: Expect):
    made = decide(snapshot)
    assert made.drop == expect.drop and made.wait_until == expect.wait_until, made
    if expect.status is None:
        assert made.record is None, made
        return
    record = made.record
    assert record is not None, made
    assert made.version == snapshot.generation_version  # published only if generation is still at it
    assert (record.status, tuple(record.members), record.reason) == (expect.status, expect.members, expect.reason)
    assert record.num_devices == [2] * len(record.members) and record.number == expect.number
    assert tuple(record.senders) == expect.senders and record.parallel == expect.parallel
    assert (record.restart_count, record.started) == (expect.restart_count, expect.started)
    assert tuple(record.unreachable_hosts) == expect.unreachable_hosts
    assert made.failed == (record.reason if record.status == "failed" else None)
    if record.status in ("running", "waiting"):
        assert record.published_at == NOW


def test_a_crashed_workers_node_sends_from_its_surviving_workers_and_the_placement_follows():
    made = decide(CRASH_WITH_A_REPLICA)
    assert made.record is not None and made.record.sender_local_ranks == [[0]]
    assert made.record.placement == ["a:0", "a:1"]


SETTLED = [
    ("first generation, every allowed node registered", snap(node("a"), node("b"), settings=MAX2), True),
    ("first generation, more may join", snap(node("a"), settings=MAX2), False),
    ("a member failed", snap(node("a"), current=gen(["a", "b"]), statuses={"b": failed()}), True),
    ("a collective failed", snap(node("a"), current=gen(["a", "b"]), num_peer_failed=1), True),
    ("every member succeeded", snap(node("a"), current=gen(["a"]), statuses={"a": OK}), True),
    ("a join", snap(node("a"), node("b"), current=gen(["a"])), False),
    ("waiting", snap(node("a"), current=gen(["a"], status="waiting")), False),
    ("a member unreachable", snap(node("a"), node("b"), current=gen(["a", "b"]), unreachable=("b",)), True),
    ("a node unreachable that is no member", snap(node("a"), node("b"), current=gen(["a"]), unreachable=("b",)), False),
]


@pytest.mark.parametrize(("snapshot", "expected"), [pytest.param(s, e, id=name) for name, s, e in SETTLED])
def test_settled(snapshot: Snapshot, expected: bool):
    """Whether the leader decides without waiting for --reconfig-delay of quiet."""
    assert settled(snapshot) is expected


class DictStore(MembershipStore):
    """The store interface on a dict: versions and revisions as etcd counts them, no leases or watches."""

    def __init__(self):
        super().__init__("decision")
        self.data: dict[str, KeyValue] = {}
        self.revision = 0

    def write(self, key: str, value: str, lease_id: int = 0) -> None:
        found = self.data.get(key)
        self.revision += 1
        self.data[key] = KeyValue(key, value, (found.version if found else 0) + 1, self.revision, lease_id)

    def get(self, key):
        return self.data.get(key)

    def get_prefix(self, prefix=""):
        return [kv for key, kv in sorted(self.data.items()) if key.startswith(prefix)]

    def put(self, key, value, lease=None):
        self.write(key, value, lease.id if lease else 0)

    def compare_and_set(self, key, value, expected_version, lease=None):
        found = self.data.get(key)
        if (found.version if found else 0) != expected_version:
            return False
        self.put(key, value, lease)
        return True

    def put_if_unchanged(self, key, value, guard_key, guard_revision):
        found = self.data.get(guard_key)
        if (found.mod_revision if found else 0) != guard_revision:
            return False
        self.put(key, value)
        return True

    def delete(self, key):
        return self.data.pop(key, None) is not None

    def grant_lease(self, ttl):
        raise NotImplementedError

    def watch_prefix(self, prefix, callback, on_error=None):
        raise NotImplementedError

    def close(self):
        pass


def test_the_leader_publishes_nothing_from_a_snapshot_another_leader_made_stale():
    """Leader a reads the store (b is leaving) and decides; before it writes, another leader publishes
    generation 4. a's compare-and-set on the version it read fails: nothing is published, no event."""
    store = DictStore()
    store.write("generation", gen(["a", "b"]).dumps())
    store.write("nodes/a", node("a").record.dumps(), lease_id=1)
    store.write("nodes/b", node("b", leaving=True).record.dumps(), lease_id=1)
    events: list[tuple[str, dict]] = []
    emit = lambda event, fields: events.append((event, fields))  # noqa: E731
    config = AgentConfig(run_id="decision", min_nodes=1, max_nodes=2, nproc_per_node=2)
    stop = threading.Event()
    leader = Leader(store, config, "a", emit, RecordReader(emit), threading.Event(), stop, lambda: None, lambda: None)
    snapshot = leader._snapshot()
    made = decide(snapshot)
    assert made.record is not None and made.record.members == ["a"] and made.version == 1
    other = gen(["a", "b"], number=4, reason="another leader's")
    store.write("generation", other.dumps())
    leader._apply(snapshot, made)
    assert GenerationRecord.loads(store.get("generation").value) == other
    assert not [e for e, _ in events if e == "generation_published"], events
    leader.decide()  # a fresh read decides on generation 4
    published = GenerationRecord.loads(store.get("generation").value)
    assert (published.number, published.members, published.reason) == (5, ["a"], "1 left")
    assert [f["generation"] for e, f in events if e == "generation_published"] == [5]


# ---- ready layouts ------------------------------------------------------------------------------
READY_BASE = dict(settings=WITH_TP2, live_job=True)


def test_a_node_loss_takes_the_layout_made_ready_for_it_and_spends_nothing_on_it():
    """While a, b, c run tp=2 (dp=3), the leader works out the layout of each member's loss; when b
    goes (its record lapsed), the decision finds exactly its inputs among them: the record says the
    layout was ready and the decision spent 0 s on it, and it is the layout worked out afresh."""
    from etc_agent.agent.decision import likely_layouts, prepare_layout

    running = gen(["a", "b", "c"], parallel="tp=2,pp=1,dp=3,zero=0")
    before = snap(node("a"), node("b"), node("c"), current=running, **READY_BASE)
    likely = likely_layouts(before)
    assert [ordered for ordered, _ in likely] == [["b", "c"], ["a", "c"], ["a", "b"]]
    ready = dict(prepare_layout(before, ordered, devices) for ordered, devices in likely)
    after = snap(node("a"), node("c"), current=running, ready_layouts=ready, **READY_BASE)
    made = decide(after)
    assert made.record is not None and made.record.layout_ready and made.record.layout_seconds == 0.0
    fresh = decide(snap(node("a"), node("c"), current=running, **READY_BASE))
    assert fresh.record is not None and not fresh.record.layout_ready and fresh.record.layout_seconds > 0
    assert (made.record.parallel, made.record.placement) == (fresh.record.parallel, fresh.record.placement)
    assert made.record.members == ["a", "c"]


def test_a_ready_layout_made_for_another_membership_or_generation_is_never_used():
    """Ready layouts for b's loss do not serve c's loss, nor b's loss after the generation they
    assumed was replaced (another previous placement): those decisions work their layout out."""
    from dataclasses import replace as replaced

    from etc_agent.agent.decision import likely_layouts, prepare_layout

    running = gen(["a", "b", "c"], parallel="tp=2,pp=1,dp=3,zero=0")
    before = snap(node("a"), node("b"), node("c"), current=running, **READY_BASE)
    b_lost = [(o, d) for o, d in likely_layouts(before) if "b" not in o]
    ready = dict(prepare_layout(before, o, d) for o, d in b_lost)
    made = decide(snap(node("a"), node("b"), current=running, ready_layouts=ready, **READY_BASE))
    assert made.record is not None and made.record.members == ["a", "b"] and not made.record.layout_ready
    newer = gen(
        ["a", "b", "c"],
        number=4,
        parallel="tp=2,pp=1,dp=3,zero=0",
        placement=["c:0", "c:1", "a:0", "a:1", "b:0", "b:1"],
    )
    stale = decide(snap(node("a"), node("c"), current=newer, ready_layouts=ready, **READY_BASE))
    assert stale.record is not None and not stale.record.layout_ready
    # A ready layout is keyed by everything it read: the settings too.
    resilient = replaced(WITH_TP2, resilient_placement=True)
    other = decide(snap(node("a"), node("c"), current=running, ready_layouts=ready, settings=resilient, live_job=True))
    assert other.record is not None and not other.record.layout_ready


def test_the_leader_prepares_the_layouts_of_its_members_losses_while_a_generation_runs():
    """The leader's decide, with nothing to change, works out in the background the layout of each
    member's loss; a member's record then lapses and the generation the leader publishes says its
    layout was ready; the ready layouts of the old generation are dropped for the new one's."""
    store = DictStore()
    running = gen(
        ["a", "b", "c"], parallel="tp=2,pp=1,dp=3,zero=0", placement=["a:0", "a:1", "b:0", "b:1", "c:0", "c:1"]
    )
    store.write("generation", running.dumps())
    for name in "abc":
        store.write(f"nodes/{name}", node(name).record.dumps(), lease_id=1)
    events: list[tuple[str, dict]] = []
    emit = lambda event, fields: events.append((event, fields))  # noqa: E731
    config = AgentConfig(run_id="decision", min_nodes=1, max_nodes=4, nproc_per_node=2, parallel="tp=2,dp=auto")
    leader = Leader(
        store, config, "a", emit, RecordReader(emit), threading.Event(), threading.Event(), lambda: None, lambda: None
    )
    leader.decide()
    assert leader.ready.wait(30) and len(leader.ready.snapshot()) == 3
    store.delete("nodes/b")
    leader.decide()
    published = GenerationRecord.loads(store.get("generation").value)
    assert published.members == ["a", "c"] and published.layout_ready and published.layout_seconds == 0.0
    assert [f.get("layout_ready") for e, f in events if e == "generation_published"] == [True]
    leader.decide()  # nothing to change: the layouts of the new generation's members' losses
    assert leader.ready.wait(30) and len(leader.ready.snapshot()) == 2
    assert all(inputs.previous[0] == published.number for inputs in leader.ready.snapshot())
