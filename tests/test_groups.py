"""A destroyed process group is freed, so peers blocked in it fail at once (etc_agent.worker.groups)."""

from __future__ import annotations

import os
import sys
import time
import types
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from dist_harness import run_workers

from etc_agent.worker.groups import destroy_all_groups, release_defaults


def test_destroy_all_groups_replaces_function_defaults_that_hold_the_group_and_frees_it():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    group = dist.group.WORLD
    module = types.ModuleType("torch._etc_agent_test_defaults")

    def collective(tensor, group=group): ...

    def keyword_only(tensor, *, group=group, other=3): ...

    module.collective, module.keyword_only = collective, keyword_only
    collective.__module__ = keyword_only.__module__ = module.__name__
    sys.modules[module.__name__] = module
    try:
        ref = weakref.ref(group)
        del group
        assert destroy_all_groups() == []
        assert ref() is None
        assert collective.__defaults__ == (None,)
        assert keyword_only.__kwdefaults__ == {"group": None, "other": 3}
    finally:
        del sys.modules[module.__name__]
        if dist.is_initialized():
            dist.destroy_process_group()


def test_after_a_formation_that_failed_inside_init_process_group_the_next_one_uses_the_same_group_names():
    """A rank whose init_process_group gave up (its peer never came) has used torch's first group
    name; after the teardown it must form under the names its peers use, or both wait forever."""
    from etc_agent.worker.genstore import GenerationStore

    inner = dist.HashStore()
    store = GenerationStore(inner, 3, lambda: None, timeout_s=0.5)
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=5))
    except RuntimeError as err:
        assert "timed out after" in str(err)  # rank 1 never came
    else:
        raise AssertionError("init_process_group formed without its peer")
    assert not dist.is_initialized() and dist.distributed_c10d._world.group_count == 1  # torch counted a name
    assert destroy_all_groups() == []
    assert dist.distributed_c10d._world.group_count == 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=5))
    try:
        assert dist.group.WORLD.group_name == "0"  # the name a fresh peer gives its default group
    finally:
        dist.destroy_process_group()


def test_release_defaults_leaves_modules_outside_torch_and_other_defaults_alone():
    sentinel = object()
    module = types.ModuleType("not_torch_module")

    def f(x=sentinel): ...

    module.f = f
    sys.modules[module.__name__] = module
    try:
        assert release_defaults([sentinel]) == 0
        assert f.__defaults__ == (sentinel,)
    finally:
        del sys.modules[module.__name__]


def _all_reduce_until_a_peer_dies(rank: int, world: int, marks: str) -> float | None:
    """Functional all-reduces (as DTensor issues them); the last rank exits at iteration 20. A
    survivor returns how long after the death its collective failed."""
    marks_dir = Path(marks)
    x = torch.ones(256)
    try:
        for i in range(10**6):
            if rank == world - 1 and i == 20:
                (marks_dir / "death").write_text(repr(time.time()))
                os._exit(1)
            funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))
    except Exception:  # noqa: BLE001 - the failure is what is measured
        waited = time.time() - float((marks_dir / "death").read_text())
    assert destroy_all_groups() == []
    # Stay alive until every survivor failed: an exiting process closes its sockets anyway.
    (marks_dir / f"failed{rank}").write_text("1")
    deadline = time.monotonic() + 60
    while len(list(marks_dir.glob("failed*"))) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return waited


def test_every_survivor_leaves_a_functional_collective_within_2s_of_a_peer_death(tmp_path):
    results = run_workers(
        4, _all_reduce_until_a_peer_dies, str(tmp_path), pg_timeout_s=30.0, timeout_s=120.0, may_exit=frozenset({3})
    )
    waits = results[:3]
    assert results[3] is None
    assert all(w is not None and w <= 2.0 for w in waits), f"seconds from the death to failing: {waits}"


def _form_through_a_generation_store(rank: int, world: int, port: int, marks: str, mode: str) -> tuple[float, str]:
    """Ranks 0..world-2 form a gloo group of ``world`` with :func:`gloo_group` through a GenerationStore;
    the last rank never comes. ``mode`` "superseded": a newer generation appears 1 s in; "timeout":
    none does (2 s limit)."""
    from etc_agent.worker.connect import gloo_group
    from etc_agent.worker.genstore import GenerationStore

    inner = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=30), wait_for_workers=False)
    started = time.monotonic()
    newer = Path(marks) / "newer"
    if rank == 0:
        newer.unlink(missing_ok=True)
    if rank == world - 1:
        return 0.0, "absent"

    def superseded() -> int | None:
        if mode == "superseded" and time.monotonic() - started > 1.0:
            return 8
        return None

    store = GenerationStore(inner, 7, superseded, timeout_s=2.0 if mode == "timeout" else 30.0)
    try:
        gloo_group(dist.PrefixStore("gen7/migrate/", store), rank, world, timedelta(seconds=30))
    except RuntimeError as err:
        message = str(err)
    else:
        message = "formed"
    took = time.monotonic() - started
    (Path(marks) / f"done{rank}").write_text("1")
    deadline = time.monotonic() + 30  # the store's server (rank 0) stays up until the others are done
    while rank == 0 and len(list(Path(marks).glob("done*"))) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return took, message


def test_forming_a_group_gives_up_when_a_newer_generation_exists_or_at_its_timeout_naming_the_missing_rank(tmp_path):
    from dist_harness import free_port

    from etc_agent.worker.errors import is_peer_failure

    for mode, limit_s, words in (
        ("superseded", 3.0, "superseded by generation 8"),
        ("timeout", 4.0, "timed out after 2 s"),
    ):
        results = run_workers(3, _form_through_a_generation_store, free_port(), str(tmp_path), mode)
        for took, message in results[:2]:
            assert took <= limit_s and words in message and "gen7/migrate//0/2" in message, (mode, took, message)
            assert is_peer_failure(RuntimeError(message))
        for mark in tmp_path.glob("done*"):
            mark.unlink()


def _form_while_a_peer_dies_after_publishing(rank: int, world: int, port: int, marks: str) -> tuple[float, str]:
    """Ranks form a gloo group of ``world`` with :func:`gloo_group` (collective timeout 30 s); the last
    rank publishes its address and exits at its first wait in the store, before it connects. Each
    survivor reports how long it took to learn of the death (in the constructor or at its first
    receive from that peer) and the error."""
    from etc_agent.worker.connect import gloo_group
    from etc_agent.worker.genstore import GenerationStore

    class DiesAfterPublishing(GenerationStore):
        def wait(self, keys, timeout=None):
            if rank == world - 1:
                os._exit(9)
            super().wait(keys, timeout)

    inner = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=30), wait_for_workers=False)
    store = DiesAfterPublishing(inner, 7, lambda: None, timeout_s=30.0)
    started = time.monotonic()
    try:
        group = gloo_group(dist.PrefixStore("gen7/migrate/", store), rank, world, timedelta(seconds=30))
        # The active side of a pair counts it connected once its connect and first write succeed,
        # which the kernel may grant a peer that is exiting: that rank learns at its first receive.
        group.recv([torch.zeros(1)], world - 1, 0).wait()
    except RuntimeError as err:
        message = str(err)
    else:
        message = "received from the dead peer"
    took = time.monotonic() - started
    (Path(marks) / f"done{rank}").write_text("1")
    deadline = time.monotonic() + 30  # the store's server (rank 0) stays up until the others are done
    while rank == 0 and len(list(Path(marks).glob("done*"))) < world - 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return took, message


def test_a_peer_that_dies_between_publishing_its_address_and_connecting_costs_the_others_seconds(tmp_path):
    """gloo's passive side waits 5 x the group's timeout for a connection that never comes (50 s for a
    10 s timeout with torch's constructor, scripts/repro_connect_wedge.py); formed under the connect
    bound (1 s by default) the others fail within 5 s, with an error the switch takes for a peer failure.
    Which side of each pair is passive follows the ports, so a run may test only the active side."""
    from dist_harness import free_port

    from etc_agent.worker.connect import CONNECT_WAIT_FACTOR, connect_timeout_s
    from etc_agent.worker.errors import is_peer_failure

    results = run_workers(
        3, _form_while_a_peer_dies_after_publishing, free_port(), str(tmp_path), may_exit=frozenset({2})
    )
    assert results[2] is None
    limit_s = CONNECT_WAIT_FACTOR * connect_timeout_s() + 2.0
    for took, message in results[:2]:
        assert took <= limit_s, (took, message)
        assert is_peer_failure(RuntimeError(message)), message


def _late_collective(rank: int, world: int, port: int) -> tuple[float, float]:
    """A group formed by :func:`gloo_group`, then an all-reduce that rank 1 joins 3 s late."""
    from etc_agent.worker.connect import gloo_group

    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=30))
    group = gloo_group(dist.PrefixStore("late/", store), rank, world, timedelta(seconds=30))
    if rank == 1:
        time.sleep(3.0)
    started = time.monotonic()
    tensor = torch.arange(4, dtype=torch.float32) + rank
    group.allreduce([tensor]).wait()
    return time.monotonic() - started, float(tensor.sum())


def test_a_gloo_group_s_collective_waits_for_a_late_rank_up_to_the_collective_timeout():
    from dist_harness import free_port

    from etc_agent.worker.connect import connect_timeout_s

    assert connect_timeout_s() < 3.0  # else the late peer below would not test anything
    waits = run_workers(2, _late_collective, free_port())
    assert waits[0][0] >= 2.5 and all(total == 16.0 for _, total in waits), waits


def _late_rank(rank: int, world: int, port: int) -> tuple[float, float]:
    """Three ranks form a group with :func:`gloo_group` under a 0.2-s connect timeout (a 1-s bound
    once the store calls are over); the last rank comes 2 s late. Every rank must form it."""
    from etc_agent.worker.connect import gloo_group

    os.environ["ETC_AGENT_CONNECT_TIMEOUT"] = "0.2"
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=30))
    if rank == world - 1:
        time.sleep(2.0)
    started = time.monotonic()
    group = gloo_group(dist.PrefixStore("late-rank/", store), rank, world, timedelta(seconds=30))
    tensor = torch.arange(4, dtype=torch.float32) + rank
    group.allreduce([tensor]).wait()
    return time.monotonic() - started, float(tensor.sum())


def test_a_rank_later_than_the_connect_bound_still_forms_the_group():
    """The connect bound counts from the end of gloo's store calls (every address read), not from
    the start: a peer still building its state, later than the bound, is waited for in the store."""
    from dist_harness import free_port

    results = run_workers(3, _late_rank, free_port())
    assert results[0][0] >= 1.5 and all(total == 3 * 6.0 + 12.0 for _, total in results), results


def _late_send(rank: int, world: int, port: int, how: str) -> tuple[float, list[float]]:
    """A pair of ranks in a group formed by ``how``; rank 0 sends an arange 3 s late, rank 1 receives
    without a timeout of its own (as ``dist.recv`` and a pipeline stage's ``work.wait()`` do)."""
    from etc_agent.layout.config import ParallelConfig
    from etc_agent.worker.connect import gloo_group
    from etc_agent.worker.context import make_context

    timeout = timedelta(seconds=30)
    if how == "gloo_group":
        store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timeout)
        group = gloo_group(dist.PrefixStore("p2p/", store), rank, world, timeout)
        send = lambda tensor: group.send([tensor], 1, 0).wait()  # noqa: E731
        recv = lambda tensor: group.recv([tensor], 0, 0).wait()  # noqa: E731
    else:  # a mesh's pp group, as a job without an agent forms it (the harness made the default group)
        ctx = make_context(ParallelConfig(tp=1, pp=2, dp=1), rank, 0, torch.device("cpu"), timeout=timeout)
        send = lambda tensor: dist.send(tensor, 1, group=ctx.pp_group)  # noqa: E731
        recv = lambda tensor: dist.recv(tensor, 0, group=ctx.pp_group)  # noqa: E731
    tensor = torch.arange(4, dtype=torch.float32) if rank == 0 else torch.zeros(4)
    started = time.monotonic()
    if rank == 0:
        time.sleep(3.0)
        send(tensor)
    else:
        recv(tensor)
    return time.monotonic() - started, tensor.tolist()


def test_a_point_to_point_receive_waits_for_a_late_sender_up_to_the_collective_timeout():
    """gloo copies a group's forming timeout into the receive path: groups formed under a 1-s
    connect bound failed a receive whose sender came over 1 s late (a pipeline stage's neighbour)."""
    from dist_harness import free_port

    from etc_agent.worker.connect import connect_timeout_s

    assert connect_timeout_s() < 3.0  # else the late sender below would not test anything
    for how in ("gloo_group", "mesh"):
        results = run_workers(2, _late_send, free_port(), how)
        assert results[1][0] >= 2.5 and results[1][1] == [0.0, 1.0, 2.0, 3.0], (how, results)
