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
