"""EndWatch: the lines that say who the end of a job waits for (pure: times and statuses in, events out)."""

from __future__ import annotations

from etc_agent.agent.endwatch import EndWatch
from etc_agent.rendezvous.records import GenerationRecord

GEN = GenerationRecord(number=3, status="running", members=["a", "b", "c"], num_devices=[2, 2, 2])


def test_a_finished_node_names_the_members_it_waits_for_every_30_s_and_not_before():
    watch = EndWatch("a")
    assert watch.check(0.0, GEN, True, {"a"}, {}) is None  # the wait begins
    assert watch.check(29.0, GEN, True, {"a"}, {}) is None
    event, fields = watch.check(30.5, GEN, True, {"a", "c"}, {})
    assert event == "waiting_for_nodes" and fields["nodes"] == "b" and fields["seconds"] == 30
    assert watch.check(45.0, GEN, True, {"a", "c"}, {}) is None
    assert watch.check(61.0, GEN, True, {"a", "c"}, {})[1]["seconds"] == 61


def test_the_last_node_running_names_its_workers_and_pids():
    watch = EndWatch("b")
    assert watch.check(0.0, GEN, False, {"a"}, {0: 11, 1: 12}) is None  # c still runs: nothing unusual
    assert watch.check(40.0, GEN, False, {"a"}, {0: 11, 1: 12}) is None
    assert watch.check(41.0, GEN, False, {"a", "c"}, {1: 12}) is None  # now b's are the last: the wait begins
    event, fields = watch.check(71.0, GEN, False, {"a", "c"}, {1: 12})
    assert event == "workers_still_running" and fields["local_ranks"] == "1" and fields["pids"] == "12"
    assert fields["seconds"] == 30 and "py-spy" in fields["note"]


def test_a_new_generation_or_the_end_of_the_wait_starts_the_count_again():
    watch = EndWatch("a")
    watch.check(0.0, GEN, True, {"a"}, {})
    assert watch.check(20.0, GEN, True, {"a", "b", "c"}, {}) is None  # nobody missing: the wait is over
    assert watch.check(31.0, GEN, True, {"a"}, {}) is None  # a new wait: counted from 31
    assert watch.check(60.0, GEN, True, {"a"}, {}) is None
    assert watch.check(62.0, GEN, True, {"a"}, {}) is not None
    later = GEN.model_copy(update={"number": 4})
    assert watch.check(100.0, later, True, {"a"}, {}) is None


def test_nothing_is_said_outside_a_running_generation_or_for_a_single_node_job():
    watch = EndWatch("a")
    waiting = GEN.model_copy(update={"status": "waiting"})
    assert all(watch.check(t, waiting, True, set(), {}) is None for t in (0.0, 40.0, 80.0))
    alone = GenerationRecord(number=0, status="running", members=["a"], num_devices=[1])
    assert all(watch.check(t, alone, False, set(), {0: 5}) is None for t in (0.0, 40.0, 80.0))
    spare = EndWatch("z")
    assert all(spare.check(t, GEN, True, {"a"}, {}) is None for t in (0.0, 40.0, 80.0))
