"""Preparing the next generation while training (etc_agent.worker.prepare), on a real TCPStore and
real gloo groups: two ranks are two threads of this process, each with its own view of the agent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import make_assignment

from etc_agent.protocol.control import Assignment
from etc_agent.worker import prepare
from etc_agent.worker.errors import ArrivalTimeout
from etc_agent.worker.prepare import Preparation, Preparations

DEVICES = ["n0:0", "n1:0"]


class _Link:
    """What a worker hears from its agent: its part in the newest generation (set by the test)."""

    def __init__(self) -> None:
        self.current: Assignment | None = None
        self.finished = False

    def newer_than(self, generation: int) -> Assignment | None:
        current = self.current
        return current if current is not None and current.generation > generation else None


def _assignment(generation: int, pg_rank: int, port: int) -> Assignment:
    return make_assignment(
        generation=generation,
        pg_rank=pg_rank,
        pg_world_size=len(DEVICES),
        rank=pg_rank,
        world_size=len(DEVICES),
        parallel="tp=1,pp=1,dp=2,zero=0",
        store_port=port,
        devices=DEVICES,
        node_id=DEVICES[pg_rank].split(":")[0],
    )


@pytest.fixture
def store_port():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store.port
    del store


def _on_both(fn: Callable[[int], object]) -> list[object]:
    results: list[object] = [None, None]

    def run(rank: int) -> None:
        results[rank] = fn(rank)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_the_next_generation_is_arrived_at_and_its_migration_group_formed_while_training(store_port):
    links = [_Link(), _Link()]
    preparations = [Preparations(link, 20.0, enabled=True) for link in links]  # type: ignore[arg-type]
    for rank, prep in enumerate(preparations):
        prep.notice(2)
        assert prep.current is None  # nothing newer than the generation training
        links[rank].current = _assignment(3, rank, store_port)
        prep.notice(2)
    started = [prep.current for prep in preparations]
    for prep, first in zip(preparations, started, strict=True):
        prep.notice(2)  # every later boundary finds it under way: one preparation per generation
        assert prep.current is first
        assert prep.take(2) is None and prep.current is first  # an older switch leaves it for its own

    taken: list[Preparation] = [prep.take(3) for prep in preparations]  # type: ignore[misc]
    for rank, preparation in enumerate(taken):
        assert preparation is started[rank] and preparation.error is None and not preparation.superseded
        assert preparation.group is not None and preparation.store is not None
        assert preparation.group.rank() == rank and preparation.group.size() == 2
    assert taken[0].store.add("gen3/arrived", 0) == 2  # type: ignore[union-attr]

    def all_reduce(rank: int) -> torch.Tensor:
        tensor = torch.arange(4, dtype=torch.float32) + 10 * rank
        taken[rank].group.allreduce([tensor]).wait()  # type: ignore[union-attr]
        return tensor

    for tensor in _on_both(all_reduce):
        assert torch.equal(tensor, torch.tensor([10.0, 12.0, 14.0, 16.0]))  # the prepared group works


def test_a_newer_generation_supersedes_a_preparation_and_a_missing_peer_is_named(store_port):
    link = _Link()
    prep = Preparations(link, 1.0, enabled=True)  # type: ignore[arg-type]
    link.current = _assignment(4, 0, store_port)
    prep.notice(3)
    older = prep.current
    assert older is not None
    link.current = _assignment(5, 0, store_port)  # published while generation 4's processes arrive
    prep.notice(3)
    newer = prep.current
    assert newer is not None and newer is not older and newer.generation == 5
    assert older.join() and older.superseded and older.group is None and older.error is None
    assert prep.take(4) is None and prep.current is newer

    taken = prep.take(5)  # the peer n1:0 never arrives at generation 5
    assert taken is newer and taken.group is None
    assert isinstance(taken.error, ArrivalTimeout) and "missing: n1:0" in str(taken.error)


def test_nothing_is_prepared_when_it_is_off_or_there_is_no_agent(store_port):
    link = _Link()
    link.current = _assignment(7, 0, store_port)
    for prep in (Preparations(link, 5.0, enabled=False), Preparations(None, 5.0, enabled=True)):  # type: ignore[arg-type]
        prep.notice(6)
        assert prep.current is None and prep.take(7) is None


def test_a_rank_asks_the_others_to_train_on_while_it_prepares_for_at_most_the_grace(store_port, monkeypatch):
    links = [_Link(), _Link()]
    preparations = [Preparations(link, 20.0, enabled=True) for link in links]  # type: ignore[arg-type]
    first = preparations[0]
    assert not first.preparing(3, "running", 3)  # nothing newer than the generation training
    assert not first.preparing(4, "waiting", 3)  # the ranks hold at the boundary for it instead
    assert first.preparing(4, "running", 3)  # its agent does not serve its part of 4 yet

    links[0].current = _assignment(4, 0, store_port)
    first.notice(3)
    time.sleep(0.3)
    assert first.preparing(4, "running", 3)  # its thread waits for the other rank to arrive
    links[1].current = _assignment(4, 1, store_port)
    preparations[1].notice(3)
    for prep in preparations:
        assert prep.current is not None and prep.current.join()
        assert not prep.preparing(4, "running", 3)
        assert prep.take(4).group is not None  # type: ignore[union-attr]

    monkeypatch.setattr(prepare, "PREPARE_GRACE_S", 0.2)
    assert first.preparing(6, "running", 3)  # never served to this rank (a spare node's, say)
    time.sleep(0.3)
    assert not first.preparing(6, "running", 3)  # past the grace: the switch does it in the stall


def test_the_agent_links_thread_starts_a_preparation_between_boundaries_but_never_inside_a_switch(store_port):
    link = _Link()
    prep = Preparations(link, 1.0, enabled=True)  # type: ignore[arg-type]
    prep.poll()
    assert prep.current is None  # not armed: the job has not reached a step boundary yet
    prep.notice(2)
    link.current = _assignment(3, 0, store_port)
    prep.poll()  # the link's reply served generation 3: preparing starts without waiting for a boundary
    started = prep.current
    assert started is not None and started.generation == 3
    prep.poll()
    assert prep.current is started  # once per generation

    link.current = _assignment(4, 0, store_port)
    assert prep.take(4) is None  # the switch entered 4 itself (3's preparation dropped)
    prep.poll()
    assert prep.current is None  # disarmed: 4's arrival is the switch's own, never counted twice
    prep.notice(4)
    assert prep.current is None  # nothing newer than the generation now training
    assert started.join() and started.superseded


def test_a_teardown_waits_for_a_build_ahead_and_a_stuck_one_is_named(store_port, monkeypatch):
    link = _Link()
    prep = Preparations(link, 0.3, enabled=True)  # type: ignore[arg-type]
    monkeypatch.setattr(prepare, "JOIN_MARGIN_S", 0.0)
    released = threading.Event()

    def build_ahead() -> None:
        with prep.member_lock:
            released.wait(0.15)

    builder = threading.Thread(target=build_ahead)
    builder.start()
    time.sleep(0.05)
    started = time.monotonic()
    with prep.beside_no_build():  # waits for the build (0.15 s), within the bound (0.3 s)
        waited = time.monotonic() - started
    builder.join()
    assert 0.05 <= waited < 0.3

    link.current = _assignment(4, 0, store_port)
    prep.current = Preparation(link.current, link, 0.3)  # type: ignore[arg-type]
    prep.member_lock.acquire()  # a build ahead that never ends
    try:
        with pytest.raises(RuntimeError, match=r"preparing generation 4 .* did not end within 0 s"):
            with prep.beside_no_build():
                pass
    finally:
        prep.member_lock.release()
        prep.current.join()
