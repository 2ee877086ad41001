"""The plan made ahead (``etc_agent/worker/ahead.py``): every process publishes its description on
the generation's store once, and a plan comes only from a complete, planned set of them."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from conftest import make_assignment

from etc_agent.layout import ParallelConfig
from etc_agent.migrate import BoxedTensor
from etc_agent.protocol.control import Assignment
from etc_agent.worker.ahead import OldState, plan_ahead_on

FULL = torch.arange(48.0).view(12, 4)


def _assignment(pg_rank: int, rank: int | None, generation: int = 3) -> Assignment:
    """Three processes: two members of a dp=2 world, the third a sender."""
    return make_assignment(
        generation=generation,
        pg_rank=pg_rank,
        pg_world_size=3,
        rank=rank,
        world_size=2,
        parallel="tp=1,pp=1,dp=2,zero=0",
        devices=["a:0", "b:0", "c:0"],
        leaving=rank is None,
        node_id="abc"[pg_rank],
    )


def _old(rank: int) -> OldState:
    """Old rank ``rank`` of a 3-way row split of ``w``."""
    return OldState({"w": BoxedTensor(FULL[rank * 4 : rank * 4 + 4].clone(), (12, 4), (rank * 4, 0), (4, 4))}, rank, 3)


def _new(rank: int) -> dict:
    """New rank ``rank`` of dp=2: a whole replica of ``w``."""
    return {"w": torch.empty(12, 4)} if rank is not None else {}


VIEW = SimpleNamespace(config_for=lambda parallel, world_size: ParallelConfig.parse(parallel))


def _run_all(store: dist.Store, olds: list, news: list, wait_s: float = 5.0) -> tuple[list, float]:
    """Every process's plan_ahead_on in a thread of its own, as their preparations run it."""
    out: list = [None] * 3
    ranks = [0, 1, None]

    def one(i: int) -> None:
        out[i] = plan_ahead_on(VIEW, store, _assignment(i, ranks[i]), olds[i], news[i], lambda: False, wait_s)  # type: ignore[arg-type]

    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, time.monotonic() - started


def test_every_process_plans_the_same_from_everyones_published_description():
    plans, _ = _run_all(dist.HashStore(), [_old(0), _old(1), _old(2)], [_new(0), _new(1), None])
    assert all(p is not None for p in plans)
    assert len({p.vote for p in plans}) == 1 and plans[0].plan.bytes_moved > 0
    assert len({p.mine for p in plans}) == 3  # each kept the digest of its own description


def test_a_member_not_built_yet_publishes_null_and_nobody_waits_for_a_plan():
    # Member 1 has no new state to describe: it publishes null at once, so nobody waits out wait_s.
    plans, took = _run_all(dist.HashStore(), [_old(0), _old(1), _old(2)], [_new(0), None, None], wait_s=20.0)
    assert plans == [None, None, None] and took < 10.0


def test_nothing_is_planned_ahead_when_an_old_rank_has_no_live_holder():
    # The sender brings no state (old rank 2 was lost with a crashed process): the executor must
    # plan around the lost rank inside the stall.
    plans, _ = _run_all(dist.HashStore(), [_old(0), _old(1), None], [_new(0), _new(1), None])
    assert plans == [None, None, None]


def test_a_process_that_brings_no_state_gives_up_after_its_wait():
    store = dist.HashStore()
    started = time.monotonic()
    plan = plan_ahead_on(VIEW, store, _assignment(1, 1), None, _new(1), lambda: False, 0.3)  # type: ignore[arg-type]
    assert plan is None and 0.3 <= time.monotonic() - started < 5.0
    assert store.check(["gen3/ahead/1"])  # published all the same: the others need not wait for it


def test_a_process_already_inside_the_stall_publishes_null_without_describing():
    store = dist.HashStore()
    broken = {"w": object()}  # describing it would fail: it is not looked at
    plan = plan_ahead_on(VIEW, store, _assignment(0, 0), _old(0), broken, lambda: True, 5.0)  # type: ignore[arg-type]
    assert plan is None and store.get("gen3/ahead/0") == b"null"


def test_nothing_is_planned_ahead_where_reading_everyones_descriptions_would_load_the_store_too_much(monkeypatch):
    import etc_agent.worker.ahead as ahead

    monkeypatch.setattr(ahead, "AHEAD_MAX_STORE_BYTES", 9 * 100)  # 3 processes: 100 bytes each at most
    store = dist.HashStore()
    plans, _ = _run_all(store, [_old(0), _old(1), _old(2)], [_new(0), _new(1), None])
    assert plans == [None, None, None] and store.get("gen3/ahead/0") == b"null"
