"""The generation protocol's shared pieces: the state table, the typed agent->worker contract, the
rank arithmetic of a generation record, and which errors count as a peer's failure."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from conftest import make_assignment

from etc_agent.migrate.transport import MigrationError
from etc_agent.protocol.control import Assignment, AssignmentReply
from etc_agent.protocol.phases import TRANSITIONS, Phase, PhaseTracker
from etc_agent.rendezvous.records import GenerationRecord
from etc_agent.worker.errors import ArrivalTimeout, BuildMismatch, JobError, is_peer_failure, names_peer_failure

# ---- the state table ------------------------------------------------------------------------


def test_every_phase_has_a_row_and_the_terminal_ones_lead_nowhere():
    assert set(TRANSITIONS) == set(Phase)
    assert all(target in Phase for targets in TRANSITIONS.values() for target in targets)
    assert TRANSITIONS[Phase.FINISHED] == TRANSITIONS[Phase.FAILED] == frozenset()


@pytest.mark.parametrize(
    "path",
    [
        # a survivor through a join, then a crash of a peer, then the end
        [
            Phase.MIGRATING,
            Phase.RUNNING,
            Phase.PENDING,
            Phase.MIGRATING,
            Phase.RUNNING,
            Phase.RECOVERING,
            Phase.MIGRATING,
            Phase.RUNNING,
            Phase.FINISHED,
        ],
        # a departing node's worker: it sends its shards and exits
        [Phase.MIGRATING, Phase.RUNNING, Phase.PENDING, Phase.MIGRATING, Phase.DEPARTING],
        # a switch that a peer's death abandons, then the retry superseded by a newer generation
        [Phase.MIGRATING, Phase.RECOVERING, Phase.MIGRATING, Phase.MIGRATING, Phase.RUNNING],
        # a spare taken in, left out again (it sends), taken back
        [
            Phase.MIGRATING,
            Phase.RUNNING,
            Phase.PENDING,
            Phase.MIGRATING,
            Phase.DEPARTING,
            Phase.MIGRATING,
            Phase.RUNNING,
        ],
    ],
    ids=["survivor", "sender", "abandoned", "spare-back"],
)
def test_the_paths_the_protocol_takes_are_in_the_table(path):
    tracker = PhaseTracker("test")
    for generation, phase in enumerate(path):
        tracker.to(phase, generation)
    assert tracker.phase == path[-1] and tracker.generation == len(path) - 1


@pytest.mark.parametrize(
    "start,refused",
    [
        (Phase.RUNNING, Phase.MIGRATING),  # a switch is agreed at a step boundary first (pending)
        (Phase.SPARE, Phase.RUNNING),  # a spare trains only after it migrated in
        (Phase.FINISHED, Phase.RUNNING),
        (Phase.FAILED, Phase.MIGRATING),
    ],
)
def test_a_transition_the_table_does_not_have_is_refused(start, refused):
    tracker = PhaseTracker("worker n0:1", start)
    with pytest.raises(AssertionError, match=f"worker n0:1: no transition {start.value} -> {refused.value}"):
        tracker.to(refused, 3)
    assert tracker.phase == start


# ---- a generation's devices and ranks -------------------------------------------------------


def _generation(**fields) -> GenerationRecord:
    base = dict(number=4, status="running", members=["a", "b"], num_devices=[2, 3], senders=["c"], sender_devices=[2])
    return GenerationRecord(**{**base, **fields})


def test_devices_and_ranks_follow_member_order_then_senders():
    gen = _generation()
    assert gen.member_devices() == ["a:0", "a:1", "b:0", "b:1", "b:2"]
    assert gen.transport_devices(with_senders=True) == [*gen.member_devices(), "c:0", "c:1"]
    assert gen.transport_devices(with_senders=False) == gen.member_devices()
    assert [gen.transport_rank("b", r) for r in range(3)] == [2, 3, 4]
    assert [gen.transport_rank("c", r) for r in range(2)] == [5, 6]
    assert gen.training_rank("b", 1) == 3


def test_a_placement_decides_training_ranks_but_not_transport_ranks():
    gen = _generation(placement=["b:0", "a:0", "b:1", "a:1", "b:2"])
    assert [gen.training_rank("a", r) for r in range(2)] == [1, 3]
    assert [gen.training_rank("b", r) for r in range(3)] == [0, 2, 4]
    assert gen.transport_rank("a", 1) == 1


def test_roles():
    gen = _generation()
    assert gen.role_of("a", with_senders=True) == "member"
    assert gen.role_of("c", with_senders=True) == "sender"
    assert gen.role_of("c", with_senders=False) == "spare"  # checkpoint mode: senders saved and exited already
    assert gen.role_of("z", with_senders=True) == "spare"


# ---- the agent -> worker contract -----------------------------------------------------------


def test_an_assignment_reply_parses_into_typed_fields_and_refuses_unknown_keys():
    assignment = dict(
        generation=4,
        pg_rank=5,
        pg_world_size=7,
        rank=None,
        world_size=5,
        parallel="tp=1,pp=1,dp=5,zero=0",
        store_addr="h",
        store_port=1234,
        devices=_generation().transport_devices(True),
        leaving=True,
        started=True,
        trained=True,
        reason="1 left",
        published_at=1.5,
        node_id="c",
    )
    reply = AssignmentReply.model_validate(
        dict(latest=4, latest_status="running", assignment=assignment, finished=False, standby=False, stop=False)
    )
    parsed = reply.assignment
    assert isinstance(parsed, Assignment) and parsed.device == "c:0" and parsed.rank is None
    assert parsed.member_devices == _generation().member_devices() and parsed.sender_devices == ["c:0", "c:1"]
    with pytest.raises(ValueError, match="extra"):
        Assignment.model_validate({**assignment, "pg_rnak": 1})
    with pytest.raises(ValueError, match="store_port"):
        Assignment.model_validate({**assignment, "store_port": 70000})


# ---- whose fault: a peer's --------------------------------------------------------------------

PEER_MESSAGES = {
    "gloo": "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 120000ms for recv operation",
    "nccl": "NCCL communicator was aborted on rank 2",
    "connection": "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4711",
    "timed out": "Timed out waiting 120000ms for recv operation to complete",
    "timeout": "Socket Timeout",
    "peer": "Connection reset by peer",
    "process group": "the process group was destroyed",
    "processgroup": "ProcessGroupGloo::allreduce: aborted",
    "socket": "[c10d] socket closed unexpectedly",
}


@pytest.mark.parametrize("word", list(PEER_MESSAGES))
def test_each_word_that_names_a_peer_failure_matches_a_message_of_that_kind(word):
    message = PEER_MESSAGES[word]
    assert word in message.lower()
    assert names_peer_failure(message)
    assert is_peer_failure(RuntimeError(message))


def test_what_is_not_a_peer_failure():
    assert not names_peer_failure("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)")
    assert not is_peer_failure(RuntimeError("CUDA out of memory"))
    assert not is_peer_failure(ValueError("connection"))  # only RuntimeErrors come from torch's transports
    assert not is_peer_failure(JobError("timed out waiting for generation 3"))  # the job's own errors are not a peer's
    assert not is_peer_failure(BuildMismatch("socket"))


def test_typed_peer_failures_need_no_words():
    assert is_peer_failure(MigrationError("rank 3 sent nothing"))
    assert is_peer_failure(ArrivalTimeout("2 of 3 arrived"))
    assert is_peer_failure(dist.DistError("x"))


# ---- the migration record -------------------------------------------------------------------


class _Gathered:
    """A transport whose all_gather_object returns what every process would have sent."""

    def __init__(self, others: list[dict]):
        self.others = others

    def all_gather_object(self, obj):
        return [obj, *self.others]


def test_detection_after_a_failure_is_measured_even_when_a_replacement_reports_it():
    """The replacement that becomes new rank 0 saw no failure itself (it just started); the
    survivors did, and detection is the time from their first stop to the publish."""
    from types import SimpleNamespace

    from etc_agent.worker.report import Clocks, live_record

    plan = SimpleNamespace(
        bytes_moved=10, bytes_moved_inter_node=4, state_bytes=20, checkpoint_bytes=60, bytes_restored=0
    )
    metrics = SimpleNamespace(
        describe_s=0.0,
        exchange_s=0.0,
        local_s=0.0,
        plan_s=0.01,
        check_s=0.0,
        setup_s=0.0,
        peer_wait_s=0.0,
        pack_s=0.0,
        transfer_s=0.02,
        unpack_s=0.0,
        transfer_phase_s=0.02,
        bytes_reused=5,
        bytes_copied_locally=1,
        planned_ahead=False,
    )
    result = SimpleNamespace(plan=plan, metrics=metrics)
    devices = ["a:0", "b:0"]
    assignment = make_assignment(
        generation=2,
        pg_world_size=2,
        world_size=2,
        parallel="tp=1,pp=1,dp=2,zero=0",
        devices=devices,
        reason="worker failure on b",
        published_at=100.0,
        node_id="a",
    )
    survivor = {
        "stop_wall": 98.8,
        "stall": 1.5,
        "agree": 1.2,
        "rebuild": 0.1,
        "plan": 0.01,
        "transfer": 0.02,
        "kept": 5,
        "failure": True,
        "prepared": True,
        "built_ahead": True,
        "touched_ahead": 4096,
    }
    clocks = Clocks(started=0.0, grouped=0.0, built=0.0)
    record = live_record(
        _Gathered([survivor]),
        assignment,
        "tp=1,pp=1,dp=2,zero=0",
        7,
        "tp=1,pp=1,dp=2,zero=0",
        result,
        ["b:0"],
        None,
        clocks,
        False,
        None,
        0,
    )
    assert record is not None and record.detect_s == pytest.approx(1.2)
    assert record.devices == devices and record.lost == ["b:0"] and record.step == 7
    assert record.num_prepared == 1  # the survivor had formed the generation's migration group; the replacement not
    assert record.num_built_ahead == 1 and record.bytes_touched_ahead == 4096


def test_a_stall_splits_into_consecutive_parts_that_add_up():
    from etc_agent.rendezvous.records import StallParts
    from etc_agent.worker.report import Clocks, MigrationTimes

    # entered 10.5, arrived 11.0, migration group 11.25, training group 11.75, built 12.25, exchanged 12.5
    clocks = Clocks(started=10.5, grouped=11.75, built=12.25, arrived=11.0, migration_grouped=11.25, exchanged=12.5)
    clocks.migrated = 14.0
    times = MigrationTimes(describe_s=0.125, plan_s=0.25, transfer_s=0.75, local_copy_s=0.0625, peer_wait_s=0.25)
    parts = clocks.parts(10.0, times, 14.5)
    assert parts == {
        "stop_s": 0.5,
        "arrive_s": 0.5,
        "migration_group_s": 0.25,
        "group_s": 0.5,
        "build_s": 0.5,
        "exchange_s": 0.25,
        "settle_s": 0.5,
        "describe_s": 0.125,
        "plan_s": 0.25,
        "transfer_s": 0.75,
        "local_copy_s": 0.0625,
        "plan_check_s": 0.0,
        "setup_s": 0.0,
        "peer_wait_s": 0.25,
        "migrate_other_s": 0.0625,
        "unaccounted_s": 0.0,
    }
    assert sum(parts.values()) == 4.5
    StallParts(**parts)  # every part is a field of the record
    # A process that is not a member (a sender) builds nothing: its marks coincide, parts are 0.
    sender = Clocks(started=1.0, grouped=1.4, built=1.4, arrived=1.2, migration_grouped=1.4, exchanged=1.5)
    sender.migrated = 2.0
    sender_parts = sender.parts(0.5, MigrationTimes(plan_s=0.1, transfer_s=0.2), 2.5)
    assert sender_parts["group_s"] == sender_parts["build_s"] == 0.0
    assert sum(sender_parts.values()) == pytest.approx(2.0)
    # A generation prepared while training: arrived and migration group formed before the stop.
    prepared = Clocks(started=1.0, grouped=1.3, built=1.6, arrived=1.0, migration_grouped=1.0, exchanged=1.7)
    prepared.migrated = 2.0
    prepared_parts = prepared.parts(0.9, MigrationTimes(), 2.0)
    assert prepared_parts["arrive_s"] == prepared_parts["migration_group_s"] == 0.0
    assert prepared_parts["group_s"] == pytest.approx(0.3) and prepared_parts["unaccounted_s"] == 0.0
